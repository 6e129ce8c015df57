"""The model of vLLM's hybrid prefix-cache lookup and retention over what the machine knows is cached.

vLLM 0.32's ``HybridKVCacheCoordinator`` agrees on one hit for groups of full attention and sliding windows by a
fixed-point loop over their finders, with EAGLE's last-block drop redone wherever a group shrinks the candidate;
its ``SlidingWindowManager.reachable_block_mask`` decides which window blocks a request caches (every block a hit
at an aligned boundary reads; under sparse retention only those at the replay boundaries and a shared-prefix
junction). These functions restate those rules on plain predicates, so that the machine's hit promise is the hit
vLLM finds (a lower bound and an upper one) wherever the machine knows every cached block.

Units: token counts and block indices (block ``i`` of a group of block size ``bs`` holds tokens
``i * bs .. (i + 1) * bs - 1``); ``cached(group, end)`` says whether the group's block ending at token ``end``
(exclusive) is cached for the request looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.testing.managers.protocol import GroupSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def replay_boundaries(num_prompt: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """Token positions a later request replaying a prompt of ``num_prompt`` tokens resumes at (vLLM's
    ``kv_cache_coordinator.replay_boundaries``): ``num_prompt - 1`` (a resend computes its last token); under
    EAGLE the resend's and a longer sibling's aligned hits, each one ``scheduler_block_size`` back (the block
    above is matched and dropped).

    Raises:
        ValueError: ``num_prompt`` below 0 or ``scheduler_block_size`` below 1.
    """
    if num_prompt < 0:
        raise ValueError(f"num_prompt {num_prompt}: expected >= 0")
    if scheduler_block_size < 1:
        raise ValueError(f"scheduler_block_size {scheduler_block_size}: expected >= 1")
    if not eagle:
        return (num_prompt - 1,)
    block = scheduler_block_size
    resend = (num_prompt - 1) // block * block
    extension = num_prompt // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def window_need(window: int, block_size: int, eagle: bool) -> int:
    """Contiguous cached blocks a sliding window's hit needs (vLLM's
    ``SlidingWindowManager._contiguous_blocks_for_hit``): ``cdiv(sliding_window - 1, block_size)``, one more under
    EAGLE (the block past the hit, matched and dropped). ``window`` is ``window_left`` (``sliding_window - 1``)."""
    return _cdiv(window, block_size) + (1 if eagle else 0)


def window_blocks_kept(num_blocks: int, block_size: int, window: int, alignment: int, eagle: bool,
                       retention: int | None, boundaries: Sequence[int]) -> set[int]:
    """The blocks of ``0..num_blocks`` a sliding-window group caches (vLLM's
    ``SlidingWindowManager.reachable_block_mask``): where ``alignment`` (the hit alignment, tokens) is not whole
    blocks, every block; else the ``need``-block tail (:func:`window_need`) of each segment, shifted one block up
    under EAGLE (the matched run's right edge is the block past the boundary), where a segment is ``alignment``
    tokens (``retention`` ``None``: dense) or ``retention`` tokens (positive), every block where a segment is no
    longer than ``need``; under sparse retention (``retention`` not ``None``) also the tail ending at each of
    ``boundaries`` (token positions, rounded down to ``alignment``: :func:`replay_boundaries` and the request's
    shared-prefix junction).

    Raises:
        ValueError: ``block_size`` or ``alignment`` below 1, ``retention`` negative.
    """
    if block_size < 1 or alignment < 1:
        raise ValueError(f"block_size {block_size}, alignment {alignment}: expected >= 1")
    if retention is not None and retention < 0:
        raise ValueError(f"retention {retention}: expected None or >= 0")
    every = set(range(num_blocks))
    if alignment % block_size:
        return every
    need, shift = window_need(window, block_size, eagle), 1 if eagle else 0
    segment = alignment if retention is None else retention or None
    kept: set[int] = set()
    if segment is not None:
        per_segment = segment // block_size
        if need >= per_segment:
            return every
        kept = {i for i in every if i >= shift and (i - shift) % per_segment >= per_segment - need}
    if retention is not None:
        for boundary in boundaries:
            end = boundary // alignment * alignment // block_size + shift
            kept |= set(range(max(0, end - need), min(num_blocks, end)))
    return kept


def cacheable_tokens(num_tokens: int, block_size: int, alignment: int, eagle: bool) -> int:
    """Tokens of a request with ``num_tokens`` computed whose full blocks a group caches (vLLM's
    ``HybridKVCacheCoordinator.get_num_cacheable_tokens``): ``num_tokens`` rounded down to ``alignment``, under
    EAGLE one block of the group (``block_size``) more where that is positive (the block a hit there matches
    and drops)."""
    aligned = num_tokens // alignment * alignment
    return min(num_tokens, aligned + block_size) if eagle and aligned > 0 else aligned


def prefill_checkpoint(start: int, end: int, unit: int, block_size: int, eagle: bool, prefill_end: int = 0) -> int:
    """Where a prefill chunk computing tokens ``start..end - 1`` exports the Mamba state of a group of Mamba2 layers
    (``GroupSpec.prefill_checkpoints``, block size ``block_size``, prefix-match unit ``unit``): the position ``c``
    whose state (after token ``c - 1``) it writes from inside the chunk, or 0 for none. vLLM 0.32's rule
    (``get_mamba_prefill_checkpoint_position`` and ``is_mamba_prefill_checkpoint_valid``, checkpoint alignment 1,
    as ``MambaManager._needs_internal_checkpoint`` applies them): ``c`` is the last unit boundary below ``end``
    (under EAGLE one unit lower still), exported where the chunk starts on a unit boundary, ``c`` lies at least a
    unit past ``start`` and inside the chunk, the block holding token ``c - 1`` is past the one holding the state
    the chunk starts from, and the chunk reaches ``prefill_end`` (sparse retention: the prompt's end; else 0)."""
    c = max((end if eagle else end - 1) // unit * unit - (unit if eagle else 0), 0)
    # vLLM's checkpoint column; past the column of the state the chunk starts from (-1 at 0), so never negative
    checkpoint_block = _cdiv(end, block_size) - 2
    valid = (start % unit == 0 and start + unit <= c < end and checkpoint_block > (start - 1) // block_size
             and end >= prefill_end)
    return c if valid else 0


def _full_hit(cached: Callable[[int], bool], block_size: int, max_length: int, alignment: int, drop: bool) -> int:
    """``FullAttentionManager.find_longest_cache_hit`` (no fine-grained hash hits): the leading run of cached
    blocks within ``max_length``; with ``drop``, one block less; rounded down to ``alignment``."""
    blocks = 0
    while blocks < max_length // block_size and cached((blocks + 1) * block_size):
        blocks += 1
    hit = blocks * block_size
    if drop and hit:
        hit -= min(alignment, block_size)
    return hit - hit % alignment


def _window_hit(cached: Callable[[int], bool], block_size: int, window: int, max_length: int, alignment: int,
                drop: bool) -> int:
    """``SlidingWindowManager.find_longest_cache_hit``: right to left, the first run of ``need`` contiguous cached
    blocks whose right edge (less the dropped block with ``drop``) is aligned, else the run from block 0 rounded
    down to alignment; with ``drop`` its last block popped and the hit re-aligned."""
    need = window_need(window, block_size, drop)
    run, blocks = 0, None
    for i in range(max_length // block_size - 1, -1, -1):
        if not cached((i + 1) * block_size):
            run = 0
            continue
        if run == 0 and block_size != alignment and ((i if drop else i + 1) * block_size) % alignment:
            continue
        run += 1
        if run >= need:
            blocks = i + run
            break
    if blocks is None:
        blocks = run
        while blocks * block_size % alignment:
            blocks -= 1
    if drop and blocks:
        blocks -= 1
        while blocks * block_size % alignment:
            blocks -= 1
    return blocks * block_size


def coordinated_hit(groups: Sequence[GroupSpec], cached: Callable[[int, int], bool], max_length: int,
                    hash_limit: int, alignment: int, eagle: bool) -> tuple[int, int]:
    """``(hit, longest)``: the hit vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` agrees on for
    ``groups`` (full attention and sliding windows only) and the longest single group's hit on the way (its
    ``longest_hit_length``: ``get_computed_blocks`` pins ``longest`` as the shared-prefix junction where it runs
    past ``hit``).

    Groups of one spec are looked up together (a block hits where every one of them caches it), full attention
    first; each group either accepts the candidate or shrinks it, until no group shrinks it (one pass where one
    full-attention spec and one other are all). Under ``eagle`` a group not yet verified at the candidate looks one
    block past it (capped at ``hash_limit``, the prompt's whole hash blocks) and drops a block; a verified group
    looks up without the drop, and where it shrinks the candidate every group's drop is redone
    (``eagle_verified.clear()``). A full-attention group is looked up once and then only caps the candidate.

    Args:
        groups: the layout's groups (kinds ``"full"`` and ``"sliding_window"``).
        cached: ``cached(g, end)``: group ``g``'s block ending at token ``end`` is cached for this request.
        max_length: the longest hit (the prompt less the tokens a hit leaves to compute).
        hash_limit: tokens of the prompt's whole hash blocks.
        alignment: the hit alignment in tokens (the scheduler block size).
        eagle: EAGLE's last-block drop is on (every group an EAGLE group).

    Raises:
        ValueError: a group kind other than ``"full"`` or ``"sliding_window"``.
    """
    specs: dict[tuple, list[int]] = {}
    for g, group in enumerate(groups):
        if group.kind not in ("full", "sliding_window"):
            raise ValueError(f"groups: group {g} is {group.kind!r}; the model covers full and sliding_window")
        specs.setdefault((group.kind, group.block_size, group.window), []).append(g)
    order = sorted(specs.items(), key=lambda item: item[0][0] != "full")
    simple = len(order) == 2 and order[0][0][0] == "full"
    hit_length, longest, verified, full_hits = max_length, 0, set(), {}
    while True:
        curr = hit_length
        for idx, ((kind, bs, window), ids) in enumerate(order):
            if kind == "full" and idx in full_hits:
                curr = min(curr, full_hits[idx])
                continue
            drop = eagle and idx not in verified
            limit = min(curr + bs, hash_limit) if drop else curr
            hits = lambda end, ids=ids: all(cached(g, end) for g in ids)  # noqa: E731
            new = (_full_hit(hits, bs, limit, alignment, drop) if kind == "full" else
                   _window_hit(hits, bs, window, limit, alignment, drop))
            if drop:
                verified.add(idx)
            elif new < curr:
                verified.clear()
            curr = new
            if kind == "full":
                full_hits[idx] = new
            longest = max(longest, curr)
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    return hit_length, longest
