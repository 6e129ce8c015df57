"""Slot and offset arithmetic past 2**24 slots and 2**31 elements at the candidate's declared
geometry (:class:`~pagedkv.testing.cases.limit.LimitCase`).

The memory trick: on a CPU the pools sit on a fresh anonymous mapping
(:func:`~pagedkv.testing.cases.memory.new_lazy_pools`), pages the operating system maps as zeros
and backs with memory only where they are written, so a correct backend costs a few pages and
the whole pool is still checked: the written rows bit for bit, every other row still zero (scanned in
chunks, no copy). On a GPU the pools are zero-filled, and each check holds a lease on the run's
device-memory budget (:mod:`pagedkv.testing.device_lease`) for its two pools: under ``-n auto`` a check
waits for memory another worker holds rather than skipping. A layout declared as a copy pair reaches the
backend as storage of the same kind (fresh pages, zeros), only the blocks holding anything converted.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.attention.dense import reference_attention
from pagedkv.testing.cases.limit import LimitCase
from pagedkv.testing.cases.memory import (POOL_LAYOUTS, blockwise_copy, copy_pair_blockwise_problem, new_lazy_pools,
                                          new_pools, nonzero_blocks, storage_of)
from pagedkv.testing.compare import Mismatch, MissingOp, assert_attention_close, bits, require
from pagedkv.testing.device_lease import leased


def _pools(case: LimitCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Lazy (CPU) or zeroed (GPU) logical pools, their storage in the declared layout. A copy-pair layout is
    converted block by block around each call (only the blocks holding anything: the checks call under
    :data:`~pagedkv.testing.cases.memory.BLOCKWISE_COPY`), once three blocks show the pair converts each
    block on its own.

    Raises:
        Mismatch: a copy pair that does not convert block by block (storage ``[b]`` is block ``b``).
        MissingOp: a copy pair mapping zeros to nonzero storage, or fresh pages that do not read as zeros
            (``machine_limit``).
    """
    g = case.geometry
    for layout in POOL_LAYOUTS.get():
        if layout.is_view:
            continue
        problem = copy_pair_blockwise_problem(layout, (g.block_size, g.num_kv_heads, g.head_dim), g.torch_dtype,
                                              device)
        if problem == "zero":
            raise MissingOp(f"layout {layout.name} (a copy pair) stores a zero block as nonzero storage: pools past "
                            f"{case.limit} cannot be held on lazily backed zero pages", "machine_limit")
        if problem:
            raise Mismatch(f"layout {layout.name} is declared as a copy pair that does not convert block by block "
                           f"(storage[b] is block b, pagedkv.layouts): {problem}", {"block": 0})
    shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    if str(device) == "cpu":
        pools = new_lazy_pools(shape, g.torch_dtype)
    else:
        pools = new_pools(shape, g.torch_dtype, device, 0.0)
    if str(device) == "cpu" and (nonzero_slots(pools[0]) or nonzero_slots(pools[1])):
        raise MissingOp("this machine's allocator does not provide fresh zero pages for the lazy pools",
                        "machine_limit")
    return pools


def _leased_bytes(case: LimitCase) -> int:
    """Device bytes a check holds: K and V, and the storage of each pool in a copy-pair layout."""
    return (2 + sum(not layout.is_view for layout in POOL_LAYOUTS.get())) * case.pool_bytes


def _memory(pool: torch.Tensor) -> torch.Tensor:
    """The pool's storage in memory order (its layout's storage tensor, dim 0 the blocks): no copy."""
    return storage_of(pool)


def nonzero_slots(pool: torch.Tensor) -> list[int]:
    """Slots holding anything but zero bits: the blocks a scan of the raw words finds
    (:func:`~pagedkv.testing.cases.memory.nonzero_blocks`), then those blocks slot by slot."""
    found = []
    for block in nonzero_blocks(_memory(pool)):
        written = (bits(pool[block]) != 0).flatten(1).any(-1)  # [block_size]
        found += [block * pool.shape[1] + int(o) for o in torch.nonzero(written).flatten().tolist()]
    return found


