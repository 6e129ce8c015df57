"""Sliding-window block release: which leading blocks of a sequence no later query can read.

After vLLM v1's ``SlidingWindowManager.remove_skipped_blocks``: with every layer attending through
a window (``window_left``: a query at position ``p`` reads keys ``p - window_left .. p``), once the
first ``n`` tokens of a sequence are computed, every later query sits at a position ``>= n`` and
reads nothing before ``n - window_left``; the blocks wholly before that position are released and
their table entries set to :data:`NULL_BLOCK`.

The cache calls :func:`releasable_blocks` with the sequence's *committed* count (``num_written``):
tokens reserved but not yet committed may still be queried (their forward pass is this step's, or a
partial write's rest), and they sit at positions ``>= num_written``.
"""

from __future__ import annotations

#: Table entry of a released block. ``-1`` rather than a reserved "null" block of the pool (vLLM
#: keeps block 0 as its null block): ``-1`` is already the table padding of the backend contract, so
#: a table needs no pool block set aside and every block stays usable; and a read of a released entry
#: is refused by the ``"full"`` validation (``BlockIndexError``) instead of silently reading a real
#: block's data (a null block holds whatever was last written there).
NULL_BLOCK = -1


def first_readable_position(num_computed: int, window_left: int | None) -> int:
    """The first position a query at a position ``>= num_computed`` can read (``0`` without a window)."""
    if window_left is None or window_left < 0:
        return 0
    return max(0, num_computed - window_left)


def releasable_blocks(num_computed: int, window_left: int | None, block_size: int, *,
                      keep_last_full: bool = False) -> int:
    """How many leading table entries of a sequence no later query can read.

    Args:
        num_computed: leading tokens whose K/V is computed and committed.
        window_left: the window of every layer (``None`` or ``-1``: full attention, nothing is released).
        block_size: tokens per block.
        keep_last_full: keep the last full block (``num_computed // block_size - 1``) however old: the
            prefix cache registers the next full block with this one as its parent (a chained hash
            needs the parent block), so while it caches a prefix it must stay in the table.

    Returns:
        ``floor(max(0, num_computed - window_left) / block_size)``, lowered by ``keep_last_full``: the
        blocks wholly before :func:`first_readable_position`.
    """
    n = first_readable_position(num_computed, window_left) // block_size
    if keep_last_full:
        n = min(n, max(num_computed // block_size - 1, 0))
    return n


def releasable_held_blocks(cache, seq) -> list[int]:
    """The blocks ``seq`` (a :class:`~pagedkv.cache.paged_cache.SequenceState` of ``cache``) holds and no later query
    reads: ``[]`` without ``cache.window_left``.

    A later query sits at a position ``>= seq.num_written``: the committed tokens are computed and
    their attention done (the cache releases at the next append, the start of the next step, as vLLM's
    ``allocate_slots`` calls ``remove_skipped_blocks``), so it reads nothing before
    ``num_written - window_left``. The last full block stays while it caches a prefix: the next full
    block is registered with it as its parent. Released, each block loses the table's reference (the
    last one first, deepest evicted first); a block shared with another table or caching a prefix
    stays with them (used, or evictable).
    """
    if cache.window_left is None:
        return []
    bs, table = cache.block_size, seq.block_table
    last_full = seq.num_written // bs - 1
    keep = last_full >= 0 and table[last_full] != NULL_BLOCK and cache.allocator.is_cached(table[last_full])
    return table[seq.num_released:releasable_blocks(seq.num_written, cache.window_left, bs, keep_last_full=keep)]
