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

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedkv.cache.config import CacheConfig, element_offset, slot_of, slots_for_positions

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
