"""Case C10 past 2**31 slots: slot and element offsets are exact 64-bit integers, checked without
allocating such a pool.

- The offset helpers (:func:`slot_of`, :func:`slots_for_positions`, :func:`element_offset`) against
  Python's unbounded ints, for block ids up to int32's maximum and slots up to 2**47.
- An *aliased pool*: a ``[2**23 + 1, 512, 1, 1]`` float32 view of a 32 MiB buffer with block stride 1,
  so ``pool[b, o]`` is buffer element ``b + o`` and holds the value ``b + o``. It has more than 2**32
  slots, so every op's validation, slot formation and indexing runs at slots past 2**31 (int32 would
  wrap to a negative or a wrong block), while reads and writes stay checkable: a read of the wrong
  block returns the wrong number. Writes go to slots whose buffer elements are distinct.

The pools past 2**24 slots (really allocated, tiny heads) are covered by ``test_large_pool.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv.testing import checks
from pagedkv.config import CacheConfig, element_offset, slot_of, slots_for_positions
from pagedkv.testing.tolerance import bits

INT32_MAX = 2**31 - 1
BLOCK_SIZE = 512
NUM_BLOCKS = 2**23 + 1  # num_slots = 2**32 + 512
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


# -- the helpers against Python ints ---------------------------------------------------------------
@given(block_size=st.sampled_from((1, 3, 16, 128, 512, 2**16)),
       ids=st.lists(st.integers(0, INT32_MAX), min_size=1, max_size=8),
       table_dtype=st.sampled_from((torch.int32, torch.int64)),
       heads=st.integers(1, 64), head_dim=st.sampled_from((1, 64, 128, 256)), data=st.data())
@example(block_size=16, ids=[INT32_MAX], table_dtype=torch.int32, heads=8, head_dim=128, data=None)
def test_offset_helpers_are_exact_past_2_31_slots(block_size, ids, table_dtype, heads, head_dim, data):
    table = torch.tensor(ids, dtype=table_dtype)
    n = len(ids) * block_size
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=16)) if data else [n - 1]
    positions = torch.tensor(picks, dtype=torch.int32)  # int32 positions: the helper must widen them
    slots = slots_for_positions(table, positions, block_size)
    expected = [ids[p // block_size] * block_size + p % block_size for p in picks]
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected
    assert [slot_of(ids[p // block_size], p % block_size, block_size) for p in picks] == expected
    offsets = element_offset(slots.to(torch.int64), heads, head_dim)
    assert offsets.dtype == torch.int64
    assert offsets.tolist() == [s * heads * head_dim for s in expected]
    assert element_offset(expected[0], heads, head_dim) == expected[0] * heads * head_dim
    # an int32 slot tensor (a slot that still fits) is widened before the multiply
    small = torch.tensor([INT32_MAX], dtype=torch.int32)
    assert element_offset(small, heads, head_dim).tolist() == [INT32_MAX * heads * head_dim]


def test_cache_config_counts_slots_past_2_31_exactly():
    config = CacheConfig(num_blocks=2**27, block_size=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    assert config.num_slots == 2**32
    assert config.bytes_per_block == 32 * 8 * 128 * 2


# -- an aliased pool with more than 2**32 slots --------------------------------------------------------
def _aliased_pool(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, buffer)``: ``pool[b, o, 0, 0]`` is ``buffer[b + o]``, which holds ``b + o`` (exact in float32)."""
    buffer = torch.arange(NUM_BLOCKS + BLOCK_SIZE - 1, dtype=torch.float32, device=device)
    return buffer.as_strided((NUM_BLOCKS, BLOCK_SIZE, 1, 1), (1, 1, 1, 1)), buffer


@pytest.fixture(scope="module")
def pools():
    return {}


def _pool(pools, device, key="k"):
    if (device, key) not in pools:
        pools[(device, key)] = _aliased_pool(device)
    pool, buffer = pools[(device, key)]
    buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32, device=buffer.device))  # reset after writes
    return pool, buffer


# block ids whose slots lie past 2**31 (and past 2**32), spaced so their buffer elements never alias
HIGH_BLOCKS = (NUM_BLOCKS - 1, 2**22 + 7, 2**23 - 3 * BLOCK_SIZE, 2**22 + 2 * BLOCK_SIZE + 5)


