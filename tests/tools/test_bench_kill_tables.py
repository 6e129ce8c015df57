"""The side-by-side mutation table's two bench scripts (what they read from pytest and from ``mutate``) and the
kill-rate model of seeded manager searches."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import engine_tests_vs_mutants  # noqa: E402
import kill_rate_model  # noqa: E402
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


def test_the_kill_rate_model_counts_survivors_and_converts_counted_programs_to_programs_run():
    runs = [{"killed": True, "programs": 50}, {"killed": False, "programs": 300}, {"killed": True, "programs": 150}]
    kills, programs, p = kill_rate_model.estimate(runs)
    assert (kills, programs, p) == (2, 500, 2 / 500)  # the survivor's 300 programs count as draws that missed
    # a search of 100 programs a layout over 2 layouts: its survivor ran 300, so 1.5 programs run per one counted
    ratio = kill_rate_model.runs_per_program([{"programs_per_layout": 100, "layouts": ["a", "b"], "runs": runs}])
    assert ratio == 1.5
    assert kill_rate_model.runs_per_program([{"programs_per_layout": 100, "layouts": ["a"], "runs": runs[:1]}]) == 1.0
    assert kill_rate_model.rate(0.0, 1000) == 0.0 and kill_rate_model.rate(1.0, 1) == 1.0
    assert abs(kill_rate_model.rate(0.01, 100) - (1 - 0.99 ** 100)) < 1e-12
    need = kill_rate_model.programs_for(0.01)
    assert 458 < need < 459 and kill_rate_model.rate(0.01, 459) >= 0.99 > kill_rate_model.rate(0.01, 458)
    assert kill_rate_model.programs_for(0.0) == float("inf")
