"""Slot and offset arithmetic past 2**24 slots and past 2**31 elements, at a geometry the candidate declares.

The registered large-pool properties draw pools of head_dim 1, which a kernel limited to head dims
such as {64, 128} never sees. Here the pools take the candidate's own sizes (its smallest declared
head_dim and kv-head count, a declared block size and layout, a 16-bit dtype when it declares one)
and are just large enough for the limit: past 2**24 slots, where float32 slot or block-offset
arithmetic stops being exact (2**24 + 1 rounds to 2**24), and past 2**31 elements, where int32
element offsets wrap (8 GiB of pools at head_dim 64 in float16).

The memory trick: on a CPU the pools are ``torch.empty``, fresh pages the operating system maps as
zeros and backs with memory only where they are written, so a correct backend costs a few pages and
the whole pool is still checked: the written rows bit for bit, every other row still zero (scanned in
chunks, no copy). On a GPU the pools are zero-filled (the device has the memory). Attention over the
last blocks is compared with the fp64 reference of the rows read by plain indexing.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import reference_attention
from pagedkv.backends import backend_name
from pagedkv.config import dtype_from_name
from pagedkv.testing.compare import assert_attention_close, bits, require
from pagedkv.testing.space import as_declared_layout, capabilities_under_test

pytestmark = pytest.mark.pagedkv

#: name -> (slots, elements) the pool must exceed.
LIMITS = {"2_24_slots": (2**24 + 1, 0), "2_31_elements": (0, 2**31 + 1)}
_CHUNK_ELEMENTS = 1 << 26


def _geometry(backend, limit: str, device: str) -> tuple[dict | None, str]:
    """The declared geometry of the pools (``None`` and the reason when none fits)."""
    caps = capabilities_under_test(backend)
    bs = caps.block_sizes.choose((16, 32, 64, 128, 256, 8, 4, 2, 1))[0]
    hd = caps.head_dims.choose((1, 2, 4, 8, 16, 32, 64, 128, 256))[0]
    kvh = caps.num_kv_heads.choose((1, 2, 4, 8))[0]
    group = caps.gqa_groups.choose((1, 2, 4, 8))[0]
    dtype = next((d for d in ("float16", "bfloat16", "float32") if d in caps.dtypes), None)
    if dtype is None:
        return None, "no float dtype declared"
    min_slots, min_elements = LIMITS[limit]
    slots = max(min_slots, -(-min_elements // (kvh * hd)))
    nb = -(-slots // bs) + 2
    pool_bytes = nb * bs * kvh * hd * dtype_from_name(dtype).itemsize
    if caps.max_pool_bytes is not None and pool_bytes > caps.max_pool_bytes:
        return None, f"a pool past {limit} needs {pool_bytes} bytes; declared max_pool_bytes {caps.max_pool_bytes}"
    if device.startswith("cuda") and 2 * pool_bytes > torch.cuda.mem_get_info(device)[0] // 2:
        return None, f"two pools past {limit} need {2 * pool_bytes / 2**30:.1f} GiB, over half the device's free memory"
    return dict(num_blocks=nb, block_size=bs, head_dim=hd, num_kv_heads=kvh, group=group, dtype=dtype), ""


def _pool(g: dict, device: str, layout: str) -> torch.Tensor:
    """A zero pool, NHD-shaped, in the backend's memory order; lazily backed on a CPU (see the docstring)."""
    nb, bs, kvh, hd = g["num_blocks"], g["block_size"], g["num_kv_heads"], g["head_dim"]
    memory = (nb, kvh, bs, hd) if layout == "HND" else (nb, bs, kvh, hd)
    dtype = dtype_from_name(g["dtype"])
    pool = torch.empty(memory, dtype=dtype, device=device) if device == "cpu" else \
        torch.zeros(memory, dtype=dtype, device=device)
    return pool.permute(0, 2, 1, 3) if layout == "HND" else pool


