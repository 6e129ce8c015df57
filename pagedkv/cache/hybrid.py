"""KV-cache groups: a hybrid model (full-attention and sliding-window layers) on one block pool.

After vLLM v1's hybrid KV cache manager (``vllm/v1/core/kv_cache_coordinator.py``,
``HybridKVCacheCoordinator``; ``single_type_kv_cache_manager.py``, ``FullAttentionManager`` and
``SlidingWindowManager``). A model such as Gemma 2/3 or GPT-OSS names each layer's kind
(``CacheConfig.layer_types``); the layers of one kind form a **KV-cache group** with a block table of
its own per sequence:

- **one pool**: every group takes blocks from one :class:`~pagedkv.cache.allocator.BlockAllocator`, and
  the K/V memory is shared as in vLLM: pool ``i`` holds the ``i``-th layer of every group (a block id
  belongs to one group at a time, so the layers of two groups never meet in it). A model with ``F``
  full and ``S`` sliding layers needs ``max(F, S)`` pools, not ``F + S``;
- **per-group tables**: each group is a :class:`~pagedkv.cache.paged_cache.PagedKVCache` over the shared
  allocator and a view of the pools (``PagedKVCache.group``): its own block tables, slot mapping,
  copy-on-write (of its own layers), prefix-cache entries (under a namespace of its own: vLLM's
  ``BlockHashWithGroupId``), commits and frees; a sliding-window group releases the blocks no later
  query reads (:mod:`pagedkv.cache.window`, the rule of ``CacheConfig.window_left``), a full group none;
- **one hit length**: a prefix hit is the longest prefix every group can serve. A full-attention group
  needs every block (:meth:`~pagedkv.cache.allocator.BlockAllocator.find_cached_prefix`, downward
  closed), a sliding-window group only the blocks inside the window of the hit's end
  (:meth:`~pagedkv.cache.allocator.BlockAllocator.find_cached_window`); the groups are asked in turn,
  each accepting the length or lowering it, until none lowers it (vLLM's fixed point), and every group
  is truncated to the agreed length;
- **all or nothing**: an append counts every group's new blocks, copies and window releases before any
  group changes; bad arguments raise naming the argument before anything changes.

Calls mirror :class:`PagedKVCache`'s; what is per group takes ``group=`` (an index into :attr:`groups`)
or returns one value per group (:meth:`HybridKVCache.append`). Layer ``l`` reads and writes
``k_cache(l)`` / ``v_cache(l)`` with the tables and slots of group ``group_of(l)``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.cache.allocator import BlockAllocator, as_int, as_token_ids
from pagedkv.cache.config import CacheConfig
from pagedkv.cache.paged_cache import PagedKVCache, allocate_pools
from pagedkv.cache.prefix_hash import HashFn, check_cache_key, default_block_hash
from pagedkv.cache.sequence import check_seq_id
from pagedkv.errors import ArgumentTypeError, InvariantError, OutOfBlocksError


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: its ``layers`` (model layer indices, ascending) and their ``window_left``
    (``None``: full attention). ``kind`` is transformers' layer type name."""

    layers: tuple[int, ...]
    window_left: int | None
    block_size: int

    @property
    def kind(self) -> str:
        return "full_attention" if self.window_left is None else "sliding_attention"


def kv_cache_groups(config: CacheConfig) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of ``config``: layers with equal windows together, full attention first (vLLM sorts
    its attention groups so), then by first layer."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(config.layer_windows):
        by_window.setdefault(window, []).append(layer)
    specs = [KVCacheGroupSpec(tuple(layers), window, config.block_size) for window, layers in by_window.items()]
    return tuple(sorted(specs, key=lambda g: (g.window_left is not None, g.layers[0])))


