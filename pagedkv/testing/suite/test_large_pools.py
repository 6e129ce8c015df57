"""Slot arithmetic past 2**24 slots at a geometry the candidate declares.

The registered large-pool properties draw pools of head_dim 1, which a kernel limited to head dims
such as {64, 128} never sees. Here the pool takes the candidate's own sizes: its smallest declared
head_dim and kv-head count, a declared block size, a 16-bit dtype when it declares one, and just
over 2**24 slots (2 GiB a pool at head_dim 64 in float16), where float32 slot or block-offset
arithmetic stops being exact (2**24 + 1 rounds to 2**24). The checks stay lean (no pool copies):
the written rows are compared bit for bit, every other row must still hold the poison (counted in
chunks), and attention over the last blocks is compared with the fp64 reference of the rows read by
plain indexing.
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

MIN_SLOTS = 2**24 + 1
_CHUNK_ROWS = 1 << 20


def _memory_bytes() -> int:
    from pagedkv.testing.casefiles.schema import default_max_bytes

    return default_max_bytes()


def _geometry(backend) -> tuple[dict | None, str]:
    """The declared geometry of the pools (``None`` and the reason when none fits)."""
    caps = capabilities_under_test(backend)
    bs = caps.block_sizes.choose((16, 32, 64, 128, 256, 8, 4, 2, 1))[0]
    hd = caps.head_dims.choose((1, 2, 4, 8, 16, 32, 64, 128, 256))[0]
    kvh = caps.num_kv_heads.choose((1, 2, 4, 8))[0]
    group = caps.gqa_groups.choose((1, 2, 4, 8))[0]
    dtype = next((d for d in ("float16", "bfloat16", "float32") if d in caps.dtypes), None)
    if dtype is None:
        return None, "no float dtype declared"
    nb = -(-MIN_SLOTS // bs) + 2
    pool_bytes = nb * bs * kvh * hd * dtype_from_name(dtype).itemsize
    if caps.max_pool_bytes is not None and pool_bytes > caps.max_pool_bytes:
        return None, f"a pool past 2**24 slots needs {pool_bytes} bytes; declared max_pool_bytes {caps.max_pool_bytes}"
    if 2 * pool_bytes > _memory_bytes():
        return None, f"two pools past 2**24 slots need {2 * pool_bytes / 2**30:.1f} GiB, over this machine's budget"
    return dict(num_blocks=nb, block_size=bs, head_dim=hd, num_kv_heads=kvh, group=group, dtype=dtype), ""


def _pools(g: dict, device: str, layout: str = "NHD") -> tuple[torch.Tensor, torch.Tensor]:
    """NaN pools, NHD-shaped, in the backend's memory order (head-major views for ``layout="HND"``)."""
    nb, bs, kvh, hd = g["num_blocks"], g["block_size"], g["num_kv_heads"], g["head_dim"]
    dtype = dtype_from_name(g["dtype"])

    def pool():
        if layout == "HND":
            return torch.full((nb, kvh, bs, hd), float("nan"), dtype=dtype, device=device).permute(0, 2, 1, 3)
        return torch.full((nb, bs, kvh, hd), float("nan"), dtype=dtype, device=device)
    return pool(), pool()


