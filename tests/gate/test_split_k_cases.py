"""Split-K counts as a case field: drawn for a backend that declares ``split_k``, passed to its
``paged_attention`` as ``num_splits`` by the checks, never to the reference, and kept by case files."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.backends import get_backend
from pagedkv.backends.capabilities import Capabilities
from pagedkv.errors import CaseFileError
from pagedkv.testing.casefiles.reading import load_case_file as load_failure
from pagedkv.testing.casefiles.writing import save_failure
from pagedkv.testing.cases import Case, Geometry, SeqSpec
from pagedkv.testing.properties.definitions import attention_matches_reference, reference_output, run_attention
from pagedkv.testing.strategies.batches import MAX_EDGE_SPLITS, SPLIT_COUNTS, cases, empty_split_counts

CASE = Case(Geometry(num_blocks=6, block_size=4, num_kv_heads=1, head_dim=8, num_queries_per_kv=2),
            (SeqSpec((0, 1, 2), seq_len=11, q_len=1), SeqSpec((3, 4), seq_len=6, q_len=2)), num_splits=3)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_counts_are_drawn_only_for_a_backend_that_declares_split_k(data):
    split = data.draw(cases(caps=Capabilities(split_k=True)))
    plain = data.draw(cases(caps=Capabilities()))
    assert split.num_splits is None or split.num_splits in SPLIT_COUNTS or split.num_splits <= MAX_EDGE_SPLITS
    assert plain.num_splits is None


def test_the_split_k_strategy_reaches_every_count():
    seen = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(case=cases(caps=Capabilities(split_k=True)))
    def collect(case):
        seen.add(case.num_splits)

    collect()
    assert seen >= {None, *SPLIT_COUNTS} and seen <= {None, *range(1, MAX_EDGE_SPLITS + 1)}


def test_empty_split_counts_are_those_where_a_split_starts_at_the_rows_end():
    # ceil(n / S) keys a split: 1 key in 2 splits leaves split 1 at [1, 1); 4 in 3 leaves split 2 at [4, 4)
    assert empty_split_counts([1]) == [2] and empty_split_counts([1, 2]) == [2, 3]
    assert empty_split_counts([4]) == [3] and empty_split_counts([7]) == []  # 7 keys need 8 splits
    assert empty_split_counts([0, 7, 9]) == [4]  # 9 = 3 x 3 keys: split 3 of 4 starts at 9


def test_a_split_k_backend_draws_a_split_count_that_leaves_a_split_empty_in_a_quarter_of_the_cases():
    """The edge of the split arithmetic, as lengths reach block boundaries: a split with no keys (stage 1
    never writes its scratch; a merge that reads it anyway turns the row to NaN, vllm#47188). Drawn only
    where a row has one key and splits are drawn, it came up in about 8% of the cases."""
    stats = [0, 0]

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(caps=Capabilities(split_k=True)))
    def collect(case):
        keys = [n for s in case.seqs for n in range(s.seq_len - s.q_len + 1, s.seq_len + 1)]
        stats[0] += 1
        stats[1] += case.num_splits in empty_split_counts(keys, most=case.num_splits or 1)

    collect()
    assert stats[1] >= 0.2 * stats[0], stats


class Recorder:
    """The loop backend, recording the keyword arguments each attention call gets."""

    name = "recorder"
    FEATURES = frozenset()
    SPLIT_K = True

    def __init__(self):
        self.calls: list[dict] = []

    def paged_attention(self, *args, **kwargs):
        self.calls.append(kwargs)
        return get_backend("loop").paged_attention(*args, **kwargs)


def test_the_checks_pass_num_splits_to_the_backend_and_not_to_the_reference():
    recorder = Recorder()
    run_attention(recorder, CASE)
    assert recorder.calls[-1]["num_splits"] == 3
    attention_matches_reference(recorder, CASE)  # the reference is computed without it
    assert torch.equal(reference_output(CASE)[0], reference_output(CASE.replace(num_splits=None))[0])
    assert "num_splits" not in CASE.replace(num_splits=None).attention_features()


def test_case_files_keep_num_splits_and_refuse_a_count_below_one(tmp_path):
    path = save_failure("paged_attention_matches_fp64_dense_reference", "triton", CASE, path=tmp_path / "c.json")
    assert load_failure(path)["case"] == CASE
    record = json.loads(path.read_text())
    record["case"]["num_splits"] = 0
    path.write_text(json.dumps(record))
    with pytest.raises(CaseFileError, match="num_splits"):
        load_failure(path)
