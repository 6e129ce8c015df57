"""KV-cache groups (:class:`pagedkv.cache.hybrid.HybridKVCache`): the rules the cache rests on (the cache as a
whole runs under the cache-manager machine: ``tests/gate/test_manager_groups.py``)."""

from __future__ import annotations

import pytest

from pagedkv.cache.config import CacheConfig
from pagedkv.cache.hybrid import HybridKVCache, kv_cache_groups
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import ArgumentTypeError, ArgumentValueError, OutOfBlocksError

GEMMA = dict(num_blocks=16, block_size=2, num_kv_heads=1, head_dim=2, num_layers=4, window_left=2,
             layer_types=("sliding_attention", "full_attention") * 2)


def test_layers_of_one_kind_form_a_group_full_attention_first_and_share_the_pools():
    cache = HybridKVCache(CacheConfig(**GEMMA))
    assert [(g.kind, g.layers) for g in cache.specs] == [("full_attention", (1, 3)), ("sliding_attention", (0, 2))]
    assert cache.kv.shape[0] == 2  # pool i holds the i-th layer of every group
    assert cache.k_cache(0).data_ptr() == cache.k_cache(1).data_ptr()
    assert [cache.group_of(layer) for layer in range(4)] == [1, 0, 1, 0]


def test_a_sliding_group_hits_without_its_evicted_head_and_every_group_agrees():
    """The first prompt's sliding blocks before its window are released, then evicted by another request;
    a second prompt with the same prefix still hits: the full group in every block, the sliding group in
    the window of the hit's end only (-1 before it)."""
    cache = HybridKVCache(CacheConfig(**{**GEMMA, "num_blocks": 12}))
    p = list(range(10))
    cache.add_sequence(0, p)
    cache.append(0, p)
    cache.mark_written(0)
    cache.append(0, [7])  # the next step: the sliding group releases what no later query reads
    assert cache.block_table(0, group=1).tolist()[:4] == [-1] * 4
    head = cache.allocator.evictable_blocks()
    cache.add_sequence(1, [])
    cache.append(1, [9] * 2)  # takes the free blocks, then evicts the released head (least recently released)
    assert set(cache.block_table(1, group=0).tolist() + cache.block_table(1, group=1).tolist()) & set(head)
    assert cache.add_sequence(2, p + [3]) == 10
    assert -1 not in cache.block_table(2, group=0).tolist()
    assert cache.block_table(2, group=1).tolist() == [-1, -1, -1, -1, cache.block_table(0, group=1).tolist()[4]]
    cache.check_invariants()


def test_an_append_the_groups_together_cannot_fit_changes_nothing():
    cache = HybridKVCache(CacheConfig(**{**GEMMA, "num_blocks": 5}))
    cache.add_sequence(0, [])
    assert not cache.can_append(0, 6)  # 3 blocks in each group: 6 > 5
    with pytest.raises(OutOfBlocksError, match="groups need 6 blocks"):
        cache.append(0, [1] * 6)
    assert cache.allocator.num_free == 5 and cache.seq_len(0) == 0
    assert all(len(cache.block_table(0, group=g)) == 0 for g in range(2))


def test_bad_configurations_and_arguments_name_the_argument():
    with pytest.raises(ArgumentValueError, match="layer_types names 4 layers, num_layers is 3"):
        CacheConfig(**{**GEMMA, "num_layers": 3})
    with pytest.raises(ArgumentValueError, match="layer_types entries"):
        CacheConfig(**{**GEMMA, "layer_types": ("sliding", "full") * 2})
    with pytest.raises(ArgumentValueError, match="window_left is None"):
        CacheConfig(**{**GEMMA, "window_left": None})
    with pytest.raises(ArgumentTypeError, match="layer_types"):
        CacheConfig(**{**GEMMA, "layer_types": "full_attention"})
    with pytest.raises(ArgumentValueError, match="HybridKVCache"):
        PagedKVCache(CacheConfig(**GEMMA))
    cache = HybridKVCache(CacheConfig(**GEMMA))
    with pytest.raises(IndexError, match="group 2"):
        cache.block_table(0, group=2)
    with pytest.raises(IndexError, match="layer 4"):
        cache.v_cache(4)


def test_one_kind_of_layer_is_one_group_as_the_plain_cache():
    config = CacheConfig(**{**GEMMA, "layer_types": ("sliding_attention",) * 4})
    assert len(kv_cache_groups(config)) == 1
    assert PagedKVCache(config).window_left == 2


def test_the_single_group_window_cache_hits_without_its_evicted_head_too():
    """``CacheConfig(window_left=W)`` (every layer slides) looks up as a sliding-window group does: a prompt
    whose released head blocks were evicted still hits the window of its end. (Before the prefix trie, the
    lookup needed the chain from the first block and found nothing here.)"""
    cache = PagedKVCache(CacheConfig(num_blocks=8, block_size=2, num_kv_heads=1, head_dim=2, window_left=2))
    p = list(range(10))
    cache.add_sequence(0, p)
    cache.append(0, p)
    cache.mark_written(0)
    cache.append(0, [7])  # releases blocks 0-3 (evictable, the deepest first)
    cache.free(0)
    cache.add_sequence(1, [])
    cache.append(1, [9] * 8)  # 3 free blocks, then 1 evicted: the deepest released head block (depth 3)
    assert cache.allocator.num_evictions == 1
    assert cache.add_sequence(2, p + [3]) == 10
    assert cache.block_table(2).tolist()[:4] == [-1] * 4
    cache.check_invariants()


def test_a_full_group_may_allocate_what_the_sliding_group_releases_in_the_same_append():
    """The pool is full; the next token needs a block in each group, and the sliding group's window
    releases four: the append fits (every group's window is released before any group allocates).
    Found by the machine: with the full group served first, its allocation was refused after
    ``can_append`` said yes."""
    cache = HybridKVCache(CacheConfig(num_blocks=12, block_size=2, num_kv_heads=1, head_dim=2, num_layers=2,
                                      window_left=0, layer_types=("full_attention", "sliding_attention")))
    cache.add_sequence(0, [])
    cache.append(0, [0] * 11)
    cache.mark_written(0)
    assert cache.allocator.num_free == 0 and cache.can_append(0, 2)
    cache.append(0, [0, 0])
    assert cache.block_table(0, group=1).tolist()[:4] == [-1] * 4 and -1 not in cache.block_table(0, group=0).tolist()
    cache.check_invariants()
