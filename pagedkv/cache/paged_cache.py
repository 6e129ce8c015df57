"""The paged KV cache: K/V pools plus per-sequence block tables.

``PagedKVCache`` owns one K and one V pool per layer, each ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (the NHD layout of vLLM and FlashInfer), and the bookkeeping an engine's scheduler needs:
which blocks each sequence owns, where its next tokens go (``slot_mapping``), sharing by ``fork``,
copy-on-write when a shared, partially filled block is appended to, and prefix caching.

A step of an engine looks like::

    cached = cache.add_sequence(seq_id, prompt)           # prefix-cache hit: tokens not to recompute
    slots = cache.append(seq_id, prompt[cached:])         # 1. reserve slots for the new tokens
    backend.write_kv(cache.k_cache(layer), cache.v_cache(layer), k, v, slots)   # 2. write, per layer
    out = backend.paged_attention(q, cache.k_cache(layer), cache.v_cache(layer),
                                  cache.block_tables(ids), cache.seq_lens(ids), query_start_loc)
    cache.mark_written(seq_id)                            # 3. commit: full blocks enter the prefix cache
    ...
    cache.free(seq_id)                                    # 4. release (finish, preempt or abort)

A full block enters the prefix cache only at ``mark_written``, once its K/V is written in every
layer: a sequence freed (preempted, aborted) between ``append`` and ``mark_written``, or whose write
raised, leaves no entry, so no later prompt is served K/V that nobody wrote. The lifecycle is drawn
in ``docs/cache.md``.

With ``CacheConfig.window_left`` set (every layer attends through that window), ``append`` (the
next step) and ``add_sequence`` release the leading blocks no later query can read and set their table entries to
``-1`` (:mod:`pagedkv.cache.window`, after vLLM v1's ``SlidingWindowManager``); a released block that
another table shares, or that caches a prefix, just loses one reference. With
``CacheConfig.debug_poison`` the pools start poisoned and every allocated or emptied block is
poisoned again, so a read of an unwritten slot shows.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import torch

from pagedkv.cache import hugepages
from pagedkv.cache.allocator import BlockAllocator, as_int, as_token_ids
from pagedkv.cache.config import CacheConfig, blocks_needed, slots_for_positions
from pagedkv.errors import (ArgumentTypeError, DoubleFreeError, InvariantError, OutOfBlocksError, ShapeError,
                            UnknownBlockError)
from pagedkv.cache.prefix_hash import HashFn, check_cache_key, default_block_hash
from pagedkv.cache.sequence import SequenceState, check_seq_id
from pagedkv.cache.window import NULL_BLOCK, releasable_blocks, releasable_held_blocks


def allocate_pools(config: CacheConfig, num_pools: int) -> torch.Tensor:
    """``[num_pools, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` in ``config.cache_dtype``
    on ``config.device``, zero-filled or poisoned (``config.debug_poison``), one allocation; with
    ``kv_layout="HND"`` a view of head-major memory under the same NHD shape."""
    shape, poison = (num_pools, 2, config.num_blocks, *config.block_shape), config.poison_value
    hnd = config.kv_layout == "HND"
    memory = (*shape[:3], shape[4], shape[3], shape[5]) if hnd else shape
    # on a Linux CPU the pools sit on transparent huge pages: a fragmented table at small block sizes
    # reads a new 4 KiB page a row otherwise (pagedkv/cache/hugepages.py)
    kv = hugepages.zeros(memory, config.cache_dtype, config.device)
    if poison is not None:
        kv.fill_(poison)
    return kv.transpose(3, 4) if hnd else kv


class PagedKVCache:
    """K/V pools for ``config.num_layers`` layers and the sequences stored in them.

    Args:
        config: the geometry; pools are allocated on ``config.device``, zero-filled (or filled with
            ``config.debug_poison``), on transparent huge pages on a Linux CPU from 32 MiB
            (:func:`pagedkv.cache.hugepages.zeros`); ``config.window_left`` turns on sliding-window release.
        enable_prefix_caching: reuse full blocks of earlier prompts (vLLM's automatic prefix caching).
        hash_fn: the allocator's chained block hash (inject one to test collisions).

    Argument errors (every method; a failed call changes nothing): sequence ids must be ints
    (``ArgumentTypeError``, a ``TypeError``); an unknown id raises ``UnknownBlockError`` and a freed
    one ``DoubleFreeError`` (both ``ValueError``); token ids must be a sequence of ints or a 1-D
    integer tensor (``ArgumentTypeError``); counts must be ints ``>= 0`` (``ValueError`` when negative).

    Raises:
        ArgumentTypeError: ``config`` is not a :class:`CacheConfig`.
    """

    def __init__(self, config: CacheConfig, *, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = default_block_hash) -> None:
        if not isinstance(config, CacheConfig):
            raise ArgumentTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        windows = set(config.layer_windows)
        if len(windows) > 1:
            from pagedkv.errors import ArgumentValueError

            raise ArgumentValueError(f"config.layer_types {config.layer_types} mixes full and sliding layers: "
                                     "serve it with pagedkv.cache.hybrid.HybridKVCache (one KV-cache group per kind)")
        allocator = BlockAllocator(config.num_blocks, config.block_size,
                                   enable_prefix_caching=enable_prefix_caching, hash_fn=hash_fn)
        self._setup(config, allocator, allocate_pools(config, config.num_layers), windows.pop())

    @classmethod
    def group(cls, config: CacheConfig, allocator: BlockAllocator, kv: torch.Tensor, window_left: int | None,
              group_id: int) -> "PagedKVCache":
        """One KV-cache group of a hybrid cache (:class:`~pagedkv.cache.hybrid.HybridKVCache`): its block
        tables over a shared ``allocator`` and ``kv`` (``[group's layers, 2, num_blocks, *block_shape]``, a
        view of the shared pools), its layers attending through ``window_left``. Its prefix-cache entries
        live under namespaces of their own (:meth:`group_key`): a group's
        block never serves another group's lookup."""
        obj = cls.__new__(cls)
        obj._setup(config, allocator, kv, window_left)
        obj.group_id = group_id
        return obj

    def _setup(self, config: CacheConfig, allocator: BlockAllocator, kv: torch.Tensor,
               window_left: int | None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.allocator = allocator
        self.kv = kv
        self.group_id = None  # a KV-cache group of a hybrid cache: its index (group)
        self.window_left = window_left  # None: full attention, no block is released early
        self.num_window_released = 0  # table entries released by the sliding window, over the cache's life
        self.sequences: dict[int, SequenceState] = {}
        self._finished: set[int] = set()
        self.num_cow_copies = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache

    def group_key(self, cache_key: Hashable) -> Hashable:
        """The namespace this cache registers ``cache_key``'s blocks under: ``cache_key``, or in a group
        ``("pagedkv.kv_cache_group", group_id)`` followed by ``cache_key`` unless it is ``None``."""
        if self.group_id is None:
            return cache_key
        return ("pagedkv.kv_cache_group", self.group_id) + (() if cache_key is None else (cache_key,))

    # -- pools ------------------------------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        layer = as_int("layer", layer)
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer} outside [0, num_layers={self.config.num_layers})")
        return layer

    def _poison(self, blocks: Iterable[int], *, if_empty: bool = False) -> None:
        """Refill ``blocks`` with the debug poison in every layer (K and V); with ``if_empty`` only those
        now free and caching nothing (an evictable block keeps its K/V for a later prefix hit)."""
        poison = self.config.poison_value
        if poison is None:
            return
        a = self.allocator
        ids = [b for b in blocks if not if_empty or (a.ref_count(b) == 0 and not a.is_cached(b))]
        if ids:
            self.kv[:, :, torch.tensor(ids, dtype=torch.int64, device=self.kv.device)] = poison

    def k_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s K pool, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view).

        Raises:
            IndexError: ``layer`` outside ``[0, num_layers)``. ArgumentTypeError: not an int.
        """
        return self.kv[self._layer(layer), 0]

    def v_cache(self, layer: int = 0) -> torch.Tensor:
        """Layer ``layer``'s V pool, ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view).

        Raises:
            IndexError: ``layer`` outside ``[0, num_layers)``. ArgumentTypeError: not an int.
        """
        return self.kv[self._layer(layer), 1]

    # -- sequences --------------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> SequenceState:
        check_seq_id("seq_id", seq_id)
        try:
            return self.sequences[seq_id]
        except KeyError:
            if seq_id in self._finished:
                raise DoubleFreeError(f"sequence {seq_id} was already freed") from None
            raise UnknownBlockError(f"unknown sequence id {seq_id}") from None

    def add_sequence(self, seq_id: int, prompt_token_ids: Sequence[int] = (), *, cache_key: Hashable = None) -> int:
        """Start sequence ``seq_id``; reuse cached full blocks of its prompt written under ``cache_key``.

        At most ``len(prompt) - 1`` tokens are served from the cache, so the last prompt token is
        always computed (its logits are needed), as in vLLM.

        Args:
            seq_id: a new sequence id (an int).
            prompt_token_ids: the prompt (a sequence of ints or a 1-D integer tensor).
            cache_key: the prefix-cache namespace: ``None`` (the default one), a ``str``, an ``int`` or a
                tuple of them (a LoRA adapter id, a tenant's cache salt, multimodal extra keys), compared
                with their type (:func:`~pagedkv.cache.prefix_hash.check_cache_key`). It is part of each block's
                identity: equal tokens under two keys never share a block. Forks inherit it.

        Returns:
            The number of leading prompt tokens whose K/V is already cached (a multiple of
            ``block_size``); the caller then calls ``append(seq_id, prompt[cached:])``.

        Raises:
            ValueError: ``seq_id`` is live already.
            ArgumentTypeError: ``seq_id`` not an int, a token id not an int, or ``cache_key`` not a
                ``str``, an ``int`` or a tuple of them (a float, a bool, a list...).
        """
        check_seq_id("seq_id", seq_id)
        prompt_token_ids = as_token_ids("prompt_token_ids", prompt_token_ids)
        cache_key = check_cache_key("cache_key", cache_key)
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} already exists")
        cacheable = (max(len(prompt_token_ids) - 1, 0) // self.block_size) * self.block_size
        if self.window_left is None:
            skip, blocks = 0, self.allocator.find_cached_prefix(list(prompt_token_ids[:cacheable]), cache_key)
        else:  # only the window of the hit's end is needed, the head may be evicted (a sliding-window group's hit)
            skip, blocks = self.allocator.find_cached_window(prompt_token_ids[:cacheable], cache_key, self.window_left)
        # a hit's blocks before the first query's window are not taken at all (the last one is: the parent
        # of the next block to cache); the table holds -1 there, as if the window had released them
        return self.start_sequence(seq_id, prompt_token_ids, skip, blocks, cache_key)

    def start_sequence(self, seq_id: int, prompt_token_ids: list[int], skip: int, blocks: list[int],
                       cache_key: Hashable) -> int:
        """Start ``seq_id`` on a prefix hit found already: ``skip`` leading entries released (``-1``) and
        ``blocks`` (cached, a reference taken on each) after them; the hit is ``skip + len(blocks)``
        blocks. Arguments are checked by the caller (:meth:`add_sequence`, a hybrid cache's)."""
        cached = (skip + len(blocks)) * self.block_size
        self.allocator.acquire(blocks)
        table = [NULL_BLOCK] * skip + list(blocks)
        self.sequences[seq_id] = SequenceState(table, prompt_token_ids[:cached], cached, self.group_key(cache_key),
                                               skip)
        self.num_window_released += skip
        self._finished.discard(seq_id)
        self.num_cached_tokens += cached
        return cached

    def append(self, seq_id: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Reserve slots for ``token_ids`` after the sequence's current tokens.

        Allocates blocks as needed; when the last block is partially filled and shared (after a
        ``fork``), copies it first (copy-on-write, every layer's K and V) so the other owners never see
        these tokens. Nothing enters the prefix cache here: write the K/V at the returned slots, then
        call :meth:`mark_written`. With ``config.window_left``, the blocks wholly before the window of
        the first token not yet committed are released first (``-1`` in the table) and may serve this
        allocation: an append starts the next step, so the committed tokens' attention is done.

        Returns:
            ``int64 [len(token_ids)]`` slot_mapping on the cache's device, for ``write_kv``.

        Raises:
            OutOfBlocksError: not enough free blocks; nothing changes.
            UnknownBlockError / DoubleFreeError: unknown or freed ``seq_id``.
            ArgumentTypeError: a token id that is not an int; nothing changes.
        """
        seq = self._seq(seq_id)
        token_ids = as_token_ids("token_ids", token_ids)
        n, start, bs = len(token_ids), seq.num_tokens, self.block_size
        table = seq.block_table
        new_blocks, cow = self._blocks_for_append(seq, n)
        released = self._releasable(seq)
        if new_blocks + cow > self.allocator.num_free + sum(self.allocator.ref_count(b) == 1 for b in released):
            raise OutOfBlocksError(f"need {new_blocks + cow} blocks, only {self.allocator.num_free} free of "
                                   f"{self.allocator.num_blocks}")  # before any change
        self._release_outside_window(seq)  # the window's released blocks are free for this allocation
        blocks = self.allocator.allocate(new_blocks + cow)
        self._poison(blocks[int(cow):])  # debug: a block from the free list or evicted shows no old K/V
        if cow:
            old, table[-1] = table[-1], blocks.pop(0)
            self.kv[:, :, table[-1]] = self.kv[:, :, old]
            self.allocator.free(old)
            self.num_cow_copies += 1
        table.extend(blocks)
        seq.token_ids.extend(token_ids)
        first = start // bs  # only the table entries this append touches: a decode step costs O(1)
        positions = torch.arange(start - first * bs, start - first * bs + n, dtype=torch.int64)
        touched = torch.tensor(table[first: blocks_needed(start + n, bs)], dtype=torch.int64)
        return slots_for_positions(touched, positions, bs).to(self.config.device)

    def mark_written(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Commit: the K/V of the first ``num_tokens`` tokens of ``seq_id`` is written in every layer.

        Call it after the step's ``write_kv`` calls (every layer) have run without raising. The full
        blocks among those tokens enter the prefix cache (under the sequence's ``cache_key``); a block
        whose tokens were reserved by :meth:`append` but not committed is never served to another
        prompt, and is simply freed with its sequence (preemption, abort, a write that raised).
        Committing fewer tokens than were reserved (a partial write of a chunk) caches only the
        blocks those tokens fill. Committing a count at or below the current one changes nothing.

        Args:
            seq_id: a live sequence.
            num_tokens: leading tokens now written, ``0 <= num_tokens <= seq_len(seq_id)``
                (default: every token appended so far).

        Returns:
            The number of blocks that entered the prefix cache.

        Raises:
            ShapeError (a ``ValueError``): ``num_tokens`` negative or past the tokens appended.
            ArgumentTypeError: ``num_tokens`` or ``seq_id`` not an int. UnknownBlockError /
            DoubleFreeError: unknown or freed ``seq_id``.
        """
        seq = self._seq(seq_id)
        n = seq.num_tokens if num_tokens is None else as_int("num_tokens", num_tokens)
        if not 0 <= n <= seq.num_tokens:
            raise ShapeError(f"num_tokens must be in [0, {seq.num_tokens}] (the tokens appended to sequence "
                             f"{seq_id}), got {n}")
        if n <= seq.num_written:
            return 0
        bs, table, added = self.block_size, seq.block_table, 0
        for i in range(seq.num_written // bs, n // bs):  # blocks completed by this commit
            if i and table[i - 1] == NULL_BLOCK:  # its parent was released: no lookup could reach it
                continue
            added += self.allocator.cache_full_block(table[i], seq.token_ids[i * bs: (i + 1) * bs],
                                                     table[i - 1] if i else None, cache_key=seq.cache_key)
        seq.num_written = n
        return added

    def _releasable(self, seq: SequenceState) -> list[int]:
        return releasable_held_blocks(self, seq)

    def _release_outside_window(self, seq: SequenceState) -> None:
        released = self._releasable(seq)
        if released:  # the entries become -1; each block loses this table's reference, the last first
            self.allocator.free_all(released)
            self._poison(released, if_empty=True)
            n = seq.num_released + len(released)
            seq.block_table[seq.num_released:n] = [NULL_BLOCK] * len(released)
            self.num_window_released += len(released)
            seq.num_released = n

    def first_held_position(self, seq_id: int) -> int:
        """The first position of ``seq_id`` whose block the sequence still holds: ``0`` without a window;
        positions before it were released by the window (their table entries are ``-1``), so a read of
        the sequence (``gather``) starts here: ``gather(pool, table[p // block_size:], seq_len - p)``."""
        return self._seq(seq_id).num_released * self.block_size

    def num_written(self, seq_id: int) -> int:
        """Leading tokens of ``seq_id`` whose K/V is committed (``mark_written``) or was served by the prefix cache."""
        return self._seq(seq_id).num_written

    def cache_key(self, seq_id: int) -> Hashable:
        """The prefix-cache namespace of ``seq_id`` (``None``: the default one)."""
        key = self._seq(seq_id).cache_key
        return key if self.group_id is None else (key[2] if len(key) == 3 else None)

    def slot_mapping(self, seq_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``int64 [end - start]`` slots of positions ``start .. end - 1`` of ``seq_id``, on the cache's device.

        The slots a write of reserved tokens must use *now*: after a copy-on-write the slots
        :meth:`append` returned earlier for a shared partial block may belong to another sequence.

        Raises:
            ShapeError: not ``0 <= start <= end <= seq_len(seq_id)``, or ``start`` in a block the
            sliding window released (before :meth:`first_held_position`). ArgumentTypeError: not ints.
        """
        seq = self._seq(seq_id)
        start = as_int("start", start)
        end = seq.num_tokens if end is None else as_int("end", end)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ShapeError(f"start, end must satisfy 0 <= start <= end <= {seq.num_tokens} (sequence {seq_id}), "
                             f"got start={start}, end={end}")
        bs = self.block_size
        if start < end and start < seq.num_released * bs:
            raise ShapeError(f"start {start} of sequence {seq_id} lies in a block the sliding window released "
                             f"(positions before {seq.num_released * bs})")
        first = start // bs
        positions = torch.arange(start - first * bs, end - first * bs, dtype=torch.int64)
        touched = torch.tensor(seq.block_table[first: blocks_needed(end, bs)], dtype=torch.int64)
        return slots_for_positions(touched, positions, bs).to(self.config.device)

    def _blocks_for_append(self, seq: SequenceState, n: int) -> tuple[int, bool]:
        """``(new blocks, copy-on-write?)`` an append of ``n`` tokens needs: a partially filled last
        block that another table shares must be copied before it is written."""
        cow = n > 0 and seq.num_tokens % self.block_size != 0 and self.allocator.ref_count(seq.block_table[-1]) > 1
        return blocks_needed(seq.num_tokens + n, self.block_size) - len(seq.block_table), cow

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share every block (and token) of ``parent_id``; no K/V is copied.

        The child inherits the parent's ``cache_key`` and committed count: tokens the parent reserved
        but has not committed are the child's to write too (through :meth:`slot_mapping`).

        Raises:
            ValueError: ``child_id`` is live. UnknownBlockError / DoubleFreeError: bad ``parent_id``.
            ArgumentTypeError: an id that is not an int.
        """
        parent = self._seq(parent_id)
        check_seq_id("child_id", child_id)
        if child_id in self.sequences:
            raise ValueError(f"sequence {child_id} already exists")
        for block in parent.held_blocks:
            self.allocator.incref(block)
        self.sequences[child_id] = SequenceState(list(parent.block_table), list(parent.token_ids), parent.num_written,
                                                 parent.cache_key, parent.num_released)
        self._finished.discard(child_id)

    def free(self, seq_id: int) -> None:
        """Release a finished, preempted or aborted sequence's blocks; shared blocks stay with their other owners.

        Released blocks that cache a prefix become evictable (the deepest first); blocks never
        committed by :meth:`mark_written` become free and cache nothing.

        Raises:
            DoubleFreeError: the sequence was freed already. UnknownBlockError: never existed.
        """
        seq = self._seq(seq_id)
        held = seq.held_blocks
        self.allocator.free_all(held)
        self._poison(held, if_empty=True)
        del self.sequences[seq_id]
        self._finished.add(seq_id)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether ``append(seq_id, <num_tokens tokens>)`` would find enough blocks.

        Raises:
            ValueError: ``num_tokens < 0``. ArgumentTypeError: not an int. UnknownBlockError /
            DoubleFreeError: bad ``seq_id``.
        """
        seq = self._seq(seq_id)
        num_tokens = as_int("num_tokens", num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        new_blocks, cow = self._blocks_for_append(seq, num_tokens)
        released = sum(self.allocator.ref_count(b) == 1 for b in self._releasable(seq))  # free once released
        return new_blocks + cow <= self.allocator.num_free + released

    # -- metadata for the ops ---------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        """Tokens stored for ``seq_id``."""
        return self._seq(seq_id).num_tokens

    def block_table(self, seq_id: int) -> torch.Tensor:
        """``int32 [num_blocks_of_seq]`` block table of one sequence, on the cache's device (``-1`` in the
        leading entries the sliding window released)."""
        return torch.tensor(self._seq(seq_id).block_table, dtype=torch.int32, device=self.config.device)

    def block_tables(self, seq_ids: Iterable[int], pad: int = -1, width: int | None = None) -> torch.Tensor:
        """``int32 [batch, width]`` block tables, ``pad``-filled (``width`` defaults to the longest table).

        Raises:
            ShapeError: ``width`` shorter than the longest table. ArgumentTypeError: ``pad`` or
            ``width`` not an int. UnknownBlockError / DoubleFreeError: a bad sequence id.
        """
        tables = [self._seq(s).block_table for s in seq_ids]
        pad = as_int("pad", pad)
        longest = max((len(t) for t in tables), default=0)
        width = longest if width is None else as_int("width", width)
        if width < longest:
            raise ShapeError(f"width {width} is shorter than the longest block table ({longest} entries)")
        out = torch.full((len(tables), width), pad, dtype=torch.int32)
        for row, table in enumerate(tables):
            out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        return out.to(self.config.device)

    def seq_lens(self, seq_ids: Iterable[int]) -> torch.Tensor:
        """``int32 [batch]`` stored lengths."""
        return torch.tensor([self._seq(s).num_tokens for s in seq_ids], dtype=torch.int32, device=self.config.device)

    # -- reports ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Blocks used / shared / free / cached, prefix-cache hit rate, copy-on-write copies, evictions, and the
        table entries the sliding window released (``window_released``: over the cache's life;
        ``window_released_live``: in the live tables now, the blocks those tables would otherwise hold)."""
        a = self.allocator
        shared = a.num_shared
        return {
            "num_blocks": a.num_blocks, "used": a.num_used, "shared": shared, "free": a.num_free,
            "cached": a.num_cached, "prefix_hit_rate": a.prefix_hits / a.prefix_queries if a.prefix_queries else 0.0,
            "cached_tokens": self.num_cached_tokens, "cow_copies": self.num_cow_copies, "evictions": a.num_evictions,
            "live_sequences": len(self.sequences), "window_released": self.num_window_released,
            "window_released_live": sum(q.num_released for q in self.sequences.values()),
        }

    def reference_counts(self) -> dict[int, int]:
        """``{block: number of live block tables holding it}`` (what the allocator's counts must equal)."""
        refs: dict[int, int] = {}
        for seq in self.sequences.values():
            for block in seq.held_blocks:
                refs[block] = refs.get(block, 0) + 1
        return refs

    def check_invariants(self) -> None:
        """:class:`~pagedkv.errors.InvariantError` (an ``AssertionError``) unless the allocator's counts match
        the live tables, every table fits its tokens, no sequence commits more tokens than it holds, and
        the ``-1`` entries are exactly the released leading ones, none of them a later query can read."""
        self.allocator.check_invariants(self.reference_counts())
        self.check_tables()

    def check_tables(self) -> None:
        """The per-sequence half of :meth:`check_invariants` (a hybrid cache checks the shared allocator
        against every group's tables once): tables fit their tokens, commits their tables, ``-1`` entries
        exactly the released leading ones, none a later query reads."""
        for seq_id, seq in self.sequences.items():
            if len(seq.block_table) != blocks_needed(seq.num_tokens, self.block_size):
                raise InvariantError(f"sequence {seq_id}: {len(seq.block_table)} blocks for {seq.num_tokens} tokens")
            if not 0 <= seq.num_written <= seq.num_tokens:
                raise InvariantError(f"sequence {seq_id}: {seq.num_written} tokens committed of {seq.num_tokens}")
            released, held = seq.block_table[:seq.num_released], seq.held_blocks
            if any(b != NULL_BLOCK for b in released) or any(b < 0 for b in held):
                raise InvariantError(f"sequence {seq_id}: table {seq.block_table} should hold -1 in exactly its first "
                                     f"{seq.num_released} entries (released by the sliding window)")
            if seq.num_released > releasable_blocks(seq.num_written, self.window_left, self.block_size):
                raise InvariantError(f"sequence {seq_id}: {seq.num_released} blocks released, but a later query "
                                     f"reads from position {seq.num_written - (self.window_left or 0)}")
