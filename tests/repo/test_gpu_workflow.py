"""The GPU workflow admits no stranger: the review points of docs/gating.md ("Who runs what"), kept true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="reading the workflow needs PyYAML")

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "gpu.yml"


@pytest.fixture(scope="module")
def workflow() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


PR_GATE = ("github.event_name != 'pull_request' ||",
           "github.event.pull_request.head.repo.full_name == github.repository",
           "contains(github.event.pull_request.labels.*.name, 'run-gpu')")
NEVER_ON_PRS = re.compile(r"github\.event_name == '(schedule|push|workflow_dispatch)'")


def runs_on_pull_requests(job: dict) -> bool:
    """Whether a job can run for a pull request at all (gated or not)."""
    return not NEVER_ON_PRS.fullmatch(" ".join(job.get("if", "").split()))


def test_fork_pull_requests_never_reach_the_self_hosted_runner(workflow):
    assert "pull_request_target" not in workflow["on"] and "workflow_run" not in workflow["on"]
    for name, job in workflow["jobs"].items():
        if "self-hosted" in job["runs-on"] and runs_on_pull_requests(job):
            condition = " ".join(job.get("if", "").split())
            assert all(part in condition for part in PR_GATE), (name, condition)


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
    for name, job in workflow["jobs"].items():
        cache_steps = [s for s in job.get("steps", []) if s.get("uses", "").startswith("actions/cache")]
        assert not [s for s in cache_steps if s["uses"].startswith("actions/cache@")], name  # no restore-and-save
        for save in (s for s in cache_steps if s["uses"].startswith("actions/cache/save@")):
            if runs_on_pull_requests(job):  # a job that never runs for a PR runs main's code (schedule, push)
                assert "github.event_name != 'pull_request'" in save["if"], name
                assert "github.ref == 'refs/heads/main'" in save["if"], name
        for restore in (s for s in cache_steps if s["uses"].startswith("actions/cache/restore@")):
            assert restore["with"]["restore-keys"].split() == ["hypothesis-${{", "runner.os", "}}-main-"], name


def test_jobs_a_pull_request_can_run_upload_only_case_files(workflow):
    pr_jobs = [job for job in workflow["jobs"].values() if runs_on_pull_requests(job)]
    uploads = [s for job in pr_jobs for s in job.get("steps", [])
               if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert uploads and all(s["with"]["path"].strip() == ".pagedkv-failures/*.json" for s in uploads)
