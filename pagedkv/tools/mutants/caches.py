"""Cache mutants: faulty cache managers (``PagedKVCache`` / ``BlockAllocator`` subclasses) the properties
must reject, beside the backend mutants of :mod:`pagedkv.tools.mutants.backends`.

Each models one fault serving engines' block managers have shipped or nearly shipped, named in its
docstring. Each is exposed twice:

- :data:`CACHE_MUTANTS`: ``{name: faulty cache class}`` (the class the state machine drives);
- a backend per name (the ``indexed`` backend with ``cache_class`` set to the faulty cache, as
  :class:`pagedkv.tools.mutants.backends.NoCopyOnWrite`): :data:`CACHE_MUTANT_BACKENDS`, and module-level
  instances, so ``--pagedkv-impl=pagedkv.tools.mutants:register_on_reserve`` loads one.

:data:`CACHE_TARGETS` names the suite's properties that should kill each (the sharing properties
replay scenarios through :class:`~pagedkv.testing.properties.cache_model.CacheModel`).
"""

from __future__ import annotations

import types
from collections.abc import Hashable

from pagedkv.cache.allocator import BlockAllocator, check_cache_key
from pagedkv.cache.hybrid import HybridKVCache
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.window import releasable_blocks
from pagedkv.tools.mutants.backends import IndexedBackend


def _with_allocator(allocator_class: type[BlockAllocator]):
    """A ``PagedKVCache.__init__`` that builds its allocator from ``allocator_class``."""

    def __init__(self, config, *, enable_prefix_caching: bool = True, **kw) -> None:
        PagedKVCache.__init__(self, config, enable_prefix_caching=enable_prefix_caching, **kw)
        a = self.allocator
        self.allocator = allocator_class(a.num_blocks, a.block_size, enable_prefix_caching=enable_prefix_caching,
                                         hash_fn=a.hash_fn)

    return __init__


