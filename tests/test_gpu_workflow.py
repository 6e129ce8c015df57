"""The GPU workflow admits no stranger: the review points of docs/gating.md ("Who runs what"), kept true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="reading the workflow needs PyYAML")

WORKFLOW = Path(__file__).resolve().parent.parent / ".github" / "workflows" / "gpu.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def test_fork_pull_requests_never_reach_the_self_hosted_runner(workflow):
    assert "pull_request_target" not in workflow["on"] and "workflow_run" not in workflow["on"]
    for name, job in workflow["jobs"].items():
        if "self-hosted" in job["runs-on"]:
            condition = " ".join(job.get("if", "").split())
            assert "github.event_name != 'pull_request' ||" in condition, name
            assert "github.event.pull_request.head.repo.full_name == github.repository" in condition, name
            assert "contains(github.event.pull_request.labels.*.name, 'run-gpu')" in condition, name


def test_the_token_is_read_only_and_not_left_in_the_checkout(workflow):
    assert workflow["permissions"] == {"contents": "read"}
    for job in workflow["jobs"].values():
        assert job.get("permissions", {"contents": "read"}) == {"contents": "read"}
    checkout = [s for s in steps(workflow) if s.get("uses", "").startswith("actions/checkout@")]
    assert checkout and all(s["with"]["persist-credentials"] is False for s in checkout)


def test_every_action_is_pinned_to_a_full_commit_sha(workflow):
    uses = [s["uses"] for s in steps(workflow) if "uses" in s]
    assert uses
    for spec in uses:
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", spec), spec
    for line in WORKFLOW.read_text().splitlines():  # the tag each SHA had, for whoever updates them
        if "uses:" in line:
            assert re.search(r"@[0-9a-f]{40}\s+#\s*v\d", line), line


def test_pull_requests_only_restore_the_example_database_and_only_main_saves_it(workflow):
    cache_steps = [s for s in steps(workflow) if s.get("uses", "").startswith("actions/cache")]
    assert not [s for s in cache_steps if s["uses"].startswith("actions/cache@")]  # no restore-and-save action
    saves = [s for s in cache_steps if s["uses"].startswith("actions/cache/save@")]
    assert saves and all("github.event_name != 'pull_request'" in s["if"] and "github.ref == 'refs/heads/main'"
                         in s["if"] for s in saves)
    restores = [s for s in cache_steps if s["uses"].startswith("actions/cache/restore@")]
    assert restores and all(s["with"]["restore-keys"].split() == ["hypothesis-${{", "runner.os", "}}-main-"]
                            for s in restores)


def test_the_artifact_holds_only_case_files(workflow):
    uploads = [s for s in steps(workflow) if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert uploads and all(s["with"]["path"].strip() == ".pagedkv-failures/*.json" for s in uploads)
