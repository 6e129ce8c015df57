"""The native CPU row gather and scatter (``pagedkv/backends/rows.c`` through
:mod:`pagedkv.backends.native_rows`).

The suite's drawn pools are far below :data:`native_rows.MIN_BYTES`, so the indexed backend takes
``index_select`` / ``index_copy_`` there; the native paths are searched here with the size floor
lifted, and checked at their real size once."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.backends import get_backend, native_rows
from pagedkv.testing.compare import assert_bitwise_equal

INDEXED = get_backend("indexed")
needs_native = pytest.mark.skipif(not native_rows.available(),
                                  reason="the native row gather was not built (no C compiler at install)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.uint8]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bytes of ``x`` (NaN payloads and fp8 compare exactly)."""
    return x.contiguous().flatten().view(torch.uint8)


def _definition(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    bs = cache.shape[1]
    rows = [cache[int(table[p // bs]), p % bs] for p in range(seq_len)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


def test_a_machine_with_a_c_compiler_builds_it():
    """The extension is optional so that an install without a compiler still works; where there is
    one, a missing library means the build step is broken, and the gather silently slow."""
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("no C compiler on this machine")
    if os.environ.get("PAGEDKV_NATIVE_ROWS") == "0":
        pytest.skip("PAGEDKV_NATIVE_ROWS=0 turns it off")
    assert native_rows.available()


@st.composite
def _gathers(draw):
    dtype = draw(st.sampled_from(DTYPES))
    num_rows = draw(st.integers(1, 12))
    # 0: empty rows; long rows (past rows.c's LINES_AHEAD of 256 cache lines) prefetch within the row
    row_shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)
                     | st.lists(st.integers(2040, 17000), min_size=1, max_size=1))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pool = torch.randint(0, 256, (num_rows, *row_shape), dtype=torch.uint8, generator=gen)
    pool = pool.view(dtype) if dtype.itemsize == 1 else torch.randn(num_rows, *row_shape, generator=gen).to(dtype)
    ids = torch.tensor(draw(st.lists(st.integers(0, num_rows - 1), max_size=40)), dtype=torch.int64)
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return pool, ids, draw(st.integers(1, 4))


@contextlib.contextmanager
def _native_at_any_size(threads: int = 1):
    """The native loops take every call (no size floor), splitting rows over ``threads`` however few."""
    previous = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_rows, "MIN_BYTES", 0)
        mp.setattr(native_rows, "THREAD_BYTES", 1)
        torch.set_num_threads(threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)


@needs_native
@settings(max_examples=150, deadline=None)
@given(_gathers())
def test_gather_rows_copies_exactly_the_named_rows(drawn):
    """Any dtype, row length (odd, under a cache line, unaligned for streaming stores), repeated ids,
    both id dtypes, one to four threads: bit for bit ``pool[ids]``."""
    pool, ids, threads = drawn
    out = torch.empty((ids.shape[0], *pool.shape[1:]), dtype=pool.dtype)
    out.view(torch.uint8).fill_(7)  # a byte the copy must overwrite everywhere
    with _native_at_any_size(threads):
        assert native_rows.gather_rows(pool, ids, out)
    assert torch.equal(_bits(out), _bits(pool[ids.long()]))


@needs_native
@settings(max_examples=150, deadline=None)
@given(_gathers())
def test_scatter_rows_writes_exactly_the_named_rows_and_nothing_else(drawn):
    """The twin: distinct ids, so ``pool[ids] = src`` is defined; every other row keeps its bytes."""
    pool, ids, threads = drawn
    ids = torch.unique(ids.long())[torch.randperm(torch.unique(ids).numel())].to(ids.dtype)
    src = torch.empty((ids.shape[0], *pool.shape[1:]), dtype=pool.dtype)
    src.view(torch.uint8).copy_(torch.randint(0, 256, src.view(torch.uint8).shape, dtype=torch.uint8))
    want = pool.clone()
    want[ids.long()] = src
    with _native_at_any_size(threads):
        assert native_rows.scatter_rows(pool, ids, src)
    assert torch.equal(_bits(pool), _bits(want))


@needs_native
@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 6), heads=st.integers(1, 3), dim=st.integers(1, 20),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e5m2]), data=st.data())
def test_the_indexed_backend_through_the_native_path_gathers_what_each_slot_holds(block_size, heads, dim, dtype,
                                                                                  data):
    num_blocks = data.draw(st.integers(1, 10))
    cache = torch.randn(num_blocks, block_size, heads, dim).to(dtype)
    table = torch.tensor(data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=8)))
    seq_len = data.draw(st.integers(0, table.shape[0] * block_size))
    with _native_at_any_size(data.draw(st.integers(1, 3))):
        out = INDEXED.gather(cache, table, seq_len)
    assert out.is_contiguous() and out.shape == (seq_len, heads, dim)
    assert torch.equal(_bits(out), _bits(_definition(cache, table, seq_len)))


