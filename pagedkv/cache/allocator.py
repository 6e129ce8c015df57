"""Block allocator: free list, reference counts, prefix caching with LRU eviction.

Design (after vLLM's block manager and its v1 prefix cache):

- Every physical block is in exactly one of three states: *free* (no owner, no cached content),
  *used* (reference count >= 1: referenced by that many block tables) or *evictable* (reference
  count 0 but holding a cached full block that a later prefix lookup may revive).
- ``num_free`` counts free + evictable blocks, so ``num_free + num_used == num_blocks`` always.
- Allocation takes free blocks first, then evicts the least recently released evictable block.
- Prefix caching keys each full block by a chained hash ``h_i = hash_fn(h_{i-1}, tokens_i)``, with
  ``h_{-1}`` derived from the sequence's ``cache_key`` (a namespace: a LoRA adapter, a tenant's cache
  salt, multimodal extra keys; ``None`` by default; a ``str``, an ``int`` or a tuple of them, compared
  with their type: :func:`pagedkv.cache.prefix_hash.check_cache_key`), so equal tokens under two keys never share. Each
  cached block records its own tokens and its parent (the cached block before it, with the parent's
  *generation*, bumped whenever a block's cache entry is dropped). A lookup walks the prompt block
  by block and accepts a candidate only when its tokens are equal and its parent is the block just
  matched, in the same generation: by induction the whole prefix is equal, so a hash collision is
  never a hit, and each block costs ``O(block_size)`` however long the context. A first block also
  matches only under an equal ``cache_key``, so a hash collision across keys is never a hit either.
- Eviction order: released blocks join the evictable list in release order; :meth:`free_all` releases
  a table's blocks last first, so among blocks released together the deepest is evicted first and a
  cached prefix keeps its head longest. Allocation evicts the least recently released block first;
  a later lookup stops at the first evicted block (its children's parent generation no longer matches).
- The allocator registers what it is told: the cache registers a full block only once its K/V is
  written (:meth:`pagedkv.cache.paged_cache.PagedKVCache.mark_written`).
- Besides the hash chain, every entry points at an interned *prefix node* (a trie of exact token
  prefixes under a namespace, SGLang's radix tree): a node lives while an entry caches it or a child
  node hangs from it, so it outlives an evicted parent block. :meth:`find_cached_window` walks the
  nodes and needs cached blocks only inside the window of the hit's end (vLLM v1's
  ``SlidingWindowManager.find_longest_cache_hit``): a sliding-window KV-cache group is served although
  its head blocks were released and evicted. Node keys compare exactly (the parent node by identity,
  the tokens and namespace by value), so a hash collision is never a hit there either.
- Every method either succeeds or raises before changing anything.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.errors import (ArgumentTypeError, DoubleFreeError, InvariantError, OutOfBlocksError, ShapeError,
                            UnknownBlockError)
from pagedkv.cache.prefix_hash import HashFn, check_cache_key, default_block_hash, root_hash
from pagedkv.cache.window import releasable_blocks


def as_int(name: str, value: object) -> int:
    """``value`` as a Python int: ints and NumPy/torch integer scalars pass, bools and floats do not.

    Raises:
        ArgumentTypeError (a ``TypeError``): ``value`` is not an integer.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must be an int, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        return int(value.item())
    return operator.index(value)