def _row(pool: torch.Tensor, slot: int) -> torch.Tensor:
    return pool[slot // pool.shape[1], slot % pool.shape[1]]


@leased(_leased_bytes)
@blockwise_copy()
def write_kv_exact_past_the_limit(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``write_kv`` puts each token at its slot past the limit (and in the last blocks) and nowhere else.

    Raises:
        Mismatch: a token not at its slot, or a slot written that no token maps to.
    """
    write_kv = require(backend, "write_kv")
    k_cache, v_cache = _pools(case, device)
    g, past = case.geometry, case.first_slot_past
    last = g.num_blocks * g.block_size - 1
    slots = sorted({past, past + 2, last, last - g.block_size - 1})
    gen = torch.Generator().manual_seed(0)
    shape = (len(slots), g.num_kv_heads, g.head_dim)
    key = (torch.rand(shape, generator=gen) + 1).to(device=device, dtype=k_cache.dtype)  # never zero
    value = (torch.rand(shape, generator=gen) + 1).to(device=device, dtype=k_cache.dtype)
    write_kv(k_cache, v_cache, key, value, torch.tensor(slots, dtype=torch.int64, device=device))
    for pool, rows, what in ((k_cache, key, "k_cache"), (v_cache, value, "v_cache")):
        _require_rows_at(pool, slots, rows, g.block_size,
                         f"write_kv into pools past {case.limit}: {what} slots", "token", "no token maps there")


def _require_rows_at(pool: torch.Tensor, slots: list[int], rows: torch.Tensor, block_size: int, what: str,
                     row: str, unmapped: str) -> None:
    """``pool``'s slot ``slots[i]`` holds ``rows[i]`` bit for bit and no other slot is nonzero (the pools
    start as zero pages), else a located :class:`Mismatch` naming the first wrong or stray slot."""
    wrong = [s for i, s in enumerate(slots) if not torch.equal(bits(_row(pool, s).cpu()), bits(rows[i].cpu()))]
    stray = sorted(set(nonzero_slots(pool)) - set(slots))
    if wrong or stray:
        bad = (wrong or stray)[0]
        raise Mismatch(f"{what} {wrong[:4]} do not hold their {row}; slots {stray[:4]} were written although "
                       f"{unmapped} (float32 or int32 slot arithmetic?)", {"slot": bad, "block": bad // block_size})


@leased(_leased_bytes)
@blockwise_copy()
def attention_past_the_limit(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``paged_attention`` over sequences held in the last blocks of the pools equals the fp64 reference.

    Raises:
        Mismatch: the output differs from the reference beyond the tolerance.
    """
    attention = require(backend, "paged_attention")
    k_cache, v_cache = _pools(case, device)
    if case.latent:  # MLA's latent cache: V is K's storage (shared_kv_storage)
        v_cache = k_cache
    g = case.geometry
    bs, nb = g.block_size, g.num_blocks
    seq_lens, q_lens = [bs + 3, 2 * bs - 1], [1, 3]
    tables = [[nb - 1, nb - 3], [nb - 2, nb - 4]]
    gen = torch.Generator().manual_seed(1)
    for table, length in zip(tables, seq_lens):  # the rows the sequences own hold K/V
        for p in range(length):
            for pool in (k_cache,) if case.latent else (k_cache, v_cache):
                pool[table[p // bs], p % bs] = torch.randn(g.num_kv_heads, g.head_dim, generator=gen).to(
                    device=device, dtype=pool.dtype)
    query = torch.randn(sum(q_lens), g.num_q_heads, g.head_dim, generator=gen).to(device=device, dtype=k_cache.dtype)
    qsl = [0, q_lens[0], sum(q_lens)]
    out = attention(query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device),
                    torch.tensor(seq_lens, dtype=torch.int32, device=device),
                    torch.tensor(qsl, dtype=torch.int32, device=device))
    keys = [torch.stack([k_cache[t[p // bs], p % bs] for p in range(n)]) for t, n in zip(tables, seq_lens)]
    values = [torch.stack([v_cache[t[p // bs], p % bs] for p in range(n)]) for t, n in zip(tables, seq_lens)]
    try:
        assert_attention_close(out, reference_attention(query, keys, values, qsl))
    except AssertionError as exc:
        raise Mismatch(f"paged_attention over blocks {tables} of pools past {case.limit}: "
                       f"{str(exc).splitlines()[0]}", {"block": tables[0][0]}) from None


def _table_past_the_limit(case: LimitCase) -> tuple[list[int], int]:
    """A block table through the block holding the first slot past the limit and the pools' last two
    blocks, and a length that ends mid-way through the last (a partial last block)."""
    g, nb = case.geometry, case.geometry.num_blocks
    return [case.first_slot_past // g.block_size, nb - 2, nb - 1], 2 * g.block_size + max(1, g.block_size // 2)


@leased(_leased_bytes)
@blockwise_copy()
def gather_exact_past_the_limit(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``gather`` reads, bit for bit, rows held in the block past the limit and in the last blocks.

    Raises:
        Mismatch: a gathered row that is not the one its slot holds.
    """
    gather = require(backend, "gather")
    k_cache, v_cache = _pools(case, device)
    g = case.geometry
    table, length = _table_past_the_limit(case)
    gen = torch.Generator().manual_seed(2)
    rows = (torch.rand((length, g.num_kv_heads, g.head_dim), generator=gen) + 1).to(device=device, dtype=k_cache.dtype)
    for pool in (k_cache, v_cache):
        for p in range(length):
            pool[table[p // g.block_size], p % g.block_size] = rows[p] if pool is k_cache else -rows[p]
    tables = torch.tensor(table, dtype=torch.int32, device=device)
    for pool, want, what in ((k_cache, rows, "k_cache"), (v_cache, -rows, "v_cache")):
        got = gather(pool, tables, length)
        bad = [p for p in range(length) if not torch.equal(bits(got[p].cpu()), bits(want[p].cpu()))]
        if bad:
            p = bad[0]
            raise Mismatch(f"gather of {what} past {case.limit}: positions {bad[:4]} do not hold their slot's row "
                           f"(float32 or int32 slot arithmetic?)",
                           {"seq": 0, "position": p, "block": table[p // g.block_size],
                            "slot": table[p // g.block_size] * g.block_size + p % g.block_size})


@leased(_leased_bytes)
@blockwise_copy()
def scatter_exact_past_the_limit(backend: Any, case: LimitCase, device: str = "cpu") -> None:
    """``scatter`` writes each position into its slot past the limit and in the last blocks, and nowhere else.

    Raises:
        Mismatch: a position not at its slot, or a slot written that the table does not map to.
    """
    scatter = require(backend, "scatter")
    k_cache, _ = _pools(case, device)
    g = case.geometry
    table, length = _table_past_the_limit(case)
    start = 1  # a write that starts past the block's first slot
    gen = torch.Generator().manual_seed(3)
    rows = (torch.rand((length - start, g.num_kv_heads, g.head_dim), generator=gen) + 1).to(device=device,
                                                                                            dtype=k_cache.dtype)
    scatter(k_cache, torch.tensor(table, dtype=torch.int32, device=device), rows, start)
    slots = [table[p // g.block_size] * g.block_size + p % g.block_size for p in range(start, length)]
    _require_rows_at(k_cache, slots, rows, g.block_size, f"scatter into pools past {case.limit}: slots", "row",
                     "the table maps no position there")
