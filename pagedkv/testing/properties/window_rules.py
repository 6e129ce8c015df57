"""The sliding-window rules the shadow model (:class:`.cache_model.CacheModel`) and the window tests check.

A cache built with ``CacheConfig(window_left=W)`` releases, at an append or a prefix hit, the leading
blocks no later query reads (:mod:`pagedkv.cache.window`). :func:`check_windowed_sequence` is what must hold
for each live sequence after every step, and :func:`check_cached_blocks` what must hold for the prefix
cache, released blocks included (:class:`WindowMachine` in ``tests/library/test_sliding_window.py`` drives a
cache through adds with prefix hits under namespaces, appends written whole, in part or not at all,
forks and frees, and runs both after every rule).

:class:`.cache_model.CacheModel` adopts them (items 2-4; items 1 and 5 are what a machine driving it
does, as ``WindowMachine`` does):

1. ``start`` draws ``window_left`` from ``None`` or ``0 .. 9`` and builds the config with
   ``dataclasses.replace(config, window_left=window_left, debug_poison="nan")``;
2. ``CacheModel.reserve``: the append may first release entries ``r0 .. r1 - 1`` (``r = first_held_position
   // block_size`` before and after); every other entry is unchanged (but a copied shared partial last
   block), those in ``r0 .. r1 - 1`` become ``-1``, and ``r1 <= releasable_blocks(written, window_left,
   block_size)``; the released blocks it held alone that cache a prefix join the eviction queue, last
   first (as a ``free`` queues them); the slots handed out lie in no block another table holds;
3. ``CacheModel.add``: the hit's entries are ``-1`` exactly before ``first_held_position`` (at most
   ``releasable_blocks(cached, window_left, block_size, keep_last_full=True)`` of them) and take no
   reference (the evictable queue keeps them in place); the prefix checks apply to every hit block;
4. ``CacheModel.free`` and every ``ref_count`` / table walk of the model and the machine skip ``-1``
   entries; reads start at ``first_held_position``; a re-add claims a hit on a sequence's committed
   blocks only when the window released none of its entries (a released block may be evicted);
5. the invariant calls :func:`check_windowed_sequence` for every live sequence; ``CacheModel.check``
   checks every cached block as :func:`check_cached_blocks` does (and that a lookup reaches it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from pagedkv.testing.compare import bits
from pagedkv.cache.window import NULL_BLOCK

#: ``kv_of(tokens, start, end, layer, cache_key) -> (k, v)``: the K/V written for positions ``start .. end - 1``.
KVOf = Callable[[Sequence[int], int, int, int, Hashable], "tuple[torch.Tensor, torch.Tensor]"]


def check_windowed_sequence(cache, seq_id: int, tokens: Sequence[int], written: int, cache_key: Hashable,
                            kv_of: KVOf, gather: Callable) -> None:
    """One live sequence of a windowed cache: its table, its released entries and its reads.

    - the table has ``ceil(len(tokens) / block_size)`` entries: ``-1`` exactly in the first
      ``first_held_position // block_size`` ones, real blocks after;
    - nothing a later query reads is released: ``first_held_position <= max(0, written - window_left)``
      (the next query sits at ``written`` or later);
    - in every layer, a ``gather`` from the first held block reads, bit for bit, the K/V written for
      the sequence's own committed tokens (under its namespace): sharing, copy-on-write, prefix hits
      and releases never hand it another sequence's (or a poisoned) slot;
    - a ``gather`` over a released entry is refused (``IndexError``), never read.

    Raises:
        AssertionError: naming the sequence, the check and the position.
    """
    bs, window = cache.block_size, cache.window_left
    table = cache.block_table(seq_id).tolist()
    first = cache.first_held_position(seq_id)
    released = first // bs
    assert first % bs == 0, f"sequence {seq_id}: first held position {first} is not a block boundary"
    assert len(table) == -(-len(tokens) // bs), f"sequence {seq_id}: {len(table)} entries for {len(tokens)} tokens"
    assert all(b == NULL_BLOCK for b in table[:released]) and all(b >= 0 for b in table[released:]), \
        f"sequence {seq_id}: table {table} should hold -1 in exactly its first {released} entries"
    assert window is not None or released == 0, f"sequence {seq_id}: released {released} blocks without a window"
    if window is not None:
        assert first <= max(0, written - window), \
            f"sequence {seq_id}: released positions up to {first - 1}, its next query (at {written}) reads from " \
            f"{max(0, written - window)}"
    if written <= first:
        return
    held = torch.tensor(table[released:], dtype=torch.int64)
    for layer in range(cache.config.num_layers):
        k, v = kv_of(tokens, first, written, layer, cache_key)
        for pool, exp, name in ((cache.k_cache(layer), k, "K"), (cache.v_cache(layer), v, "V")):
            got = gather(pool, held.to(pool.device), written - first).cpu()
            same = got.shape == exp.shape and torch.equal(bits(got), bits(exp))
            assert same, f"sequence {seq_id} reads a wrong {name} in layer {layer} inside its window " \
                         f"(positions {first} .. {written - 1}, table {table})"
    if released:
        try:
            gather(cache.k_cache(0), torch.tensor(table, dtype=torch.int64), written)
        except IndexError:
            pass
        else:
            raise AssertionError(f"sequence {seq_id}: a gather over its released entries {table[:released]} "
                                 "was not refused")


def check_cached_blocks(cache, written_prefixes: set, kv_of: KVOf) -> None:
    """Every block the prefix cache can serve (its parent chain intact) caches a prefix written and
    committed under its namespace and stores that prefix's K/V in every layer: a block released by the
    window keeps its entry and its K/V (the poison refills only blocks that cache nothing).

    Raises:
        AssertionError: naming the block.
    """
    bs = cache.block_size
    for block, entry in cache.allocator.cached_entries().items():
        prefix = cache.allocator.cached_prefix(block)
        if prefix is None:
            continue  # a parent was evicted: no lookup reaches this block
        assert (entry.cache_key, prefix) in written_prefixes, \
            f"block {block} caches a prefix of {len(prefix)} tokens that was never written"
        for layer in range(cache.config.num_layers):
            k, v = kv_of(prefix, len(prefix) - bs, len(prefix), layer, entry.cache_key)
            assert torch.equal(bits(cache.k_cache(layer)[block].cpu()), bits(k)) and \
                torch.equal(bits(cache.v_cache(layer)[block].cpu()), bits(v)), \
                f"cached block {block} (depth {entry.depth}) does not hold the K/V of its prefix in layer {layer}"
