"""The side-by-side mutation table's two bench scripts: what they read from pytest and from ``mutate``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_tests_vs_mutants  # noqa: E402
import side_by_side_kill_table  # noqa: E402


def test_a_parametrize_id_with_spaces_is_one_node_and_a_logged_error_no_test():
    report = "\n".join([
        "PASSED tests/v1/core/test_a.py::test_rejects[33-multiple of scheduler_block_size]",
        "FAILED tests/v1/core/test_a.py::test_b[1] - AssertionError: 1 != 2",
        "ERROR vllm.transformers_utils.repo_utils:repo_utils.py:124 Error retrieving safetensors: offline",
        "ERROR tests/v1/core/test_c.py",
    ])
    passed, failed = engine_tests_vs_mutants.parse_report(report)
    assert passed == ["tests/v1/core/test_a.py::test_rejects[33-multiple of scheduler_block_size]"]
    assert failed == ["tests/v1/core/test_a.py::test_b[1]", "tests/v1/core/test_c.py"]


def _mutant(mid, status, runs, note=""):
    return {"id": mid, "function": "f", "diff": "d", "status": status, "note": note, "wall_s": 1.0, "runs": runs}


def test_a_mutant_the_candidate_does_not_load_with_counts_as_killed_and_runs_merge():
    first = {"config": {"profile": "ci"}, "mutants": [
        _mutant("a-0001", "killed", [], note="does not import: IndexError")]}
    later = {"config": {"profile": "other"}, "mutants": [
        _mutant("a-0002", "survived", [{"explicit": False, "killed": False, "seconds": 2.0, "error": ""}])]}
    mutate = side_by_side_kill_table.merged(first, [later], "mutants")
    engine = {"rows": [{"id": "a-0001", "killed": True, "seconds": 3.0, "first_failure": "FAILED x"},
                       {"id": "a-0002", "killed": False, "seconds": 4.0, "first_failure": ""}]}
    table = side_by_side_kill_table.rows(mutate, engine, {"a-0002": "equivalent: why"})
    assert mutate["config"] == {"profile": "ci"}
    assert [(r["id"], r["machine_killed"], r["machine_runs"]) for r in table] == [("a-0001", 1, 1), ("a-0002", 0, 1)]
    assert table[0]["machine_error"] == "does not import: IndexError"
    totals = side_by_side_kill_table.totals(table)
    assert (totals["machine_killed"], totals["both"], totals["neither"]) == (1, 1, 1)
