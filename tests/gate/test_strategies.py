"""The strategies reach every edge they claim to reach (each ``find`` fails the test if it cannot)."""

import pytest
from hypothesis import Phase, find, given, settings

from pagedkv.cache.config import blocks_needed
from pagedkv.testing.strategies import cases, fragmented_cases, large_pool_cases, scenarios, seq_lens

# no shrinking: any hit will do
FIND = settings(max_examples=2000, database=None, deadline=None, phases=[Phase.generate])


def reaches(strategy, condition):
    return find(strategy, condition, settings=FIND)


@pytest.mark.parametrize("edge", ["zero", "one", "bs-1", "bs", "bs+1", "k*bs"])
def test_lengths_reach_block_boundaries(edge):
    bs = 5
    target = {"zero": 0, "one": 1, "bs-1": 4, "bs": 5, "bs+1": 6, "k*bs": 15}[edge]
    assert reaches(seq_lens(bs, 20), lambda n: n == target) == target


@pytest.mark.parametrize("name, condition", [
    ("block_size 1", lambda c: c.geometry.block_size == 1),
    ("non-power-of-two block", lambda c: c.geometry.block_size in (3, 5, 7)),
    ("GQA group 6", lambda c: c.geometry.num_queries_per_kv == 6),
    ("GQA group 7", lambda c: c.geometry.num_queries_per_kv == 7),
    ("odd head_dim", lambda c: c.geometry.head_dim in (3, 5, 7)),
    ("bfloat16", lambda c: c.geometry.dtype == "bfloat16"),
    ("float16", lambda c: c.geometry.dtype == "float16"),
    ("empty sequence in a batch", lambda c: len(c.seqs) > 1 and any(s.seq_len == 0 for s in c.seqs)),
    ("decode", lambda c: any(s.q_len == 1 and s.seq_len > 1 for s in c.seqs)),
    ("prefill over a cached prefix", lambda c: any(1 < s.q_len < s.seq_len for s in c.seqs)),
    ("a block id repeated", lambda c: len({b for i in range(len(c.seqs)) for b in c.used_table(i)})
     < sum(len(c.used_table(i)) for i in range(len(c.seqs)))),
    ("scatter start mid-block", lambda c: any(s.start % c.geometry.block_size and s.start < s.seq_len for s in c.seqs)),
    ("NaN poison", lambda c: c.poison == "nan"),
    ("sentinel poison", lambda c: c.poison == "sentinel"),
    ("large magnitudes", lambda c: c.values == "large"),
    ("token identity values", lambda c: c.values == "identity"),
    ("int64 tables", lambda c: c.table_dtype == "int64"),
    ("padding value other than -1", lambda c: c.pad_value != -1),
    ("strided pools", lambda c: c.layout == "kv_interleaved"),
    ("partial last block", lambda c: any(s.seq_len % c.geometry.block_size for s in c.seqs)),
])
def test_cases_reach(name, condition):
    reaches(cases(), condition)


def test_fragmented_tables_are_not_in_allocation_order():
    case = reaches(fragmented_cases(), lambda c: any(list(c.used_table(i)) != sorted(c.used_table(i))
                                                     for i in range(len(c.seqs))))
    owned = [b for i in range(len(case.seqs)) for b in case.used_table(i)]
    assert len(owned) == len(set(owned)), "a fragmented table must still own each block once"


@settings(max_examples=200, database=None, deadline=None)
@given(case=cases() | fragmented_cases())
def test_cases_are_valid_by_construction(case):
    for i, s in enumerate(case.seqs):
        assert 0 <= s.q_len <= s.seq_len and 0 <= s.start <= s.seq_len
        assert len(s.block_table) >= blocks_needed(s.seq_len, case.geometry.block_size)
        assert all(0 <= b < case.geometry.num_blocks for b in case.used_table(i))


@pytest.mark.parametrize("name, condition", [
    ("a fork", lambda s: any(op[0] == "fork" for op in s.ops)),
    ("a fork then an append to the parent", lambda s: any(
        op[0] == "fork" and any(o[0] == "append" and o[1] == op[1] for o in s.ops[i:]) for i, op in enumerate(s.ops))),
    ("two prompts sharing a full-block prefix", lambda s: sum(
        1 for op in s.ops if op[0] == "add" and len(op[2]) > s.geometry.block_size) >= 2 and len({
            op[2][: s.geometry.block_size] for op in s.ops
            if op[0] == "add" and len(op[2]) > s.geometry.block_size}) == 1),
    ("a free", lambda s: any(op[0] == "free" for op in s.ops)),
    ("colliding hashes", lambda s: s.constant_hash),
])
def test_scenarios_reach(name, condition):
    reaches(scenarios(), condition)


@settings(max_examples=60, database=None, deadline=None)
@given(case=large_pool_cases())
def test_large_pools_pass_float32_exact_integers(case):
    assert case.geometry.num_blocks * case.geometry.block_size > 2**24
    last = max(b for i in range(len(case.seqs)) for b in case.used_table(i))
    assert (last + 1) * case.geometry.block_size > 2**24, "no token sits past float32's exact integers"
