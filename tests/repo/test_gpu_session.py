"""``bench/gpu_session.sh`` under ``DRY_RUN=1`` on the CPU: every step but the device calls runs, the plan
comes first and is recorded, and each device step says what it would have run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the plan loads every backend and the registry: about a minute on two busy cores
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_gpu_session_dry_run_plans_first_and_skips_only_the_device_calls(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PLAN_S": "400",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "summary.txt").read_text()
    steps = [line.split(" (t=")[0] for line in summary.splitlines() if line.startswith("== ")]
    assert [s.split(":")[0] for s in steps] == ["== plan", "== suite", "== compile-count check", "== compile report",
                                                "== e2e on CUDA", "== bench"]
    assert "DRY RUN" in summary.splitlines()[0] and "plan exit 0" in summary
    assert "estimated wall time" in summary and "compile-count check exit 0" in summary
    for device_call in ("pytest --pyargs pagedkv.testing.suite", "bench.compile_report --arch",
                        "e2e --backend triton --device cuda", "bench --device cuda"):
        logged = "\n".join(p.read_text() for p in tmp_path.glob("*.txt"))
        assert "[dry run] " in logged and device_call in logged, device_call
    plan = (tmp_path / "plan.txt").read_text()
    assert "== profile ci" in plan and "== profile gpu" in plan and (tmp_path / "plan.json").exists()