def _nonzero_slots(pool: torch.Tensor) -> list[int]:
    """Slots holding anything but zero, scanned over chunks of blocks (reading fresh pages maps no memory)."""
    bs = pool.shape[1]
    step = max(1, _CHUNK_ELEMENTS // (bs * pool.shape[2] * pool.shape[3]))
    found = []
    for first in range(0, pool.shape[0], step):
        written = (pool[first:first + step] != 0).flatten(2).any(-1)  # [blocks, block_size]
        found += [(first + int(b)) * bs + int(o) for b, o in torch.nonzero(written).tolist()]
    return found


def _row(pool: torch.Tensor, slot: int) -> torch.Tensor:
    return pool[slot // pool.shape[1], slot % pool.shape[1]]


def _fail(pagedkv_run, name: str, backend, message: str):
    pagedkv_run.record(name, backend, "failed")
    pytest.fail(f"property: {name} ({backend_name(backend)}): {message}", pytrace=False)


def _call(pagedkv_run, name: str, backend, g: dict, fn, *args):
    """``fn(*args)``; an exception from the candidate fails the test, recorded, in a few lines."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the candidate raises on a valid input is a failure
        _fail(pagedkv_run, name, backend, f"pool {g}: {getattr(fn, '__name__', fn)} raised "
                                          f"{type(exc).__name__}: {str(exc)[:400]}")


def _setup(pagedkv_run, backend, device: str, name: str, limit: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g, reason = _geometry(backend, limit, device)
    if g is None:
        pagedkv_run.record(name, backend, "skipped", reason)
        pytest.skip(f"{name}: {reason}")
    layout = capabilities_under_test(backend).layout
    k_cache, v_cache = _pool(g, device, layout), _pool(g, device, layout)
    if device == "cpu" and (_nonzero_slots(k_cache) or _nonzero_slots(v_cache)):
        pagedkv_run.record(name, backend, "skipped", "this allocator did not hand out fresh zero pages")
        pytest.skip(f"{name}: the allocator did not hand out fresh zero pages here")
    return g, k_cache, v_cache


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_write_kv_is_exact_in_pools_past_the_limit_at_a_declared_geometry(pagedkv_run, backend, device, limit):
    """write_kv puts each token at its slot past the limit and nowhere else."""
    name = f"write_kv_is_exact_past_{limit}_at_a_declared_geometry"
    write_kv = require(as_declared_layout(backend), "write_kv")
    g, k_cache, v_cache = _setup(pagedkv_run, backend, device, name, limit)
    bs, last = g["block_size"], g["num_blocks"] * g["block_size"] - 1
    row = g["num_kv_heads"] * g["head_dim"]
    past = max(LIMITS[limit][0], -(-LIMITS[limit][1] // row))  # the first slot past the limit
    slots = sorted({past, past + 2, last, last - bs - 1})
    gen = torch.Generator().manual_seed(0)
    shape = (len(slots), g["num_kv_heads"], g["head_dim"])
    key = (torch.rand(shape, generator=gen) + 1).to(device=device, dtype=k_cache.dtype)  # never zero
    value = (torch.rand(shape, generator=gen) + 1).to(device=device, dtype=k_cache.dtype)
    _call(pagedkv_run, name, backend, g, write_kv, k_cache, v_cache, key, value,
          torch.tensor(slots, dtype=torch.int64, device=device))
    for pool, rows, what in ((k_cache, key, "k_cache"), (v_cache, value, "v_cache")):
        wrong = [s for i, s in enumerate(slots) if not torch.equal(bits(_row(pool, s).cpu()), bits(rows[i].cpu()))]
        stray = sorted(set(_nonzero_slots(pool)) - set(slots))
        if wrong or stray:
            _fail(pagedkv_run, name, backend, f"pool {g}: {what} slots {wrong} do not hold their token; slots "
                                              f"{stray[:4]} were written although no token maps there "
                                              f"(float32 or int32 slot arithmetic?)")
    pagedkv_run.record(name, backend, "judged")


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_paged_attention_reads_blocks_past_the_limit_at_a_declared_geometry(pagedkv_run, backend, device, limit):
    """paged_attention over the last blocks of a pool past the limit equals the fp64 reference."""
    name = f"paged_attention_reads_blocks_past_{limit}_at_a_declared_geometry"
    attention = require(as_declared_layout(backend), "paged_attention")
    g, k_cache, v_cache = _setup(pagedkv_run, backend, device, name, limit)
    bs, nb = g["block_size"], g["num_blocks"]
    seq_lens, q_lens = [bs + 3, 2 * bs - 1], [1, 3]
    tables = [[nb - 1, nb - 3], [nb - 2, nb - 4]]
    gen = torch.Generator().manual_seed(1)
    for table, length in zip(tables, seq_lens):  # the rows the sequences own hold K/V
        for p in range(length):
            for pool in (k_cache, v_cache):
                pool[table[p // bs], p % bs] = torch.randn(g["num_kv_heads"], g["head_dim"], generator=gen).to(
                    device=device, dtype=pool.dtype)
    num_q_heads = g["num_kv_heads"] * g["group"]
    query = torch.randn(sum(q_lens), num_q_heads, g["head_dim"], generator=gen).to(device=device, dtype=k_cache.dtype)
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    out = _call(pagedkv_run, name, backend, g, attention, query, k_cache, v_cache, block_tables, lens, qsl)
    keys = [torch.stack([k_cache[t[p // bs], p % bs] for p in range(n)]) for t, n in zip(tables, seq_lens)]
    values = [torch.stack([v_cache[t[p // bs], p % bs] for p in range(n)]) for t, n in zip(tables, seq_lens)]
    expected = reference_attention(query, keys, values, [0, q_lens[0], sum(q_lens)])
    try:
        assert_attention_close(out, expected)
    except AssertionError as exc:
        _fail(pagedkv_run, name, backend, f"blocks {tables} of a pool of {g}, seq_lens {seq_lens}, "
                                          f"q_lens {q_lens}: {str(exc)[:600]}")
    pagedkv_run.record(name, backend, "judged")