def _row(pool: torch.Tensor, slot: int) -> torch.Tensor:
    return pool[slot // pool.shape[1], slot % pool.shape[1]]


def _finite_rows(pool: torch.Tensor) -> list[int]:
    """Slots holding anything but the poison (counted over chunks of blocks: no copy of the pool)."""
    bs, step, found = pool.shape[1], max(1, _CHUNK_ROWS // pool.shape[1]), []
    for first in range(0, pool.shape[0], step):
        written = ~torch.isnan(pool[first:first + step]).flatten(2).all(-1)  # [blocks, block_size]
        found += [(first + int(b)) * bs + int(o) for b, o in torch.nonzero(written).tolist()]
    return found


def _call(pagedkv_run, name: str, backend, g: dict, fn, *args):
    """``fn(*args)``; an exception from the candidate fails the test, recorded, in a few lines."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the candidate raises on a valid input is a failure
        pagedkv_run.record(name, backend, "failed")
        pytest.fail(f"property: {name} ({backend_name(backend)}, pool {g}): {getattr(fn, '__name__', fn)} raised "
                    f"{type(exc).__name__}: {str(exc)[:400]}", pytrace=False)


def _geometry_or_skip(pagedkv_run, backend, name: str) -> dict:
    g, reason = _geometry(backend)
    if g is None:
        pagedkv_run.record(name, backend, "skipped", reason)
        pytest.skip(f"{name}: {reason}")
    return g


def test_write_kv_is_exact_past_2_24_slots_at_a_declared_geometry(pagedkv_run, backend, device):
    """write_kv puts each token at its slot past 2**24 (2**24 + 1 is not a float32) and nowhere else."""
    name = "write_kv_is_exact_past_2_24_slots_at_a_declared_geometry"
    write_kv = require(as_declared_layout(backend), "write_kv")
    g = _geometry_or_skip(pagedkv_run, backend, name)
    k_cache, v_cache = _pools(g, device, capabilities_under_test(backend).layout)
    last = g["num_blocks"] * g["block_size"] - 1
    slots = [2**24 + 1, 2**24 + 3, last, last - g["block_size"] - 1]
    gen = torch.Generator().manual_seed(0)
    shape = (len(slots), g["num_kv_heads"], g["head_dim"])
    key = torch.randn(shape, generator=gen).to(device=device, dtype=k_cache.dtype)
    value = torch.randn(shape, generator=gen).to(device=device, dtype=k_cache.dtype)
    _call(pagedkv_run, name, backend, g, write_kv, k_cache, v_cache, key, value,
          torch.tensor(slots, dtype=torch.int64, device=device))
    for pool, rows, what in ((k_cache, key, "k_cache"), (v_cache, value, "v_cache")):
        written = _finite_rows(pool)
        wrong = [s for i, s in enumerate(slots) if not torch.equal(bits(_row(pool, s).cpu()), bits(rows[i].cpu()))]
        stray = sorted(set(written) - set(slots))
        if wrong or stray:
            pagedkv_run.record(name, backend, "failed")
            pytest.fail(f"property: {write_kv.__name__} into a pool of {g} ({backend_name(backend)}): {what} "
                        f"slots {wrong} do not hold their token; slots {stray[:4]} were written although no token "
                        f"maps there (float32 or int32 slot arithmetic?)", pytrace=False)
    pagedkv_run.record(name, backend, "judged")


def test_paged_attention_reads_blocks_past_2_24_slots_at_a_declared_geometry(pagedkv_run, backend, device):
    """paged_attention over the last blocks of a pool past 2**24 slots equals the fp64 reference."""
    name = "paged_attention_reads_blocks_past_2_24_slots_at_a_declared_geometry"
    attention = require(as_declared_layout(backend), "paged_attention")
    g = _geometry_or_skip(pagedkv_run, backend, name)
    k_cache, v_cache = _pools(g, device, capabilities_under_test(backend).layout)
    bs, nb = g["block_size"], g["num_blocks"]
    seq_lens, q_lens = [bs + 3, 2 * bs - 1], [1, 3]
    tables = [[nb - 1, nb - 3], [nb - 2, nb - 4]]
    gen = torch.Generator().manual_seed(1)
    for table, length in zip(tables, seq_lens):  # the rows the sequences own hold finite K/V
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
        pagedkv_run.record(name, backend, "failed")
        pytest.fail(f"property: paged_attention over blocks {tables} of a pool of {g} ({backend_name(backend)}), "
                    f"seq_lens {seq_lens}, q_lens {q_lens}: {str(exc)[:600]}", pytrace=False)
    pagedkv_run.record(name, backend, "judged")