@needs_native
@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 6), heads=st.integers(1, 3), dim=st.integers(1, 20),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_the_indexed_backend_writes_through_the_native_path_exactly_where_the_slots_say(block_size, heads, dim,
                                                                                       dtype, data):
    """``write_kv`` (the flat slot view, padding slots dropped) and ``scatter`` (whole blocks); fp8
    pools take the same bytes path after quantizing (the gather and scatter_rows tests draw fp8)."""
    num_blocks = data.draw(st.integers(1, 10))
    k_cache = torch.randn(num_blocks, block_size, heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, heads, dim).to(dtype)
    slots = data.draw(st.lists(st.integers(-1, num_blocks * block_size - 1), max_size=12)
                      .filter(lambda s: len({x for x in s if x >= 0}) == len([x for x in s if x >= 0])))
    key = torch.randn(len(slots), heads, dim).to(dtype)
    value = torch.randn(len(slots), heads, dim).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = key[i]
            want_v[slot // block_size, slot % block_size] = value[i]
    table = torch.randperm(num_blocks)[: data.draw(st.integers(1, num_blocks))]
    values = torch.randn(table.shape[0] * block_size, heads, dim).to(dtype)
    with _native_at_any_size(data.draw(st.integers(1, 3))):
        INDEXED.write_kv(k_cache, v_cache, key, value, torch.tensor(slots, dtype=torch.int64))
        assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))
        INDEXED.scatter(k_cache, table, values)
    assert torch.equal(_bits(INDEXED.gather(k_cache, table, values.shape[0])), _bits(values))


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_a_fragmented_block_size_1_gather_of_its_real_size_takes_the_native_path(threads):
    """8 x 128 float32 at block size 1 and 512 tokens (2 MiB): the size the bench's limits start at."""
    gen = torch.Generator().manual_seed(threads)
    cache = torch.randn(1024, 1, 8, 128, generator=gen)
    table = torch.randperm(1024, generator=gen)[:512]
    out = torch.empty(512, 1, 8, 128)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert native_rows.gather_rows(cache, table, out)
        assert_bitwise_equal(out, cache[table])
        assert_bitwise_equal(INDEXED.gather(cache, table, 511), _definition(cache, table, 511))
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_large_blocks_of_their_real_size_take_the_native_path_both_ways(threads):
    """8 x 128 float32 at block size 256 (1 MiB blocks), whole blocks and a partial one: gathered, then
    scattered."""
    blocks = 3
    gen = torch.Generator().manual_seed(threads)
    cache = torch.randn(blocks + 3, 256, 8, 128, generator=gen)
    table = torch.randperm(blocks + 3, generator=gen)[: blocks + 1]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty(blocks, 256, 8, 128)
        assert native_rows.gather_rows(cache, table[:blocks], out)
        assert_bitwise_equal(out, cache[table[:blocks]])
        seq_len = blocks * 256 + 7
        assert_bitwise_equal(INDEXED.gather(cache, table, seq_len), _definition(cache, table, seq_len))
        values = torch.randn(blocks, 256, 8, 128, generator=gen)
        want = cache.clone()
        want[table[:blocks]] = values
        assert native_rows.scatter_rows(cache, table[:blocks], values)
        assert_bitwise_equal(cache, want)
    finally:
        torch.set_num_threads(previous)


@needs_native
@pytest.mark.parametrize("bad", [-1, 9, 2**40])
def test_an_id_out_of_range_writes_nothing_and_the_op_still_raises(bad):
    cache = torch.randn(9, 1, 2, 4)
    ids = torch.tensor([3, 1, bad, 0])
    out = torch.zeros(4, 1, 2, 4)
    before = cache.clone()
    with _native_at_any_size():
        assert not native_rows.gather_rows(cache, ids, out)
        assert torch.count_nonzero(out) == 0
        assert not native_rows.scatter_rows(cache, ids, torch.ones(4, 1, 2, 4))
        assert torch.equal(cache, before)
        with pytest.raises(IndexError):  # validate="none": the id reaches index_select, which refuses it
            INDEXED.gather(cache, ids, 4, validate="none")


@needs_native
def test_calls_it_cannot_take_are_left_to_the_caller():
    cache = torch.randn(6, 4, 2, 8)
    ids = torch.tensor([5, 0, 2])
    out = torch.empty(3, 4, 2, 8)
    with _native_at_any_size():
        assert not native_rows.gather_rows(cache.transpose(1, 2).contiguous().transpose(1, 2), ids, out)  # strided
        assert not native_rows.gather_rows(cache, ids, out.double())  # dtype mismatch
        assert not native_rows.gather_rows(cache, ids, torch.empty(3, 4, 2, 7))  # row shape mismatch
        assert not native_rows.gather_rows(cache, ids.float(), out)  # not integer ids
        assert not native_rows.gather_rows(cache, ids[:2], out)  # length mismatch
    assert not native_rows.gather_rows(cache, ids, out)  # under MIN_BYTES


def test_pagedkv_native_rows_0_turns_it_off():
    code = "from pagedkv.backends import native_rows; print(native_rows.available())"
    env = {**os.environ, "PAGEDKV_NATIVE_ROWS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
