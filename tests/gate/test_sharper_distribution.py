"""The case distribution reaches what kernels get wrong: sequences across key tiles at small block
sizes, query tiles of chunked prefills, pools whose head stride is not head_dim, and every subset
of the declared features."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, find, settings

from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
from pagedkv.testing.cases.memory import pool_layout
from pagedkv.testing.strategies.batches import LONG_MAX_Q_LEN, TILE_EDGES, cases

# an example found is enough: no shrinking
FIND = settings(max_examples=2000, database=None, deadline=None, phases=(Phase.generate,))


def test_a_sequence_crosses_a_32_key_tile_at_a_block_size_that_does_not_divide_it():
    case = find(cases(), lambda c: 32 % c.geometry.block_size and
                any(s.seq_len > 32 and s.q_len > 6 for s in c.seqs), settings=FIND)
    long = [s for s in case.seqs if s.seq_len > 24]
    (s,) = long  # its length, or its context (the keys before its query), sits at a tile edge
    assert s.seq_len in TILE_EDGES or s.seq_len - s.q_len in TILE_EDGES
    assert s.q_len <= LONG_MAX_Q_LEN and len(s.block_table) >= math.ceil(s.seq_len / case.geometry.block_size)


def test_a_long_sequences_context_ends_on_a_tile_edge():
    case = find(cases(), lambda c: any(s.seq_len - s.q_len in TILE_EDGES and s.q_len > 1 and s.seq_len - s.q_len > 24
                                       for s in c.seqs), settings=FIND)
    assert any(s.seq_len - s.q_len in TILE_EDGES and s.seq_len > 24 for s in case.seqs)


def test_a_long_sequence_shares_its_batch_with_decodes_and_empty_sequences():
    def mixed(c):
        kinds = {"long chunk" if s.seq_len > 24 and s.q_len > 1 else "decode" if s.seq_len and s.q_len == 1 else
                 "empty" if not s.seq_len else "other" for s in c.seqs}
        return {"long chunk", "decode", "empty"} <= kinds

    case = find(cases(), mixed, settings=FIND)
    assert len(case.seqs) >= 3 and any(s.seq_len in TILE_EDGES or s.seq_len - s.q_len in TILE_EDGES
                                       for s in case.seqs)


def test_long_sequences_stay_off_large_blocks_where_lengths_already_cross_blocks():
    case = find(cases(), lambda c: c.geometry.block_size >= 32, settings=FIND)
    assert all(s.seq_len <= 2 * case.geometry.block_size + 1 for s in case.seqs)


@pytest.mark.parametrize("memory", ["NHD", "HND"])
def test_head_strided_pools_are_views_of_a_wider_cache_with_poison_between_k_and_v(memory):
    case = Case(Geometry(num_blocks=3, block_size=2, num_kv_heads=2, head_dim=3), (SeqSpec((2, 0), 3, 1, 0),),
                layout="head_strided", poison="nan")
    with pool_layout(memory):
        k, v = case.caches()
    assert k.shape == v.shape == (3, 2, 2, 3) and k.stride(3) == 1
    assert (k.stride(2) if memory == "NHD" else k.stride(1)) == 7  # the row of one head (NHD) or token (HND)
    assert v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert v.storage_offset() - k.storage_offset() == 4
    gap = torch.as_strided(k, (3, 2, 2), (k.stride(0), k.stride(1), k.stride(2)), k.storage_offset() + 3)
    assert bool(gap.isnan().all())  # the element between each head's K and V is poison
    assert torch.isfinite(k[2, 0]).all() and torch.isfinite(v[0, 0]).all()  # token 0 and token 2 are stored


@pytest.mark.parametrize("memory", ["NHD", "HND"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 1), (2, 3, 2, 1), (2, 2, 2, 3)])
def test_head_strided_pools_reach_a_declared_layout_as_views_of_its_storage(memory, shape):
    """A head-strided pool one element wide per head (head_dim 1) is still a view of the layout's memory with
    gaps: handed over as that storage, not a copy, so a value tensor overlapping the pool still overlaps what
    the backend writes (``values_overlap_cache``). Fails before: HND's storage of a head_dim 1 sub-view was
    None, the pool was copied and an honest kernel's overlap check was judged as raising nothing."""
    from pagedkv.layouts import NAMED

    case = Case(Geometry(num_blocks=shape[0], block_size=shape[1], num_kv_heads=shape[2], head_dim=shape[3]),
                (SeqSpec((0,), 1, 1, 0),), layout="head_strided", poison="nan")
    with pool_layout(memory):
        k, v = case.caches()
    for pool in (k, v):
        storage = NAMED[memory].storage_of(pool)
        assert storage is not None and storage.data_ptr() == pool.data_ptr()
        assert torch.equal(NAMED[memory].logical(storage).nan_to_num(7.0), pool.nan_to_num(7.0))


