"""The device-memory lease shared by xdist workers, on a simulated budget: a nested ``pytest -n 4`` whose
tests need more memory together than the budget holds waits, never skips or fails, and its ledger shows
the budget was never exceeded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedkv.testing.device_lease import (DeviceMemoryBudget, LeaseTooLarge, hold, ledger_summary, parse_bytes,
                                          read_ledger)

GiB = 2**30
_TESTS = textwrap.dedent("""
    import time

    import pytest

    from pagedkv.testing.device_lease import leased


    @leased(lambda nbytes: nbytes)
    def allocate(backend, nbytes, device="cpu"):
        time.sleep(0.4)  # the pools live while the check runs


    @pytest.mark.parametrize("i", range(8))
    def test_large_pools(i, pagedkv_device_memory):
        assert pagedkv_device_memory is not None
        allocate(None, 3 * 2**30, "cpu")
""")


def _nested_run(pytester, monkeypatch, budget: str, *args: str):
    """``pytest test_pools.py`` under a simulated budget: ``(result, the lease ledger's path)``."""
    pytester.makepyfile(test_pools=_TESTS)
    pytester.makeini("[pytest]\npagedkv_builtin = true\n")
    basetemp = pytester.path / "basetemp"
    monkeypatch.setenv("PAGEDKV_DEVICE", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                      os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("test_pools.py", "-p", "no:cacheprovider", "-q", f"--basetemp={basetemp}",
                                           f"--pagedkv-device-memory={budget}", "-rs", *args, timeout=300)
    return result, basetemp / "pagedkv-device-memory" / "ledger.jsonl"


@pytest.mark.slow  # four workers start on two cores: about a minute
def test_workers_wait_for_a_budget_smaller_than_their_sum_and_never_exceed_it(pytester, monkeypatch):
    run, ledger = _nested_run(pytester, monkeypatch, "7GiB", "-n", "4")
    out = str(run.stdout)
    assert run.ret == 0, out + str(run.stderr)
    assert "8 passed" in out and "skipped" not in out, out
    entries = read_ledger(ledger)
    grants = [e for e in entries if e["event"] == "grant"]
    assert len(grants) == 8 and len({e["pid"] for e in grants}) > 1  # several workers shared one ledger
    assert max(e["in_use"] for e in entries) <= 7 * GiB
    in_use = 0
    for e in entries:  # replaying the ledger: never more than two 3 GiB leases at once
        in_use += e["bytes"] if e["event"] == "grant" else -e["bytes"]
        assert in_use == e["in_use"] <= 7 * GiB
    summary = ledger_summary(entries)
    assert summary["waiting"] > 0 and summary["peak_bytes"] == 6 * GiB
    assert "pagedkv device memory: 8 leases of a 7.00 GiB budget" in out


def test_a_lease_larger_than_the_whole_budget_is_a_usage_error_not_a_hang(pytester, monkeypatch):
    run, _ = _nested_run(pytester, monkeypatch, "2GiB")
    out = str(run.stdout)
    assert run.ret == 1, out + str(run.stderr)
    assert "LeaseTooLarge" in out and "more than the whole of the declared budget" in out


def test_a_crashed_holder_is_reclaimed(tmp_path):
    budget = DeviceMemoryBudget(tmp_path, 4 * GiB)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    state = budget._read()
    state["leases"]["gone"] = [4 * GiB, int(dead.stdout), "a worker that died"]
    budget._write(state)
    with budget.lease(3 * GiB, "next") as grant:
        assert grant.nbytes == 3 * GiB
    assert [e["event"] for e in read_ledger(budget.ledger_path)] == ["reclaim", "grant", "release"]


def test_the_cpu_takes_no_lease_without_a_declared_budget(tmp_path, monkeypatch):
    from pagedkv.testing import device_lease

    monkeypatch.setattr(device_lease, "_BUDGET", DeviceMemoryBudget(tmp_path, GiB, declared=False))
    with hold(100 * GiB, "lazy pools", "cpu") as grant:
        assert grant is None
    with pytest.raises(LeaseTooLarge, match="more than the whole of the device's memory"):
        with hold(100 * GiB, "real pools", "cuda:0"):
            pass


@pytest.mark.parametrize("text,expected", [("141GiB", 141 * GiB), ("80 GB", 80 * 10**9), ("1024", 1024),
                                           ("0.5MiB", 2**19)])
def test_sizes_parse(text, expected):
    assert parse_bytes(text) == expected


def test_a_malformed_size_names_its_setting():
    with pytest.raises(ValueError, match="pagedkv_device_memory: '12 parsecs'"):
        parse_bytes("12 parsecs", "pagedkv_device_memory")