class HybridKVCache:
    """K/V pools and block tables for a model whose layers attend fully or through a sliding window.

    Args:
        config: the geometry; ``config.layer_types`` names each layer's kind (``None``: every layer
            as ``window_left`` says, a single group).
        enable_prefix_caching: reuse full blocks of earlier prompts.
        hash_fn: the allocator's chained block hash (inject one to test collisions).

    Attributes:
        groups: one :class:`PagedKVCache` per KV-cache group, sharing :attr:`allocator` and the pools.
        specs: the groups' :class:`KVCacheGroupSpec`.

    Argument errors are :class:`PagedKVCache`'s (every method; a failed call changes nothing), plus
    ``IndexError`` for a ``group`` or ``layer`` outside the cache.

    Raises:
        ArgumentTypeError: ``config`` is not a :class:`CacheConfig`.
    """

    group_class = PagedKVCache  # each group's cache (a subclass plants a fault in one group's rules)

    def __init__(self, config: CacheConfig, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash) -> None:
        if not isinstance(config, CacheConfig):
            raise ArgumentTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size = config.block_size
        self.specs = kv_cache_groups(config)
        self.allocator = BlockAllocator(config.num_blocks, config.block_size,
                                        enable_prefix_caching=enable_prefix_caching, hash_fn=hash_fn)
        # pool i: the i-th layer of every group (vLLM shares one tensor among the groups' layers likewise)
        self.kv = allocate_pools(config, max(len(g.layers) for g in self.specs))
        self.groups = [self.group_class.group(config, self.allocator, self.kv[:len(spec.layers)], spec.window_left, g)
                       for g, spec in enumerate(self.specs)]
        self._layer = {layer: (g, i) for g, spec in enumerate(self.specs) for i, layer in enumerate(spec.layers)}

    # -- pools and groups ---------------------------------------------------------------------------
    def group_of(self, layer: int) -> int:
        """The group layer ``layer`` belongs to. Raises IndexError outside ``[0, num_layers)``."""
        return self._where(layer)[0]

    def _where(self, layer: int) -> tuple[int, int]:
        layer = as_int("layer", layer)
        if layer not in self._layer:
            raise IndexError(f"layer {layer} outside [0, num_layers={self.config.num_layers})")
        return self._layer[layer]

    def _group(self, group: int) -> PagedKVCache:
        group = as_int("group", group)
        if not 0 <= group < len(self.groups):
            raise IndexError(f"group {group} outside [0, {len(self.groups)}) (the cache's KV-cache groups)")
        return self.groups[group]

    def k_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s K pool, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view shared with
        the layers at the same place in the other groups)."""
        return self.kv[self._where(layer)[1], 0]

    def v_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s V pool (see :meth:`k_cache`)."""
        return self.kv[self._where(layer)[1], 1]

    @property
    def window_left(self) -> int | None:
        """``None``: some group attends fully (as the model's full layers need every block)."""
        windows = {g.window_left for g in self.groups}
        return windows.pop() if len(windows) == 1 else None

    @property
    def sequences(self) -> dict:
        """The live sequences (group 0's records; every group holds the same ids)."""
        return self.groups[0].sequences

    # -- sequences ----------------------------------------------------------------------------------
    def find_hit(self, prompt_token_ids: Sequence[int], cache_key: Hashable = None) -> list[tuple[int, list[int]]]:
        """The prefix hit every group agrees on, no references taken: per group ``(skip, blocks)``, the
        hit being ``skip + len(blocks)`` blocks in every group (``skip`` leading ones not needed).

        vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``: at most ``len(prompt) - 1`` tokens
        (the last one is computed), full-attention groups first (their hit only shrinks), then each
        sliding-window group searches below the current length; repeated until no group lowers it.

        Raises:
            ArgumentTypeError: a token id not an int, a bad ``cache_key``.
        """
        tokens = as_token_ids("prompt_token_ids", prompt_token_ids)
        cache_key = check_cache_key("cache_key", cache_key)
        bs = self.block_size
        length = max(len(tokens) - 1, 0) // bs  # in blocks
        self.allocator.prefix_queries += length  # counted once, for the agreed hit (not per group)
        hits: dict[int, tuple[int, list[int]]] = {}
        for g, group in enumerate(self.groups):
            if group.window_left is None:
                blocks = self.allocator.find_cached_prefix(tokens[:length * bs], group.group_key(cache_key),
                                                           record_stats=False)
                hits[g], length = (0, blocks), min(length, len(blocks))
        while True:
            before = length
            for g, group in enumerate(self.groups):
                if group.window_left is not None:
                    skip, blocks = self.allocator.find_cached_window(tokens[:length * bs], group.group_key(cache_key),
                                                                     group.window_left, record_stats=False)
                    hits[g], length = (skip, blocks), min(length, skip + len(blocks))
            if length == before:
                break
        self.allocator.prefix_hits += length
        agreed = []
        for g, group in enumerate(self.groups):  # every group truncated to the agreed length
            skip, blocks = hits[g]
            if group.window_left is None:
                agreed.append((0, blocks[:length]))
            else:
                assert skip + len(blocks) == length, "a sliding-window group's hit disagrees with the agreed length"
                agreed.append((skip, blocks))
        return agreed

    def add_sequence(self, seq_id: int, prompt_token_ids: Sequence[int] = (), *, cache_key: Hashable = None) -> int:
        """Start ``seq_id`` in every group on the agreed prefix hit (:meth:`find_hit`).

        Returns:
            Leading prompt tokens already cached (a multiple of ``block_size``), the same in every group.

        Raises:
            ValueError: ``seq_id`` is live. ArgumentTypeError: ``seq_id``, a token id or ``cache_key``.
        """
        check_seq_id("seq_id", seq_id)
        tokens = as_token_ids("prompt_token_ids", prompt_token_ids)
        cache_key = check_cache_key("cache_key", cache_key)
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} already exists")
        hit = self.find_hit(tokens, cache_key)
        cached = {group.start_sequence(seq_id, tokens, skip, blocks, cache_key)
                  for group, (skip, blocks) in zip(self.groups, hit)}
        return cached.pop()

    def _seq_check(self, seq_id: int) -> None:
        self.groups[0]._seq(seq_id)  # UnknownBlockError / DoubleFreeError / ArgumentTypeError

    def append(self, seq_id: int, token_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Reserve slots for ``token_ids`` in every group (each: window release, copy-on-write, allocation).

        Returns:
            One ``int64 [len(token_ids)]`` slot_mapping per group, on the cache's device: layer ``l``
            writes at ``slots[group_of(l)]``.

        Raises:
            OutOfBlocksError: the groups together need more blocks than are free (counting what their
            windows release); nothing changes. The rest as :meth:`PagedKVCache.append`.
        """
        self._seq_check(seq_id)
        token_ids = as_token_ids("token_ids", token_ids)
        need, free = self._need(seq_id, len(token_ids))
        if need > free:
            raise OutOfBlocksError(f"the KV-cache groups need {need} blocks, only {free} can be freed of "
                                   f"{self.allocator.num_blocks}")  # before any group changes
        for group in self.groups:  # every window first: a group that releases may serve another's allocation
            group._release_outside_window(group._seq(seq_id))
        return tuple(group.append(seq_id, token_ids) for group in self.groups)

    def _need(self, seq_id: int, n: int) -> tuple[int, int]:
        """``(blocks the groups need for n more tokens, blocks free once their windows release)``."""
        need, free = 0, self.allocator.num_free
        for group in self.groups:
            seq = group._seq(seq_id)
            new_blocks, cow = group._blocks_for_append(seq, n)
            need += new_blocks + cow
            free += sum(self.allocator.ref_count(b) == 1 for b in group._releasable(seq))
        return need, free

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``append(seq_id, <num_tokens tokens>)`` would find enough blocks in every group."""
        self._seq_check(seq_id)
        num_tokens = as_int("num_tokens", num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need, free = self._need(seq_id, num_tokens)
        return need <= free

    def mark_written(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Commit the first ``num_tokens`` tokens in every group (every layer's K/V is written).

        Returns:
            Blocks that entered the prefix cache, over the groups.

        Raises:
            as :meth:`PagedKVCache.mark_written` (checked on the first group, before any group commits).
        """
        self._seq_check(seq_id)
        n = self.seq_len(seq_id) if num_tokens is None else as_int("num_tokens", num_tokens)
        added = self.groups[0].mark_written(seq_id, n)  # raises (ShapeError) before any change
        return added + sum(group.mark_written(seq_id, n) for group in self.groups[1:])

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` shares every block of ``parent_id`` in every group (:meth:`PagedKVCache.fork`)."""
        self._seq_check(parent_id)
        check_seq_id("child_id", child_id)
        if child_id in self.sequences:
            raise ValueError(f"sequence {child_id} already exists")
        for group in self.groups:
            group.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """Release ``seq_id`` in every group (:meth:`PagedKVCache.free`)."""
        self._seq_check(seq_id)
        for group in self.groups:
            group.free(seq_id)

    # -- metadata for the ops -----------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        """Tokens stored for ``seq_id`` (the same in every group). Raises as :meth:`PagedKVCache.seq_len`."""
        return self.groups[0].seq_len(seq_id)

    def seq_lens(self, seq_ids: Iterable[int]) -> torch.Tensor:
        """``int32 [batch]`` stored lengths (the same in every group)."""
        return self.groups[0].seq_lens(seq_ids)

    def num_written(self, seq_id: int) -> int:
        """Leading tokens of ``seq_id`` committed (or served by the prefix cache), in every group."""
        return self.groups[0].num_written(seq_id)

    def cache_key(self, seq_id: int) -> Hashable:
        """The namespace ``seq_id`` was added under (``None``: the default one; not a group's own)."""
        return self.groups[0].cache_key(seq_id)

    def block_table(self, seq_id: int, group: int = 0) -> torch.Tensor:
        """``int32`` block table of ``seq_id`` in ``group`` (``-1`` where its window released a block)."""
        return self._group(group).block_table(seq_id)

    def block_tables(self, seq_ids: Iterable[int], pad: int = -1, width: int | None = None, *,
                     group: int = 0) -> torch.Tensor:
        """``int32 [batch, width]`` block tables of ``group`` (:meth:`PagedKVCache.block_tables`)."""
        return self._group(group).block_tables(seq_ids, pad, width)

    def slot_mapping(self, seq_id: int, start: int = 0, end: int | None = None, *, group: int = 0) -> torch.Tensor:
        """``int64`` slots of positions ``start .. end - 1`` in ``group`` (:meth:`PagedKVCache.slot_mapping`)."""
        return self._group(group).slot_mapping(seq_id, start, end)

    def first_held_position(self, seq_id: int, group: int = 0) -> int:
        """The first position ``group`` still holds a block for (``0`` in a full-attention group)."""
        return self._group(group).first_held_position(seq_id)

    # -- reports and checks -------------------------------------------------------------------------
    @property
    def num_cow_copies(self) -> int:
        """Copy-on-write copies over every group (each copies only its own layers' K/V)."""
        return sum(g.num_cow_copies for g in self.groups)

    def stats(self) -> dict[str, float]:
        """:meth:`PagedKVCache.stats` over the shared pool; window and copy counts summed over the groups,
        ``cached_tokens`` counted once per sequence (every group serves the same hit)."""
        out = self.groups[0].stats()
        for key in ("cow_copies", "window_released", "window_released_live"):
            out[key] = sum(g.stats()[key] for g in self.groups)
        out["kv_cache_groups"] = len(self.groups)
        return out

    def reference_counts(self) -> dict[int, int]:
        """``{block: live block tables holding it}``, over every group."""
        refs: dict[int, int] = {}
        for group in self.groups:
            for block, n in group.reference_counts().items():
                refs[block] = refs.get(block, 0) + n
        return refs

    def owners(self) -> dict[int, int]:
        """``{block: the group whose tables hold it}``. Raises InvariantError for a block two groups hold."""
        owner: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            for block in group.reference_counts():
                if owner.setdefault(block, g) != g:
                    raise InvariantError(f"block {block} is held by KV-cache groups {owner[block]} and {g}: one "
                                         "physical block serves two groups' layers")
        return owner

    def check_invariants(self) -> None:
        """:class:`~pagedkv.errors.InvariantError` unless: no block is held by two groups; the shared
        allocator's reference counts equal the tables holding each block, over every group; every
        group's tables are consistent (:meth:`PagedKVCache.check_tables`); every group holds the same
        sequences with the same tokens and commits; no cached block is registered under another
        group's namespace."""
        self.owners()
        self.allocator.check_invariants(self.reference_counts())
        first = self.groups[0]
        for g, group in enumerate(self.groups):
            group.check_tables()
            if group.sequences.keys() != first.sequences.keys() or any(
                    (s.token_ids, s.num_written) != (first.sequences[i].token_ids, first.sequences[i].num_written)
                    for i, s in group.sequences.items()):
                raise InvariantError(f"KV-cache group {g} disagrees with group 0 on the sequences, tokens or commits")
            for seq_id, seq in group.sequences.items():
                for block in seq.held_blocks:
                    entry = self.allocator.cached_entries().get(block)
                    if entry is not None and entry.cache_key[:2] != ("pagedkv.kv_cache_group", g):
                        raise InvariantError(f"block {block} of group {g} (sequence {seq_id}) is cached under "
                                             f"namespace {entry.cache_key!r}")