def as_token_ids(name: str, token_ids: object) -> list[int]:
    """Token ids (a sequence of ints or a 1-D integer tensor) as a list of Python ints.

    Raises:
        ArgumentTypeError (a ``TypeError``): not a sequence of integers (a float, bool or string entry,
            a float tensor, a string).
        ShapeError (a ``ValueError``): a tensor that is not 1-D.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ShapeError(f"{name} must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must hold integers, got dtype {token_ids.dtype}")
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ArgumentTypeError(f"{name} must be a sequence of ints, got {type(token_ids).__name__}")
    out = []
    for i, t in enumerate(token_ids):
        if isinstance(t, (bool, torch.Tensor)) or not hasattr(t, "__index__"):
            raise ArgumentTypeError(f"{name}[{i}] must be an int, got {type(t).__name__} {t!r}")
        out.append(operator.index(t))
    return out


@dataclass(frozen=True)
class CacheEntry:
    """What a cached full block holds: its chained ``hash``, its own ``tokens`` (``block_size`` ids),
    its position in the prompt (``depth``: block ``depth`` holds positions ``depth * block_size ..``),
    its ``parent`` cached block (``None`` for the first block) in generation ``parent_generation``, and
    the namespace ``cache_key`` it was written under."""

    hash: Hashable
    tokens: tuple[int, ...]
    depth: int
    parent: int | None
    parent_generation: int
    cache_key: Hashable = None
    node: "PrefixNode | None" = dataclasses.field(default=None, compare=False, repr=False)


class PrefixNode:
    """One exact token prefix (a node of the prefix trie): ``key`` is ``(parent node or None, cache_key
    for a first block else None, the block's tokens)``; ``blocks`` cache it now; ``refs`` counts those
    blocks plus the child nodes (at zero the node is dropped)."""

    __slots__ = ("key", "parent", "refs", "blocks")

    def __init__(self, key: tuple, parent: "PrefixNode | None") -> None:
        self.key, self.parent, self.refs, self.blocks = key, parent, 0, []


class BlockAllocator:
    """Hands out physical block ids ``0 .. num_blocks - 1`` with reference counting and a prefix cache.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (prefix caching hashes full blocks of this many tokens).
        enable_prefix_caching: keep released full blocks for reuse by later prompts.
        hash_fn: ``hash_fn(parent_hash, token_ids_tuple) -> hashable``; inject one (even a constant)
            to test collision handling.

    Raises:
        ArgumentTypeError: ``num_blocks`` or ``block_size`` not an int. ShapeError: not positive.

    Block ids passed to any method must be ints in ``[0, num_blocks)``: a non-int raises
    :class:`~pagedkv.errors.ArgumentTypeError` (``TypeError``), an id outside the pool
    :class:`~pagedkv.errors.UnknownBlockError` (``ValueError``). Token ids must be ints (see
    :func:`as_token_ids`). Every failed call leaves the state unchanged.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash) -> None:
        num_blocks, block_size = as_int("num_blocks", num_blocks), as_int("block_size", block_size)
        if num_blocks < 1 or block_size < 1:
            raise ShapeError(f"num_blocks and block_size must be >= 1, got num_blocks={num_blocks}, "
                             f"block_size={block_size}")
        if not callable(hash_fn):
            raise ArgumentTypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._entries: dict[int, CacheEntry] = {}  # cached block -> what it caches
        self._generation = [0] * num_blocks  # bumped when a block's cache entry is dropped
        self._by_hash: dict[Hashable, list[int]] = {}
        self._nodes: dict[tuple, PrefixNode] = {}  # the prefix trie (find_cached_window)
        self.num_evictions = 0
        self.prefix_queries = 0  # full blocks looked up
        self.prefix_hits = 0  # full blocks found

    # -- state --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free plus evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with reference count >= 1."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a prefix-cache entry (used or evictable)."""
        return len(self._entries)

    def ref_count(self, block: int) -> int:
        """Reference count of ``block``. Raises UnknownBlockError outside the pool."""
        self._check_id(block)
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        """True when ``block`` can be handed out (free or evictable)."""
        self._check_id(block)
        return block in self._free or block in self._evictable

    def is_cached(self, block: int) -> bool:
        """True when ``block`` holds a prefix-cache entry (used or evictable)."""
        self._check_id(block)
        return block in self._entries

    def _check_id(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int):
            raise ArgumentTypeError(f"block id must be an int, got {type(block).__name__} {block!r}")
        if not 0 <= block < self.num_blocks:
            raise UnknownBlockError(f"block id {block!r} outside [0, num_blocks={self.num_blocks})")

    # -- allocate / share / release ------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks (reference count 1 each): free ones first, then the LRU evictable ones.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks can be taken; nothing changes.
            ValueError: ``n < 0``. ArgumentTypeError: ``n`` not an int.
        """
        n = as_int("n", n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, only {self.num_free} free of {self.num_blocks}")
        blocks = []
        for _ in range(n):
            if self._free:
                block, _ = self._free.popitem(last=False)
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block: int) -> None:
        """Add one reference to a used block (a fork, or a prefix hit on a used block).

        Raises:
            UnknownBlockError: outside the pool, or the block is free (nothing to share).
        """
        self._check_id(block)
        if self._ref[block] == 0:
            raise UnknownBlockError(f"block {block} is not allocated; cannot add a reference")
        self._ref[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block becomes evictable (cached) or free.

        Raises:
            UnknownBlockError: outside the pool.
            DoubleFreeError: the block holds no reference (already free); nothing changes.
        """
        self._check_id(block)
        if self._ref[block] == 0:
            raise DoubleFreeError(f"block {block} freed twice: it holds no reference")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._entries:
                self._evictable[block] = None
            else:
                self._free[block] = None

    def free_all(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each of ``blocks``, all or nothing.

        Released in reverse order so a sequence's tail blocks are evicted before its shared prefix.

        Raises:
            UnknownBlockError / DoubleFreeError: before any reference is dropped.
        """
        blocks = list(blocks)
        need: dict[int, int] = {}
        for block in blocks:
            self._check_id(block)
            need[block] = need.get(block, 0) + 1
        for block, count in need.items():
            if self._ref[block] < count:
                raise DoubleFreeError(f"block {block} released {count} times but holds {self._ref[block]} references")
        for block in reversed(blocks):
            self.free(block)

    # -- prefix cache ---------------------------------------------------------------------------
    def _uncache(self, block: int) -> None:
        entry = self._entries.pop(block)
        self._generation[block] += 1  # children registered under the old content no longer match
        owners = self._by_hash[entry.hash]
        owners.remove(block)
        if not owners:
            del self._by_hash[entry.hash]
        entry.node.blocks.remove(block)
        self._unref_node(entry.node)

    def _node_for(self, parent: PrefixNode | None, cache_key: Hashable, tokens: tuple[int, ...]) -> PrefixNode:
        key = (parent, cache_key if parent is None else None, tokens)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = PrefixNode(key, parent)
            if parent is not None:
                parent.refs += 1
        return node

    def _unref_node(self, node: PrefixNode | None) -> None:
        while node is not None:
            node.refs -= 1
            if node.refs:
                return
            del self._nodes[node.key]
            node = node.parent

    def _matches(self, block: int, tokens: tuple[int, ...], parent: int | None, cache_key: Hashable = None) -> bool:
        e = self._entries[block]
        return e.tokens == tokens and e.parent == parent and e.cache_key == cache_key and \
            (parent is None or e.parent_generation == self._generation[parent])

    def find_cached_prefix(self, token_ids: Sequence[int], cache_key: Hashable = None, *,
                           record_stats: bool = True) -> list[int]:
        """Blocks caching the longest run of leading full blocks of ``token_ids`` (no references taken).

        Args:
            token_ids: the prompt (a sequence of ints or a 1-D integer tensor); only whole blocks are looked up.
            cache_key: the namespace the blocks must have been written under (``None``: the default one).
            record_stats: count the lookup in ``prefix_queries`` / ``prefix_hits`` (checks pass False).

        A candidate found by hash counts only when its tokens and ``cache_key`` equal the block's and
        its parent is the block matched just before (same generation), so colliding hashes never
        produce a false hit. Equal blocks cached twice (two sequences filled them independently) are
        all followed, so a longer chain under either copy is found.

        Raises:
            ArgumentTypeError: a token id that is not an int, or an unhashable ``cache_key``.
        """
        tokens = tuple(as_token_ids("token_ids", token_ids))
        cache_key = check_cache_key("cache_key", cache_key)
        if not self.enable_prefix_caching:
            return []
        chains: dict[int | None, list[int]] = {None: []}  # matched block -> the chain ending in it
        parent_hash, bs = root_hash(cache_key), self.block_size
        for end in range(bs, len(tokens) + 1, bs):
            self.prefix_queries += record_stats
            block_tokens = tokens[end - bs:end]
            h = self.hash_fn(parent_hash, block_tokens)
            candidates = self._by_hash.get(h, ())
            longer = {b: chain + [b] for parent, chain in chains.items() for b in candidates
                      if self._matches(b, block_tokens, parent, cache_key)}
            if not longer:
                break
            self.prefix_hits += record_stats
            chains, parent_hash = longer, h
        return min(chains.values())  # deterministic among equally long chains

    def find_cached_window(self, token_ids: Sequence[int], cache_key: Hashable = None,
                           window_left: int | None = None, *, record_stats: bool = True) -> tuple[int, list[int]]:
        """The longest prefix of ``token_ids``'s full blocks whose window is cached (no references taken).

        A query after a hit of ``E`` blocks sits at position ``E * block_size`` and reads keys from
        ``E * block_size - window_left``: only blocks ``skip .. E - 1`` are needed, with ``skip =
        releasable_blocks(E * block_size, window_left, block_size, keep_last_full=True)`` (the last
        full block always: the next block cached chains to it). The prefix trie says which prefixes
        some block caches, however many of their ancestors were evicted; the search runs from the
        longest prefix down (vLLM v1's ``SlidingWindowManager.find_longest_cache_hit``). With
        ``window_left=None`` every block is needed (then it finds what :meth:`find_cached_prefix` finds,
        or more: a chain whose blocks were cached under different parents).

        Args:
            token_ids: the prompt's tokens to look up (whole blocks only).
            cache_key: the namespace.
            window_left: the window (``None``: full attention).
            record_stats: count the full blocks looked up in ``prefix_queries`` and the hit's in
                ``prefix_hits`` (checks pass False).

        Returns:
            ``(skip, blocks)``: the hit is ``skip + len(blocks)`` blocks, of which the first ``skip``
            need not be held (``-1`` in the table) and ``blocks`` cache the rest; ``(0, [])`` for no hit.

        Raises:
            ArgumentTypeError: a token id or ``window_left`` that is not an int, an unhashable ``cache_key``.
        """
        tokens = tuple(as_token_ids("token_ids", token_ids))
        cache_key = check_cache_key("cache_key", cache_key)
        if window_left is not None:
            window_left = as_int("window_left", window_left)
        if not self.enable_prefix_caching:
            return 0, []
        nodes: list[PrefixNode] = []
        bs = self.block_size
        for end in range(bs, len(tokens) + 1, bs):
            node = self._nodes.get((nodes[-1] if nodes else None, None if nodes else cache_key, tokens[end - bs:end]))
            if node is None:
                break
            nodes.append(node)
        run = [0] * (len(nodes) + 1)  # run[e]: cached nodes in a row ending at depth e - 1 (one pass: O(n))
        for d, node in enumerate(nodes):
            run[d + 1] = run[d] + 1 if node.blocks else 0
        self.prefix_queries += record_stats * (len(tokens) // bs)
        for end in range(len(nodes), 0, -1):
            skip = releasable_blocks(end * bs, window_left, bs, keep_last_full=True)
            if run[end] >= end - skip:
                self.prefix_hits += record_stats * end
                return skip, [min(nodes[d].blocks) for d in range(skip, end)]
        return 0, []

    def cached_entries(self) -> dict[int, CacheEntry]:
        """``{block: CacheEntry}`` for every block holding a prefix-cache entry (a copy)."""
        return dict(self._entries)

    def cached_prefix(self, block: int) -> tuple[int, ...] | None:
        """The full token prefix ``block`` ends, following its parents; ``None`` when a parent was evicted."""
        parts = []
        while block is not None:
            entry = self._entries.get(block)
            if entry is None:
                return None
            parts.append(entry.tokens)
            if entry.parent is not None and entry.parent_generation != self._generation[entry.parent]:
                return None
            block = entry.parent
        return tuple(t for part in reversed(parts) for t in part)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one reference on each cached block found by :meth:`find_cached_prefix`, reviving evictable ones.

        Raises:
            UnknownBlockError: a block that is neither used nor evictable-cached; nothing changes.
        """
        blocks = list(blocks)
        for block in blocks:
            self._check_id(block)
            if self._ref[block] == 0 and block not in self._evictable:
                raise UnknownBlockError(f"block {block} is free and caches nothing; cannot acquire it")
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def cache_full_block(self, block: int, token_ids: Sequence[int], parent: int | None = None, *,
                         cache_key: Hashable = None) -> bool:
        """Register used ``block`` as caching one full block of ``token_ids`` that follows cached ``parent``.

        Call it only once the block's K/V is written in every layer (the cache does, from
        :meth:`~pagedkv.cache.paged_cache.PagedKVCache.mark_written`): a registered block is served to later prompts.

        Args:
            block: a used block now holding ``block_size`` tokens' K/V.
            token_ids: exactly ``block_size`` token ids: this block's own tokens.
            parent: the cached block before it in the sequence (``None`` for a sequence's first block).
            cache_key: the namespace the block was written under (a parent's must be the same).

        Returns:
            True when registered; False when the prefix cache is off, ``block`` is cached already, or
            ``parent`` caches nothing or caches under another ``cache_key`` (then no lookup could reach
            ``block`` anyway).

        Raises:
            UnknownBlockError: ``block`` is not used or outside the pool.
            ShapeError: ``len(token_ids) != block_size``.
            ArgumentTypeError: non-integer token ids, or an unhashable ``cache_key``.
        """
        tokens = tuple(as_token_ids("token_ids", token_ids))
        cache_key = check_cache_key("cache_key", cache_key)
        self._check_id(block)
        if self._ref[block] == 0:
            raise UnknownBlockError(f"block {block} is not allocated; cannot cache it")
        if len(tokens) != self.block_size:
            raise ShapeError(f"token_ids has {len(tokens)} ids, a full block holds block_size {self.block_size}")
        if parent is not None:
            self._check_id(parent)
        if not self.enable_prefix_caching or block in self._entries or \
                (parent is not None and (parent not in self._entries or self._entries[parent].cache_key != cache_key)):
            return False
        parent_entry = self._entries.get(parent) if parent is not None else None
        h = self.hash_fn(parent_entry.hash if parent_entry else root_hash(cache_key), tokens)
        node = self._node_for(parent_entry.node if parent_entry else None, cache_key, tokens)
        node.refs += 1
        node.blocks.append(block)
        self._entries[block] = CacheEntry(h, tokens, parent_entry.depth + 1 if parent_entry else 0, parent,
                                          self._generation[parent] if parent is not None else 0, cache_key, node)
        self._by_hash.setdefault(h, []).append(block)
        return True

    @property
    def num_shared(self) -> int:
        """Blocks referenced by two or more block tables (forks, prefix hits)."""
        return sum(1 for r in self._ref if r > 1)

    def snapshot(self) -> dict:
        """A copy of the whole state, for comparing before and after a call that must change nothing:
        ``ref_counts``, ``free`` and ``evictable`` (in hand-out order), ``entries`` (block -> CacheEntry),
        ``generations`` and ``hash_index`` (hash -> blocks)."""
        return {"ref_counts": list(self._ref), "free": list(self._free), "evictable": list(self._evictable),
                "entries": dict(self._entries), "generations": list(self._generation),
                "hash_index": {h: list(bs) for h, bs in self._by_hash.items()}}

    def evictable_blocks(self) -> list[int]:
        """Blocks with reference count 0 that still cache a prefix, in eviction order (next evicted first)."""
        return list(self._evictable)

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise :class:`~pagedkv.errors.InvariantError` (an ``AssertionError``) unless the state is consistent.

        Checks: free + used == total; free, evictable and used are disjoint; free blocks cache
        nothing; evictable blocks are cached with reference 0; and, when given, every block's
        reference count equals ``expected_refs.get(block, 0)`` (the number of tables holding it).
        """
        def require(ok: bool, message: str) -> None:
            if not ok:
                raise InvariantError(message)

        free, evictable = set(self._free), set(self._evictable)
        require(len(free) == len(self._free) and not free & evictable, "a block is listed twice as free")
        used = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        require(not used & (free | evictable), f"blocks both used and free: {sorted(used & (free | evictable))}")
        require(len(free) + len(evictable) + len(used) == self.num_blocks, "free + used != total")
        require(all(b in self._entries for b in evictable), "an evictable block caches nothing")
        require(not free & set(self._entries), "a free block still caches a prefix")
        require(all(r >= 0 for r in self._ref), "negative reference count")
        require(all(b in e.node.blocks for b, e in self._entries.items()) and
                sum(len(n.blocks) for n in self._nodes.values()) == len(self._entries),
                "the prefix trie disagrees with the cache entries")
        if expected_refs is not None:
            for b in range(self.num_blocks):
                require(self._ref[b] == expected_refs.get(b, 0),
                        f"block {b}: reference count {self._ref[b]} != {expected_refs.get(b, 0)} referencing tables")
