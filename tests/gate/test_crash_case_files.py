"""Every failure leaves a case file, crashes included: the plugin writes the case before the backend
runs and removes it when the check passes, so a backend that raises, or kills its process (out of
memory; on a GPU, an illegal memory access), leaves a replayable file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CANDIDATE = '''
import os
import signal

from pagedkv.backends import indexed as _reference

name = "{name}"


def gather(cache, block_table, seq_len):
    if seq_len >= 3:
        {action}
    return _reference.gather(cache, block_table, seq_len)
'''


@pytest.fixture
def gate(pytester, write_candidate, monkeypatch):
    """``gate(name, action, *pytest_args) -> (result, failures)``: the suite's gather property over a
    candidate that runs ``action`` once a sequence is 3 tokens long, under the ``ci`` profile."""
    for key in [k for k in os.environ if k.startswith("PAGEDKV_")]:
        monkeypatch.delenv(key)
    failures = pytester.path / "failures"
    monkeypatch.setenv("PAGEDKV_PROFILE", "ci")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(failures))

    def run(name: str, action: str, *extra: str):
        spec = write_candidate(name, CANDIDATE.format(name=name, action=action)).spec
        result = pytester.runpytest_subprocess(
            "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-k",
            "test_gather_returns_exactly_what_each_slot_holds", "-p", "no:cacheprovider", *extra, timeout=600)
        return result, failures

    return run


def test_a_backend_that_raises_leaves_a_case_file_saying_so(gate, pytester):
    result, failures = gate("raising_kv", 'raise RuntimeError("CUDA error: an illegal memory access")',
                            "-p", "no:xdist")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, out
    (path,) = failures.glob("*.json")
    record = json.loads(path.read_text())
    assert record["outcome"] == "raised" and record["error"].startswith("RuntimeError: CUDA error"), record
    assert f"replay: python -m pagedkv replay {path.relative_to(pytester.path)}" in out or str(path) in out, out
    assert max(s["seq_len"] for s in record["case"]["seqs"]) >= 3  # the file holds a case that crashes


def test_a_backend_that_kills_its_process_leaves_the_case_it_was_running(gate):
    result, failures = gate("killing_kv", "os.kill(os.getpid(), signal.SIGKILL)", "-p", "no:xdist")
    assert result.ret == -9, "\n".join(result.outlines + result.errlines)
    (path,) = failures.glob("*.json")
    record = json.loads(path.read_text())
    assert record["outcome"] == "running" and record["backend"] == "killing_kv"
    assert max(s["seq_len"] for s in record["case"]["seqs"]) >= 3
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--impl", "indexed"],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and "PASSES" in replay.stdout, replay.stdout + replay.stderr


def test_a_worker_crash_under_xdist_points_at_the_case_file(gate, pytester):
    """A killed xdist worker leaves the case it was running, and the summary points at it, in the directory
    ``--pagedkv-failure-dir`` names (relative to where pytest runs): the option replaces ``$PAGEDKV_FAILURE_DIR``
    in the worker too."""
    result, failures = gate("killing_kv", "os.kill(os.getpid(), signal.SIGKILL)", "-n", "1",
                            "--pagedkv-failure-dir", "cases/kv")
    out = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1 and "crashed" in out, out
    assert not failures.exists()
    (path,) = (pytester.path / "cases" / "kv").glob("*.json")
    assert "replay: python -m pagedkv replay" in out and path.name in out, out