# -- the faults ---------------------------------------------------------------------------------------------
class RegisterOnReserveCache(PagedKVCache):
    """Full blocks enter the prefix cache when their slots are reserved (``append``), not when their
    K/V is written: a request preempted or aborted between slot reservation and the forward pass
    leaves cache entries for blocks nobody wrote, and a later prompt is served garbage (case C11)."""

    def append(self, seq_id, token_ids):
        seq = self._seq(seq_id)
        start = seq.num_tokens
        slots = super().append(seq_id, token_ids)
        bs, table = self.block_size, seq.block_table
        for i in range(start // bs, seq.num_tokens // bs):  # FAULT: registered before the write
            self.allocator.cache_full_block(table[i], seq.token_ids[i * bs:(i + 1) * bs], table[i - 1] if i else None,
                                            cache_key=seq.cache_key)
        return slots


class CowFirstLayerOnlyCache(PagedKVCache):
    """Copy-on-write copies K and V of the first layer only (a copy over ``kv_caches[0]``, or a loop
    over layers that stops early): the copy's other layers keep a previous owner's stale K/V."""

    def append(self, seq_id, token_ids):
        before = self.kv[1:].clone()
        table_len = len(self._seq(seq_id).block_table)
        copies = self.num_cow_copies
        slots = super().append(seq_id, token_ids)
        if self.num_cow_copies != copies:  # FAULT: layers >= 1 of the copy are not copied
            new = self.sequences[seq_id].block_table[table_len - 1]
            self.kv[1:, :, new] = before[:, :, new]
        return slots


class CowFullSharedBlockCache(PagedKVCache):
    """Copy-on-write tests only "last block shared", not "and partially filled": an append after a
    full shared last block (a fork on a block boundary, a prefix hit) copies it, so sharing is lost
    and a block is wasted on every such append."""

    def _blocks_for_append(self, seq, n):
        new_blocks, _ = super()._blocks_for_append(seq, n)
        cow = n > 0 and bool(seq.block_table) and self.allocator.ref_count(seq.block_table[-1]) > 1  # FAULT
        return new_blocks, cow


class _EvictMostRecentAllocator(BlockAllocator):
    def allocate(self, n=1):
        self._evictable = type(self._evictable)(reversed(self._evictable.items()))  # FAULT: MRU first
        try:
            return super().allocate(n)
        finally:
            self._evictable = type(self._evictable)(reversed(self._evictable.items()))


class EvictMostRecentCache(PagedKVCache):
    """Allocation evicts the most recently released cached block instead of the least recently
    released one (a stack where an LRU queue was meant): a prefix released just now is lost first."""

    __init__ = _with_allocator(_EvictMostRecentAllocator)


class _ReleaseHeadFirstAllocator(BlockAllocator):
    def free_all(self, blocks):
        blocks = list(blocks)
        super().free_all(blocks[::-1])  # FAULT: the base releases reversed(blocks); this releases in table order


class ReleaseHeadFirstCache(PagedKVCache):
    """A sequence's blocks are released in table order, so its first block (the shared head of every
    prompt with that prefix) is evicted first and the whole cached prefix becomes unreachable."""

    __init__ = _with_allocator(_ReleaseHeadFirstAllocator)


class _ParentNotCheckedAllocator(BlockAllocator):
    def __init__(self, num_blocks, block_size, *, enable_prefix_caching=True, hash_fn=None):
        inner = hash_fn
        super().__init__(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                         hash_fn=lambda parent, tokens: inner(None, tokens))  # FAULT: the hash forgets the parent

    def _matches(self, block, tokens, parent, cache_key=None):
        e = self._entries[block]
        return e.tokens == tokens and e.cache_key == cache_key  # FAULT: ... and so does the match


class ParentNotCheckedCache(PagedKVCache):
    """A cached block is keyed by its own tokens only (hash and match ignore the parent chain): after a
    matching first block, a block whose tokens follow a *different* prefix is a hit, and the prompt is
    served K/V computed after other tokens (invisible to values that depend on a token and its
    position only)."""

    __init__ = _with_allocator(_ParentNotCheckedAllocator)


class CacheKeyIgnoredCache(PagedKVCache):
    """The namespace (LoRA adapter, tenant's cache salt) is dropped before the prefix lookup and the
    block registration: two tenants' equal prompts share blocks computed under the other's key."""

    def add_sequence(self, seq_id, prompt_token_ids=(), *, cache_key: Hashable = None):
        check_cache_key("cache_key", cache_key)
        return super().add_sequence(seq_id, prompt_token_ids)  # FAULT: cache_key not passed on


class _FirstCandidateOnlyAllocator(BlockAllocator):
    def find_cached_prefix(self, token_ids, cache_key=None, *, record_stats=True):
        from pagedkv.cache.allocator import as_token_ids, root_hash

        tokens = tuple(as_token_ids("token_ids", token_ids))
        if not self.enable_prefix_caching:
            return []
        chain, parent, h, bs = [], None, root_hash(cache_key), self.block_size
        for end in range(bs, len(tokens) + 1, bs):
            block_tokens = tokens[end - bs:end]
            h = self.hash_fn(h, block_tokens)
            match = [b for b in self._by_hash.get(h, ()) if self._matches(b, block_tokens, parent, cache_key)]
            if not match:
                break
            parent = match[0]  # FAULT: follows the first equal copy only, never a longer chain under another
            chain.append(parent)
        return chain


class FirstCandidateOnlyCache(PagedKVCache):
    """A prefix lookup follows only the first cached copy of each block: when two requests filled an
    equal block independently, the longer chain cached under the other copy is never found."""

    __init__ = _with_allocator(_FirstCandidateOnlyAllocator)


class _DropEntryOnReleaseAllocator(BlockAllocator):
    def free(self, block):
        super().free(block)
        if self._ref[block] == 0 and block in self._evictable:  # FAULT: the entry goes with the last reference
            del self._evictable[block]
            self._uncache(block)
            self._free[block] = None


class DropEntryOnReleaseCache(PagedKVCache):
    """A block's prefix-cache entry is dropped when its last reference goes, so nothing released is
    ever reused: the prefix cache only serves prompts that overlap a live sequence."""

    __init__ = _with_allocator(_DropEntryOnReleaseAllocator)


#: ``{name: faulty cache class}``.
CACHE_MUTANTS: dict[str, type] = {
    "register_on_reserve": RegisterOnReserveCache,
    "cow_first_layer_only": CowFirstLayerOnlyCache,
    "cow_full_shared_block": CowFullSharedBlockCache,
    "evict_most_recent": EvictMostRecentCache,
    "release_head_first": ReleaseHeadFirstCache,
    "parent_not_checked": ParentNotCheckedCache,
    "cache_key_ignored": CacheKeyIgnoredCache,
    "first_candidate_only": FirstCandidateOnlyCache,
    "drop_entry_on_release": DropEntryOnReleaseCache,
}

#: The registered properties (:mod:`pagedkv.testing.registry`) that should kill each; every one is also
#: killed by a committed scenario case file and by the cache state machine (``tests/tools/test_cache_mutants.py``).
CACHE_TARGETS: dict[str, tuple[str, ...]] = {
    name: ("cache_state_machine_holds_its_invariants", "every_live_sequence_reads_only_its_own_tokens",
           "prefix_caching_changes_no_output")
    for name in CACHE_MUTANTS}


# -- faults of the hybrid cache (KV-cache groups), killed by the hybrid state machine ----------------------
class FullGroupUntruncatedCache(HybridKVCache):
    """A full-attention group keeps its own longest hit instead of the length every group agreed on
    (vllm#50457: only the first full group was truncated): its table and reference counts run past the
    tokens the sequence holds."""

    def find_hit(self, prompt_token_ids, cache_key=None):
        agreed = super().find_hit(prompt_token_ids, cache_key)
        bs, tokens = self.block_size, list(prompt_token_ids)
        cacheable = tokens[:max(len(tokens) - 1, 0) // bs * bs]
        return [(0, self.allocator.find_cached_prefix(cacheable, group.group_key(cache_key), record_stats=False))
                if group.window_left is None else hit for group, hit in zip(self.groups, agreed)]  # FAULT

    def add_sequence(self, seq_id, prompt_token_ids=(), *, cache_key=None):
        super().add_sequence(seq_id, prompt_token_ids, cache_key=cache_key)
        return self.groups[-1].num_written(seq_id)


class WindowOnFullLayersCache(HybridKVCache):
    """The sliding window is applied to every group, the full-attention layers included (vllm#51756): a
    full layer's early blocks are released while its queries still read them."""

    def __init__(self, config, **kw):
        super().__init__(config, **kw)
        for group in self.groups:
            group.window_left = config.window_left  # FAULT: full groups release too


class OneGroupCapacityCache(HybridKVCache):
    """An append checks the free blocks against the first group's need only: when the others do not fit,
    the first group has already released, copied and allocated (a half-done append)."""

    def _need(self, seq_id, n):
        group = self.groups[0]
        seq = group._seq(seq_id)
        new_blocks, cow = group._blocks_for_append(seq, n)  # FAULT: the other groups' blocks not counted
        return new_blocks + cow, self.allocator.num_free + sum(self.allocator.ref_count(b) == 1
                                                               for b in group._releasable(seq))


class WindowLookupNeedsChainCache(HybridKVCache):
    """A sliding-window group's hit needs every block from the first, as a full group's does: once its
    released head blocks are evicted, the prompt never hits again although its window is cached."""

    def find_hit(self, prompt_token_ids, cache_key=None):
        alloc = self.allocator
        real = alloc.find_cached_window
        alloc.find_cached_window = lambda tokens, key, window, **_: (  # FAULT: the whole chain needed
            lambda blocks: (min(len(blocks), releasable_blocks(len(blocks) * self.block_size, window,
                                                               self.block_size, keep_last_full=True)),
                            blocks[releasable_blocks(len(blocks) * self.block_size, window, self.block_size,
                                                     keep_last_full=True):]))(
            alloc.find_cached_prefix(tokens, key, record_stats=False))
        try:
            return super().find_hit(prompt_token_ids, cache_key)
        finally:
            alloc.find_cached_window = real


class _WindowSizeGroup(PagedKVCache):
    def _releasable(self, seq):
        if self.window_left is None:
            return []
        bs, n = self.block_size, releasable_blocks(seq.num_written, self.window_left - 1, self.block_size)  # FAULT
        last_full = seq.num_written // bs - 1
        if last_full >= 0 and seq.block_table[last_full] != -1 and self.allocator.is_cached(seq.block_table[last_full]):
            n = min(n, max(last_full, 0))
        return seq.block_table[seq.num_released:max(n, seq.num_released)]


class WindowOffByOneCache(HybridKVCache):
    """A sliding-window group releases with ``sliding_window`` where ``window_left = sliding_window - 1``
    was meant: at a block boundary it releases the block holding the oldest key the next query reads."""

    group_class = _WindowSizeGroup


#: ``{name: faulty hybrid cache class}``, gated as managers (:class:`~pagedkv.testing.managers.own.OwnHybridManager`
#: over the class) by the cache-manager machine in the ``"gemma3"`` layout.
HYBRID_CACHE_MUTANTS: dict[str, type] = {
    "full_group_untruncated": FullGroupUntruncatedCache,
    "window_on_full_layers": WindowOnFullLayersCache,
    "one_group_capacity": OneGroupCapacityCache,
    "window_lookup_needs_chain": WindowLookupNeedsChainCache,
    "window_off_by_one": WindowOffByOneCache,
}


def _hybrid_manager(name: str, cache_class: type) -> types.SimpleNamespace:
    from pagedkv.testing.managers.own import OwnHybridManager, with_cache_class

    return types.SimpleNamespace(name=name, cache_manager=with_cache_class(cache_class, OwnHybridManager),
                                 cache_manager_layouts=("gemma3",))


for _name, _cls in HYBRID_CACHE_MUTANTS.items():  # candidates for --pagedkv-impl and program files
    globals()[_name] = _hybrid_manager(_name, _cls)


def _backend_class(name: str, cache_class: type) -> type:
    doc = f"The ``indexed`` backend over a faulty cache manager: {cache_class.__doc__}"
    return type(f"CacheMutant_{name}", (IndexedBackend,), {"name": name, "cache_class": cache_class, "__doc__": doc})


#: ``{name: backend class}``: the indexed backend with ``cache_class`` set to the faulty cache.
CACHE_MUTANT_BACKENDS: dict[str, type] = {name: _backend_class(name, cls) for name, cls in CACHE_MUTANTS.items()}

