"""Re-expressing a case inside a declared space keeps what makes it (pagedkv.testing.cases.translate)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.cache.config import blocks_needed
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


# -- cache scenarios ---------------------------------------------------------------------------------
def _scenario_files():
    import json
    from pathlib import Path

    import pagedkv.testing.casefiles.regressions as shipped

    folder = Path(next(iter(shipped.__path__)))
    return sorted(p for p in folder.glob("*.json") if json.loads(p.read_text()).get("kind") == "CacheScenario")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=20), st.integers(0, 20), st.sampled_from([(1, 16), (2, 16), (4, 16),
                                                                                     (4, 32), (3, 16), (16, 32)]))
def test_a_stretched_stream_keeps_prefixes_lengths_and_places(tokens, n, sizes):
    from pagedkv.testing.cases.translate import _place, stretch

    bs, new = sizes
    out = stretch(tokens, bs, new)
    assert len(out) == _place(len(tokens), bs, new)
    assert blocks_needed(len(out), new) == blocks_needed(len(tokens), bs)
    assert stretch(tokens[:n], bs, new) == out[:_place(min(n, len(tokens)), bs, new)]  # prefix-consistent
    if len(tokens) % bs:
        assert len(out) % new and (len(tokens) % bs != bs - 1 or bs < 3 or len(out) % new == new - 1)
    blocks = [tuple(tokens[i:i + bs]) for i in range(0, len(tokens), bs)]
    new_blocks = [tuple(out[i:i + new]) for i in range(0, len(out), new)]
    for a in range(len(blocks)):  # equal blocks stay equal, different ones different (the prefix cache's hashes)
        for b in range(len(blocks)):
            assert (blocks[a] == blocks[b]) == (new_blocks[a] == new_blocks[b])


def test_every_shipped_cache_scenario_translates_and_keeps_the_faults_it_catches():
    """Each shipped cache-scenario file re-expressed at block size 16 / head_dim 64: the correct
    backend passes it, and it catches exactly the cache and copy-on-write mutants the original catches
    (what made the case survived, and nothing else was made)."""
    from pagedkv.testing.execute import run_record
    from pagedkv.tools.mutants import MUTANTS
    from pagedkv.testing.casefiles.reading import load_case_file

    cache_mutants = {name: cls() for name, cls in MUTANTS.items() if getattr(cls, "cache_class", None) is not None
                     and cls.cache_class.__name__ != "PagedKVCache"}
    assert cache_mutants and len(_scenario_files()) >= 10
    for path in _scenario_files():
        record = load_case_file(path, check_backend=False)
        original = record["case"]
        moved, how = into_space(original, KERNEL)
        assert moved is not None, f"{path.name}: {how}"
        if original.geometry.block_size in (16, 32):
            continue
        assert not KERNEL.rejects(moved.geometry) and "block_size" in how, how
        assert [op[0] for op in moved.ops] == [op[0] for op in original.ops]
        from pagedkv.backends import get_backend

        assert not run_record({**record, "case": moved}, get_backend("indexed")).failed, path.name
        caught = {name for name, mutant in cache_mutants.items() if run_record(record, mutant).failed}
        still = {name for name, mutant in cache_mutants.items() if run_record({**record, "case": moved}, mutant).failed}
        assert caught == still, f"{path.name} ({how}): caught {sorted(caught)}, translated {sorted(still)}"


def test_a_scenario_larger_than_every_declared_block_size_is_not_translated():
    from pagedkv.testing.cases import CacheScenario

    scenario = CacheScenario(Geometry(8, 32, 1, 4), (("add", 0, tuple(range(40))),))
    moved, why = into_space(scenario, Capabilities(block_sizes=Sizes(values={16})))
    assert moved is None and "every declared block size" in why and "smaller" in why


def test_c02_fork_mid_block_stays_mid_block():
    from pagedkv.testing.cases import CacheScenario

    scenario = CacheScenario(Geometry(8, 4, 1, 4), (("add", 0, (1, 2, 3, 4, 5, 6)), ("fork", 0, 1),
                                                    ("append", 0, (7, 7, 7)), ("append", 1, (9, 9, 9))))
    moved, how = into_space(scenario, KERNEL)
    assert "block_size 4 -> 16" in how
    add, fork, a0, a1 = moved.ops
    assert len(add[2]) == 16 + 8 and add[2][:16] == (1,) + (2,) * 7 + (3,) * 7 + (4,)  # one full block, a partial one
    assert fork == ("fork", 0, 1) and len(a0[2]) == len(a1[2]) == 9  # 6 + 3 = 9 tokens -> 2 * 16 + 1
    assert set(a0[2]) == {7} and set(a1[2]) == {9}


def test_a_scenario_moved_only_for_its_head_dim_says_so_and_stretches_nothing():
    from pagedkv.testing.cases import CacheScenario

    scenario = CacheScenario(Geometry(8, 16, 1, 4), (("add", 0, tuple(range(20))), ("append", 0, (7, 7))))
    moved, how = into_space(scenario, KERNEL)
    assert "head_dim 4 -> 64" in how and "block_size" not in how and "stretched" not in how, how
    assert moved.ops == scenario.ops
