"""Cases C1-C4 on the cache and allocator themselves (the sharing properties over a backend are
registered in :mod:`pagedkv.testing.registry`)."""

import pytest

from pagedkv import DoubleFreeError, UnknownBlockError
from pagedkv.cache.allocator import BlockAllocator
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.config import CacheConfig


@pytest.mark.parametrize("prefix, hit", [(16, 16), (15, 0), (17, 16)])
def test_c1_prefix_on_a_block_boundary_is_served_from_the_cache(prefix, hit):
    cache = PagedKVCache(CacheConfig(8, 16, 1, 4))
    assert cache.add_sequence(0, list(range(prefix))) == 0
    cache.append(0, list(range(prefix)))
    cache.mark_written(0)  # its K/V is written: full blocks enter the prefix cache
    assert cache.add_sequence(1, list(range(prefix)) + [90, 91, 92, 93, 94]) == hit
    assert cache.block_table(1)[: hit // 16].tolist() == cache.block_table(0)[: hit // 16].tolist()


def test_c2_appending_to_a_shared_partial_block_copies_it_first():
    cache = PagedKVCache(CacheConfig(8, 4, 1, 4))
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6])
    cache.append(0, [1, 2, 3, 4, 5, 6])
    cache.fork(0, 1)
    shared_tail = int(cache.block_table(0)[1])
    slots_1 = cache.append(1, [9, 9, 9])
    assert int(cache.block_table(1)[1]) != shared_tail and int(cache.block_table(0)[1]) == shared_tail
    assert cache.num_cow_copies == 1
    assert not set(slots_1.tolist()) & {shared_tail * 4 + o for o in range(4)}
    cache.check_invariants()


def test_c3_a_block_freed_twice_raises_and_changes_nothing():
    allocator = BlockAllocator(4, 2)
    (block,) = allocator.allocate(1)
    allocator.free(block)
    before = (allocator.num_free, list(allocator._free), list(allocator._ref))
    with pytest.raises(DoubleFreeError, match=f"block {block}"):
        allocator.free(block)
    assert (allocator.num_free, list(allocator._free), list(allocator._ref)) == before
    assert len(set(allocator._free)) == len(allocator._free)
    allocator.check_invariants()


def test_c3_a_forked_child_freed_twice_raises_and_changes_nothing():
    cache = PagedKVCache(CacheConfig(4, 2, 1, 1))
    cache.add_sequence(0, [1, 2, 3])
    cache.append(0, [1, 2, 3])
    cache.fork(0, 1)
    cache.free(1)
    refs = [cache.allocator.ref_count(b) for b in range(4)]
    with pytest.raises(DoubleFreeError, match="sequence 1"):
        cache.free(1)
    assert [cache.allocator.ref_count(b) for b in range(4)] == refs
    cache.check_invariants()
    with pytest.raises(UnknownBlockError):
        cache.free(7)


def test_c4_a_colliding_hash_hits_only_on_equal_tokens():
    allocator = BlockAllocator(8, 2, hash_fn=lambda parent, tokens: 0)
    first = allocator.allocate(2)
    assert allocator.cache_full_block(first[0], [1, 2])
    assert allocator.cache_full_block(first[1], [3, 4], parent=first[0])
    assert allocator.find_cached_prefix([1, 2, 3, 4]) == first
    assert allocator.find_cached_prefix([1, 2, 6, 6]) == first[:1]
    assert allocator.find_cached_prefix([9, 9, 3, 4]) == []
    assert allocator.find_cached_prefix([3, 4]) == []
    assert allocator.cached_prefix(first[1]) == (1, 2, 3, 4)


def test_c4_a_child_of_an_evicted_block_never_hits_through_its_reused_id():
    allocator = BlockAllocator(3, 2, hash_fn=lambda parent, tokens: 0)
    a, b = allocator.allocate(2)
    allocator.cache_full_block(a, [1, 2])
    allocator.cache_full_block(b, [3, 4], parent=a)
    allocator.free(a)  # the parent is released first, so it is evicted first
    allocator.free(b)
    _, reused = allocator.allocate(2)  # the free block, then the LRU evictable one: a
    assert reused == a and b in allocator.cached_entries()
    assert allocator.cache_full_block(a, [5, 5])  # a now caches other tokens
    assert allocator.find_cached_prefix([5, 5, 3, 4]) == [a]  # b's parent was the old a: no false hit
    assert allocator.cached_prefix(b) is None


def test_a_prefix_cached_twice_is_found_through_either_copy():
    cache = PagedKVCache(CacheConfig(8, 2, 1, 1))
    for seq_id in (0, 1):  # two sequences fill equal first blocks independently
        cache.add_sequence(seq_id, [1])
        cache.append(seq_id, [1])
    cache.append(0, [2])  # one copy of [1, 2] ...
    cache.append(1, [2, 3, 4, 5])  # ... and another, with [3, 4] cached under it
    cache.mark_written(0)
    cache.mark_written(1)
    assert cache.add_sequence(2, [1, 2, 3, 4, 5]) == 4
    assert cache.block_table(2).tolist()[:2] == cache.block_table(1).tolist()[:2]
    cache.check_invariants()