@pytest.mark.parametrize("target", [(), ("window",), ("softcap", "sinks"), ("window", "softcap", "alibi", "sinks")])
def test_the_features_are_drawn_swarm_style_any_subset_and_the_plain_path(target):
    names = ("window", "softcap", "alibi", "sinks")

    def features(c):
        return tuple(n for n, on in zip(names, (c.window_left >= 0, c.softcap > 0, c.alibi, c.sinks)) if on)
    assert features(find(cases(features=names), lambda c: features(c) == target, settings=FIND)) == target


def _drawn_in_short_runs(strategy, runs: int) -> list:
    """The cases of ``runs`` seeded runs of 25 examples (the interpreted backends' count), where a
    share is measured: Hypothesis draws differently there than in one long run."""
    from hypothesis import HealthCheck, given, seed

    drawn = []
    for s in range(runs):
        @seed(s)
        @settings(max_examples=25, database=None, deadline=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(case):
            drawn.append(case)
        run()
    return drawn


def test_half_the_cases_of_a_short_run_draw_features_and_half_the_plain_path():
    """The featured share is measured where it matters, in runs of the interpreted backends' 25 examples
    (Hypothesis lands a fair coin deep in a case on True only about a third of the time there)."""
    drawn = [c.window_left >= 0 or c.softcap > 0 or c.alibi or c.sinks or c.kv_cache_dtype != "auto"
             for c in _drawn_in_short_runs(cases(), 16)]
    assert 0.4 <= sum(drawn) / len(drawn) <= 0.62, f"{sum(drawn)} of {len(drawn)} cases use a feature"


def test_soft_caps_at_most_one_are_drawn_in_half_the_soft_capped_cases_of_a_short_run():
    """Both sides of the switch-off a kernel tests (``softcap > 0``): caps at most 1, which saturate
    nearly every logit, in about half the cases with a soft-cap (measured in 25-example runs)."""
    caps = [c.softcap for c in _drawn_in_short_runs(cases(features=("softcap",)), 12) if c.softcap > 0]
    small = sum(c <= 1 for c in caps)
    assert len(caps) >= 50 and 0.4 <= small / len(caps) <= 0.75, f"{small} of {len(caps)} soft-caps at most 1"


def test_production_kv_head_counts_are_drawn_at_production_head_dims_in_small_blocks():
    """8 kv heads of width 128 (Llama 3, Mistral, Qwen): a kernel whose head tile is wrong only there is reached,
    in small blocks (the pools stay a few MB)."""
    from pagedkv.testing.strategies.geometry import REALISTIC_KV_HEADS, geometries

    geometry = find(geometries(), lambda g: g.num_kv_heads in REALISTIC_KV_HEADS and g.head_dim >= 64, settings=FIND)
    assert geometry.head_dim <= 128 and geometry.block_size <= 16


def test_a_decode_batch_past_a_batch_tile_of_eight_or_sixteen_is_drawn():
    """Continuous batching decodes dozens of sequences a step: a kernel wrong from its ninth sequence on (a batch
    tile of 8) is reached, in a batch of decodes (every query at most one token), at a small block size."""
    from pagedkv.testing.strategies.batches import WIDE_BATCH

    case = find(cases(), lambda c: len(c.seqs) > 8, settings=FIND)
    assert len(case.seqs) <= WIDE_BATCH[1] and all(s.q_len <= 1 for s in case.seqs)
    assert case.geometry.block_size <= 16
