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
from pagedkv.testing.strategies.batches import SPLIT_COUNTS, cases

CASE = Case(Geometry(num_blocks=6, block_size=4, num_kv_heads=1, head_dim=8, num_queries_per_kv=2),
            (SeqSpec((0, 1, 2), seq_len=11, q_len=1), SeqSpec((3, 4), seq_len=6, q_len=2)), num_splits=3)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_counts_are_drawn_only_for_a_backend_that_declares_split_k(data):
    split = data.draw(cases(caps=Capabilities(split_k=True)))
    plain = data.draw(cases(caps=Capabilities()))
    assert split.num_splits is None or split.num_splits in SPLIT_COUNTS
    assert plain.num_splits is None


def test_the_split_k_strategy_reaches_every_count():
    seen = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(case=cases(caps=Capabilities(split_k=True)))
    def collect(case):
        seen.add(case.num_splits)

    collect()
    assert seen == {None, *SPLIT_COUNTS}


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
