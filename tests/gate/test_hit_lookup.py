"""The model of vLLM's hybrid prefix-cache lookup and retention (pagedkv.testing.managers.lookup) on hand-worked
cache states: the hits below are derived by hand from vLLM 0.32's ``HybridKVCacheCoordinator``,
``FullAttentionManager`` / ``SlidingWindowManager.find_longest_cache_hit`` and ``reachable_block_mask``."""

from __future__ import annotations

import pytest

from pagedkv.testing.managers import lookup
from pagedkv.testing.managers.protocol import GroupSpec


def _cached(*blocks_by_group: set[int], block_sizes=None):
    """``cached(g, end)`` over block indices per group (``block_sizes``: 1 each unless given)."""
    sizes = block_sizes or [1] * len(blocks_by_group)
    return lambda g, end: end % sizes[g] == 0 and end // sizes[g] - 1 in blocks_by_group[g]


def test_a_shrunk_candidate_redoes_every_eagle_drop():
    """Full attention and two windows (1 and 2 tokens) at block size 1 under EAGLE, a 10-token prompt. Pass 1
    drops a block in each group: 9, 9, then 7 (window 2 holds blocks 5..7). Pass 2: window 1, verified, looks up
    without the drop at 7 and finds only block 4 (hit 5): the candidate shrank, so window 2's drop is redone at 5
    (blocks 3..5 with 4 missing; 1..3: hit 3) and window 1's at 3. The hit is 3; with window 2's verification kept
    it would look up 5 without the drop and keep 4 (blocks 2, 3)."""
    groups = (GroupSpec("full", 1), GroupSpec("sliding_window", 1, window=1), GroupSpec("sliding_window", 1, window=2))
    cached = _cached(set(range(10)), {0, 1, 2, 3, 4, 8, 9}, {0, 1, 2, 3, 5, 6, 7})
    assert lookup.coordinated_hit(groups, cached, 9, 10, 1, eagle=True) == (3, 9)
    stale = lookup._window_hit(lambda end: cached(2, end), 1, 2, 5, 1, drop=False)
    assert stale == 4


def test_an_eagle_pop_is_realigned_to_the_common_multiple():
    """A window of block size 1 beside full attention of block size 2 (hits in steps of 2) under EAGLE: a
    3-token window needs 4 blocks with the dropped one; only blocks 0..2 are cached, so the run from block 0 is
    rounded to 2 blocks, popped to 1 and rounded again to 0: no hit, though full attention's would be 2."""
    groups = (GroupSpec("full", 2), GroupSpec("sliding_window", 1, window=3))
    cached = _cached({0, 1}, {0, 1, 2}, block_sizes=[2, 1])
    assert lookup.coordinated_hit(groups, cached, 4, 5, 2, eagle=True) == (0, 2)
    assert lookup.coordinated_hit(groups, cached, 4, 5, 2, eagle=False) == (2, 4)


def test_sparse_retention_under_eagle_keeps_the_block_above_each_boundary():
    """vLLM's default retention (interval 0) under EAGLE, a 4-token prompt at block size 2, window 2 (one block a
    hit reads, two with the dropped one): the replay boundaries are 0 and 2 (the resend's and the extension's
    aligned hits less a block), each kept with the block above it: blocks 0 and 1, so a resend hits 2. Without
    EAGLE only the block before the replay boundary 3 (rounded to 2) is kept: block 0."""
    assert lookup.replay_boundaries(4, 2, eagle=True) == (0, 2)
    assert lookup.window_blocks_kept(2, 2, 2, 2, True, 0, lookup.replay_boundaries(4, 2, True)) == {0, 1}
    assert lookup.window_blocks_kept(2, 2, 2, 2, False, 0, lookup.replay_boundaries(4, 2, False)) == {0}
    assert lookup.cacheable_tokens(4, 2, 2, eagle=True) == 4
    assert lookup.cacheable_tokens(5, 1, 2, eagle=True) == 5  # one window block past the aligned 4
    assert lookup.cacheable_tokens(5, 1, 2, eagle=False) == 4


@pytest.mark.parametrize(("start", "end", "unit", "block_size", "eagle", "prefill_end", "position"), [
    (0, 4, 2, 2, False, 0, 2),    # a first chunk of two blocks: one block before its end
    (4, 8, 2, 2, True, 0, 6),     # EAGLE: the last unit boundary (8) less a unit
    (4, 8, 2, 2, False, 0, 6),    # without: the last boundary below the end, 7 // 2 * 2
    (4, 6, 2, 2, False, 0, 0),    # a one-block chunk: the checkpoint would be the state it starts from
    (3, 8, 1, 1, False, 0, 7),    # unit 1: the token before the end
    (5, 9, 2, 2, False, 0, 0),    # a chunk starting inside a unit exports nothing
    (4, 10, 2, 2, False, 11, 0),  # sparse retention: only the chunk reaching the prefill's end exports
    (4, 11, 2, 2, False, 11, 10),
    (0, 16, 2, 8, False, 0, 14),  # a unit finer than the Mamba block: the last unit boundary below the end
])
def test_a_prefill_chunk_exports_its_checkpoint_where_vllms_rule_says(start, end, unit, block_size, eagle,
                                                                      prefill_end, position):
    """Chunks worked by hand from vLLM 0.32's ``get_mamba_prefill_checkpoint_position`` and
    ``is_mamba_prefill_checkpoint_valid`` (checkpoint alignment 1): where the chunk exports, or 0."""
    assert lookup.prefill_checkpoint(start, end, unit, block_size, eagle, prefill_end) == position


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="groups"):
        lookup.coordinated_hit((GroupSpec("mamba", 1),), lambda g, end: True, 3, 4, 1, eagle=False)
    with pytest.raises(ValueError, match="num_prompt"):
        lookup.replay_boundaries(-1, 2, eagle=False)
    with pytest.raises(ValueError, match="retention"):
        lookup.window_blocks_kept(2, 2, 2, 2, False, -2, ())