def test_gather_reads_the_right_block_past_2_31_slots(backend, device, pools):
    gather = checks.require(backend, "gather")
    pool, _ = _pool(pools, device)
    table = torch.tensor(HIGH_BLOCKS, dtype=torch.int32, device=device)
    seq_len = 3 * BLOCK_SIZE + 17
    assert HIGH_BLOCKS[2] * BLOCK_SIZE > 2**31 and HIGH_BLOCKS[0] * BLOCK_SIZE >= 2**32
    out = gather(pool, table, seq_len).cpu()
    expected = torch.tensor([HIGH_BLOCKS[p // BLOCK_SIZE] + p % BLOCK_SIZE for p in range(seq_len)],
                            dtype=torch.float32).view(-1, 1, 1)
    assert torch.equal(bits(out), bits(expected))


def test_write_kv_hits_slots_past_2_31_exactly(backend, device, pools):
    write_kv = checks.require(backend, "write_kv")
    k_pool, k_buffer = _pool(pools, device, "k")
    v_pool, v_buffer = _pool(pools, device, "v")
    slots = [b * BLOCK_SIZE + o for b, o in zip(HIGH_BLOCKS, (0, 0, 5, 300))] + [-1, NUM_SLOTS - 1]
    key = torch.tensor([-(i + 1.0) for i in range(len(slots))], device=device).view(-1, 1, 1)
    value = -2 * key
    k_expected, v_expected = k_buffer.cpu().clone(), v_buffer.cpu().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            b, o = divmod(s, BLOCK_SIZE)
            k_expected[b + o], v_expected[b + o] = key[i, 0, 0].item(), value[i, 0, 0].item()
    write_kv(k_pool, v_pool, key, value, torch.tensor(slots, dtype=torch.int64, device=device))
    assert torch.equal(bits(k_buffer.cpu()), bits(k_expected))
    assert torch.equal(bits(v_buffer.cpu()), bits(v_expected))


def test_scatter_writes_the_right_blocks_past_2_31_slots(backend, device, pools):
    scatter = checks.require(backend, "scatter")
    pool, buffer = _pool(pools, device)
    table = torch.tensor(HIGH_BLOCKS, dtype=torch.int64, device=device)
    start, n = BLOCK_SIZE - 2, BLOCK_SIZE + 4  # the end of block 0, all of block 1, the start of block 2
    values = -torch.arange(1, n + 1, dtype=torch.float32, device=device).view(-1, 1, 1)
    expected = buffer.cpu().clone()
    for j in range(n):
        p = start + j
        expected[HIGH_BLOCKS[p // BLOCK_SIZE] + p % BLOCK_SIZE] = values[j, 0, 0].item()
    scatter(pool, table, values, start)
    assert torch.equal(bits(buffer.cpu()), bits(expected))


def test_validation_bounds_are_exact_past_2_31_slots(backend, device, pools):
    """The last slot and block are accepted; one past them is an IndexError naming the bound."""
    gather, write_kv = checks.require(backend, "gather"), checks.require(backend, "write_kv")
    k_pool, k_buffer = _pool(pools, device, "k")
    v_pool, _ = _pool(pools, device, "v")
    before = k_buffer.cpu().clone()
    one = torch.ones((1, 1, 1), device=device)
    with pytest.raises(IndexError, match=str(NUM_SLOTS)):
        write_kv(k_pool, v_pool, one, one, torch.tensor([NUM_SLOTS], dtype=torch.int64, device=device))
    with pytest.raises(IndexError, match=str(NUM_SLOTS)):  # 2**32 + 512 + 2**32: wraps to 512 in 32 bits
        write_kv(k_pool, v_pool, one, one, torch.tensor([NUM_SLOTS + 2**32], dtype=torch.int64, device=device))
    with pytest.raises(IndexError, match=str(NUM_BLOCKS)):
        gather(k_pool, torch.tensor([NUM_BLOCKS], dtype=torch.int64, device=device), 1)
    assert torch.equal(bits(k_buffer.cpu()), bits(before))
    out = gather(k_pool, torch.tensor([NUM_BLOCKS - 1], dtype=torch.int64, device=device), BLOCK_SIZE).cpu()
    assert out[-1].item() == NUM_BLOCKS - 1 + BLOCK_SIZE - 1
