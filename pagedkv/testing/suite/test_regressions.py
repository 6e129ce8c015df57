"""Every regression case file shipped with pagedkv (C1-C11 and kept failures) replays clean against
the implementation under test; a file outside the backend's declared space is skipped with the reason,
and one that breaks a declared precondition runs as a non-gating finding (as the properties do)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.testing.casefile import load_failure, run_record
from pagedkv.testing.plugin import capabilities_under_test
from pagedkv.testing.registry import property_for_record
from pagedkv.testing.suite.test_properties import finding_reason

REGRESSIONS = Path(__file__).resolve().parent.parent / "regressions"
FILES = sorted(REGRESSIONS.glob("*.json"))

pytestmark = pytest.mark.pagedkv


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_regression_case_replays_clean(check, backend, device, path):
    record = load_failure(path, check_backend=False)  # checked like any case file; the backend under test runs
    prop = property_for_record(record["check"], record.get("transform"))

    def replay(impl, case, device):
        run_record({**record, "case": case}, impl, device)

    replay.__name__ = prop.name  # the case file written on failure names the property
    case = record["case"]
    caps = capabilities_under_test(backend)
    geometry = getattr(case, "geometry", None) or case.case.geometry
    layout = getattr(case, "layout", None) or getattr(getattr(case, "case", None), "layout", None)
    outside = caps.rejects(geometry) or prop.requires(caps) or (
        None if caps.strided_pools or layout != "kv_interleaved" else "the backend declares contiguous pools only")
    if outside:
        pytest.skip(f"{path.stem}: {outside}")
    poison = getattr(case, "poison", None) or getattr(getattr(case, "case", None), "poison", None)
    if "finite_unused_slots" in caps.preconditions and poison in ("nan", "inf"):
        try:  # a finding, as in test_finding_outside_declared_preconditions: reported, never gating
            check(replay, backend, case, device)
        except AssertionError as exc:
            pytest.xfail(finding_reason("finite_unused_slots", exc))
        return
    check(replay, backend, case, device)
