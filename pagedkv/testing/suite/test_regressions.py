"""Every regression case file shipped with pagedkv (C1-C11 and kept failures) replays clean against
the implementation under test."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.testing.checks import load_failure, run_record
from pagedkv.testing.registry import property_for_record

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
    check(replay, backend, record["case"], device)
