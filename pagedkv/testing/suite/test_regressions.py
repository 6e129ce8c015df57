"""Every regression case file shipped with pagedkv (C1-C11 and kept failures), and the user's own
(``--pagedkv-regressions DIR`` / ini ``pagedkv_regressions``), replays clean against the
implementation under test; a file outside the backend's declared space is skipped with the reason,
and one that breaks a declared precondition runs as a non-gating finding (as the properties do)."""

from __future__ import annotations

import pytest

from pagedkv.testing import execute
from pagedkv.testing.casefiles.reading import load_case_file
from pagedkv.testing.registry import property_for_record
from pagedkv.testing.report import failure_text
from pagedkv.testing.space import capabilities_under_test

pytestmark = pytest.mark.pagedkv


def _outside(record: dict, prop, caps) -> str | None:
    case = record["case"]
    inner = getattr(case, "case", None)
    geometry = getattr(case, "geometry", None) or inner.geometry
    layout = getattr(case, "layout", None) or getattr(inner, "layout", None)
    return caps.rejects(geometry) or prop.cannot_run((), caps) or (
        None if caps.strided_pools or layout != "kv_interleaved" else "the backend declares contiguous pools only")


def test_regression_case_replays_clean(pagedkv_run, backend, device, regression_file):
    record = load_case_file(regression_file, check_backend=False)  # checked like any case file; the candidate runs
    prop = property_for_record(record["check"])
    caps = capabilities_under_test(backend)
    outside = _outside(record, prop, caps)
    if outside:
        pagedkv_run.record(regression_file.stem, backend, "skipped", outside, kind="regression")
        pytest.skip(f"{regression_file.stem}: {outside}")
    outcome = execute.run_record(record, backend, device, case_file=pagedkv_run.case_file)
    case = record["case"]
    poison = getattr(case, "poison", None) or getattr(getattr(case, "case", None), "poison", None)
    finding = "finite_unused_slots" in caps.preconditions and poison in ("nan", "inf")
    if outcome.status == "skipped":
        pagedkv_run.record(regression_file.stem, backend, "skipped", outcome.reason, kind="regression")
        pytest.skip(f"{regression_file.stem}: {outcome.reason}")
    pagedkv_run.record(regression_file.stem, backend, "judged", kind="regression")
    if outcome.failed and finding:  # as in test_finding_outside_declared_preconditions: reported, never gating
        pytest.xfail(f"finding (outside the declared precondition 'finite_unused_slots'): "
                     f"{outcome.failures[0].first_line}")
    if outcome.failed:
        pytest.fail(failure_text(f"{prop.sentence} (regression {regression_file.name})", outcome), pytrace=False)
