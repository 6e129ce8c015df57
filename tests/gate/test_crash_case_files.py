"""Every failure leaves a case file, crashes included: the plugin writes the case before the backend
runs and removes it when the check passes, so a backend that raises, or kills its process (out of
memory; on a GPU, an illegal memory access), leaves a replayable file behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

CANDIDATE = textwrap.dedent('''
    import os
    import signal

    from pagedkv.backends import indexed as _reference

    name = "{name}"


    def gather(cache, block_table, seq_len):
        if seq_len >= 3:
            {action}
        return _reference.gather(cache, block_table, seq_len)
    ''')


def _gate(tmp_path: Path, name: str, action: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / f"{name}.py").write_text(CANDIDATE.format(name=name, action=action))
    failures = tmp_path / "failures"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    env.update(PYTHONPATH=str(tmp_path), PAGEDKV_PROFILE="ci", PAGEDKV_FAILURE_DIR=str(failures))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", name,
                           "-k", "test_gather_returns_exactly_what_each_slot_holds", "-p", "no:cacheprovider",
                           *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc, failures


def test_a_backend_that_raises_leaves_a_case_file_saying_so(tmp_path):
    proc, failures = _gate(tmp_path, "raising_kv", 'raise RuntimeError("CUDA error: an illegal memory access")',
                           "-p", "no:xdist")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    (path,) = failures.glob("*.json")
    record = json.loads(path.read_text())
    assert record["outcome"] == "raised" and record["error"].startswith("RuntimeError: CUDA error"), record
    assert f"replay: python -m pagedkv replay {path.relative_to(tmp_path)}" in out or str(path) in out, out
    assert max(s["seq_len"] for s in record["case"]["seqs"]) >= 3  # the file holds a case that crashes


def test_a_backend_that_kills_its_process_leaves_the_case_it_was_running(tmp_path):
    proc, failures = _gate(tmp_path, "killing_kv", "os.kill(os.getpid(), signal.SIGKILL)", "-p", "no:xdist")
    assert proc.returncode == -9, proc.stdout + proc.stderr
    (path,) = failures.glob("*.json")
    record = json.loads(path.read_text())
    assert record["outcome"] == "running" and record["backend"] == "killing_kv"
    assert max(s["seq_len"] for s in record["case"]["seqs"]) >= 3
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--impl", "indexed"],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and "PASSES" in replay.stdout, replay.stdout + replay.stderr


def test_a_worker_crash_under_xdist_points_at_the_case_file(tmp_path):
    proc, failures = _gate(tmp_path, "killing_kv", "os.kill(os.getpid(), signal.SIGKILL)", "-n", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "crashed" in out, out
    (path,) = failures.glob("*.json")
    assert "replay: python -m pagedkv replay" in out and path.name in out, out
