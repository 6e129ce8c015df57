"""Re-expressing a case inside a declared space keeps what makes it (pagedkv.testing.cases.translate)."""

from __future__ import annotations

from hypothesis import given, settings

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.config import blocks_needed
from pagedkv.testing.cases import Case, Geometry, SeqSpec
from pagedkv.testing.cases.translate import into_space
from pagedkv.testing.strategies import cases, fragmented_cases

KERNEL = Capabilities(block_sizes=Sizes(values={16, 32}), head_dims=Sizes(values={64, 128}))


def _place_class(p: int, bs: int) -> str:
    r = p % bs
    return "start" if r == 0 else "second" if r == 1 else "last" if r == bs - 1 else "inside"


@settings(max_examples=60, deadline=None)
@given(cases() | fragmented_cases())
def test_a_translated_case_lies_inside_the_space_and_keeps_its_tables_and_places(case):
    moved, how = into_space(case, KERNEL)
    if moved is None:
        assert how
        return
    assert not KERNEL.rejects(moved.geometry)
    bs, new = case.geometry.block_size, moved.geometry.block_size
    assert moved.geometry.num_blocks == case.geometry.num_blocks
    assert moved.geometry.num_queries_per_kv == case.geometry.num_queries_per_kv
    for a, b in zip(case.seqs, moved.seqs):
        assert a.block_table == b.block_table
        assert blocks_needed(a.seq_len, bs) == blocks_needed(b.seq_len, new)
        if a.seq_len and bs > 2:
            assert _place_class(a.seq_len, bs) == _place_class(b.seq_len, new)
        assert 0 <= b.start <= b.seq_len and b.q_len <= b.seq_len
        assert (a.q_len == a.seq_len) == (b.q_len == b.seq_len)


def test_a_case_about_a_gqa_group_outside_the_space_has_no_translation():
    case = Case(Geometry(4, 4, 1, 2, num_queries_per_kv=3), (SeqSpec((0, 1), 6, 2, 0),))
    moved, why = into_space(case, Capabilities(gqa_groups=Sizes(values={1, 2, 4}), block_sizes=Sizes(values={16})))
    assert moved is None and "GQA group 3" in why


def test_a_partial_last_block_stays_partial_and_a_boundary_stays_a_boundary():
    case = Case(Geometry(6, 4, 1, 2), (SeqSpec((5, 2), 6, 1, 0), SeqSpec((0, 3), 7, 7, 3)))
    moved, how = into_space(case, KERNEL)
    assert "block_size 4 -> 16" in how and "head_dim 2 -> 64" in how
    assert [s.seq_len for s in moved.seqs] == [16 + 8, 16 + 15]
    assert moved.seqs[1].q_len == moved.seqs[1].seq_len and moved.seqs[1].start == 15
