"""The cases pagedkv's own cache must always cover, on its public API: C11 (a request freed between reserve
and write leaves no prefix-cache entry), namespaces, eviction order. (The cache as a whole runs under the
cache state machine: ``tests/tools/test_cache_mutants.py``, the real cache beside its planted faults.)"""

from __future__ import annotations

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.config import CacheConfig


def test_c11_a_request_freed_between_reserve_and_write_leaves_no_prefix_cache_entry():
    """The trigger of C11 on the public API: block_size 4, a 9-token prompt reserved, freed before any
    write (preempted or aborted), added again: 0 cached tokens. Committed, the same prompt hits 8."""
    cache = PagedKVCache(CacheConfig(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4))
    p = list(range(100, 109))
    assert cache.add_sequence(0, p) == 0
    cache.append(0, p)
    cache.free(0)
    assert cache.allocator.num_cached == 0
    assert cache.add_sequence(1, p) == 0
    cache.append(1, p)
    cache.mark_written(1, 5)  # a partial write: only the first block is committed
    assert cache.add_sequence(2, p) == 4
    cache.free(2)
    assert cache.mark_written(1) == 1
    assert cache.add_sequence(3, p) == 8


def test_a_namespace_is_part_of_each_blocks_identity():
    cache = PagedKVCache(CacheConfig(num_blocks=8, block_size=2, num_kv_heads=1, head_dim=1),
                         hash_fn=lambda parent, tokens: 0)  # every hash collides: keys must still be compared
    p = [1, 2, 3, 4, 5]
    for seq_id, key in ((0, "a"), (1, None)):
        assert cache.add_sequence(seq_id, p, cache_key=key) == 0  # nothing shared across keys
        cache.append(seq_id, p)
        cache.mark_written(seq_id)
    assert cache.add_sequence(2, p, cache_key="a") == 4
    assert cache.block_table(2).tolist()[:2] == cache.block_table(0).tolist()[:2]
    assert cache.add_sequence(3, p, cache_key="b") == 0
    cache.fork(2, 4)
    assert cache.cache_key(4) == "a"


def test_released_blocks_are_evicted_least_recent_first_and_deepest_first():
    cache = PagedKVCache(CacheConfig(num_blocks=6, block_size=1, num_kv_heads=1, head_dim=1))
    for seq_id, p in ((0, [1, 2, 3]), (1, [7, 8])):
        cache.add_sequence(seq_id, p)
        cache.append(seq_id, p)
        cache.mark_written(seq_id)
    a, b = cache.block_table(0).tolist(), cache.block_table(1).tolist()
    cache.free(0)
    cache.free(1)
    assert cache.allocator.evictable_blocks() == a[::-1] + b[::-1]
    cache.add_sequence(2, [])
    cache.append(2, [9, 9])  # one free block, then the least recently released, deepest first: a[2]
    assert a[2] in cache.block_table(2).tolist() and a[2] not in cache.allocator.cached_entries()
    assert cache.allocator.find_cached_prefix([1, 2, 3]) == a[:2]  # the lookup stops at the evicted block
