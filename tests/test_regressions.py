"""Every committed case file under pagedkv/testing/regressions/ replays clean against every backend under test.

The files hold the concrete cases C1-C10 of the project's case list (plain data: geometry, block
tables, lengths, pattern, seed; the check each one targets) and any shrunk failure worth keeping:
copy a file from ``.pagedkv-failures/`` here once its bug is fixed.
"""

from pathlib import Path

import pagedkv.testing

import pytest

from pagedkv.testing.checks import load_failure, run_record

FILES = sorted((Path(pagedkv.testing.__file__).parent / "regressions").glob("*.json"))


def test_the_regression_directory_holds_the_case_list():
    ids = {load_failure(f).get("id") for f in FILES}
    assert {f"C{i}" for i in range(1, 11)} <= ids


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_regression_case_replays_clean(check, backend, device, path):
    record = load_failure(path)

    def replay(impl, case, device):
        run_record({**record, "case": case}, impl, device)

    replay.__name__ = record["check"]  # the case file the fixture writes on failure names the check
    check(replay, backend, record["case"], device)
