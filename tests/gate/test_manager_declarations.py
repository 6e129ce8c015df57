"""A manager's declarations in the verdict: each promise it leaves off waives a judgement, and the verdict
(JSON and summary) names it; a missing dependency of one declared layout fails at once, not as a shrunk
program."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing import report
from pagedkv.testing.managers import declarations
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import GroupSpec, ManagerCapabilities
from pagedkv.testing.managers.reference import ReferenceManager
from pagedkv.testing.settings import manager_settings
from pagedkv.testing.suite.test_managers import missing_dependency
from pagedkv.testing.verdict import Verdict

GEMMA3 = (GroupSpec("full", 2), GroupSpec("sliding_window", 2, window=1, num_layers=2))


class NoHitPromise(ReferenceManager):
    """The reference manager declaring neither a hit promise nor window release."""

    def __init__(self, config):
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, hit_promise=False, window_release=False)


def test_each_promise_left_off_is_waived_where_it_applies_and_inputs_not_declared_are_not_drawn():
    full = ManagerCapabilities(block_size=2, hit_promise=True, admission="chunk", eviction_order="lru",
                               cached_prompt=True)
    windowed = ManagerCapabilities(block_size=2, groups=GEMMA3, hit_promise=False, namespaces=False)
    summary = declarations.summarize([(full, 3), (windowed, 2)])
    promises = summary["promises"]
    assert summary["programs"] == 5
    assert promises["hit_promise"]["declared_in"] == 3 and promises["hit_promise"]["applicable_in"] == 5
    assert promises["window_release"] == {**promises["window_release"], "declared_in": 0, "applicable_in": 2}
    assert summary["waived"] == ["hit_promise", "admission", "window_release", "eviction_order", "cached_prompt"]
    assert "namespaces" not in summary["not_drawn"] and "fork" in summary["not_drawn"]  # one program drew salts
    line = declarations.describe(summary)
    assert "waived (not declared): hit_promise (2 of 5 programs)" in line and "window_release (2 of 2" in line
    honest = declarations.summarize([(dataclasses.replace(windowed, hit_promise=True, admission="chunk",
                                                          window_release=True, eviction_order="lru",
                                                          cached_prompt=True), 1)])
    assert honest["waived"] == [] and "namespaces" in honest["not_drawn"]


def test_the_machine_records_each_programs_declarations_and_the_json_verdict_names_the_waiver():
    machine = machine_for(NoHitPromise, layouts=("gemma3",), name="NoHitPromiseMachine")
    run_state_machine_as_test(machine, settings=settings(manager_settings(5, 10), phases=(Phase.generate,)))
    summary = declarations.summarize(tuple(seen) for seen in machine.capabilities_seen.values())
    assert summary["programs"] >= 5  # every program that started, each counted once
    assert summary["waived"] == ["hit_promise", "window_release", "eviction_order"], summary
    verdict = Verdict("passed", "manager", measured={"examples": 5}, declarations=summary)
    run = report.TestRun.__new__(report.TestRun)
    run.node = types.SimpleNamespace(user_properties=[])
    backend = types.SimpleNamespace(__name__="no_hit_promise", cache_manager=NoHitPromise)
    run.record("cache_manager", backend, verdict)
    stats = {"passed": [types.SimpleNamespace(when="call", user_properties=run.node.user_properties)]}
    (candidate,) = report.verdict(stats, [backend], "no_hit_promise")["candidates"]
    assert json.loads(json.dumps(candidate))["manager_declarations"]["waived"] == summary["waived"]
    (line,) = [x for x in report.summary_lines(stats, [backend], None) if "manager promises" in x]
    assert "waived (not declared): hit_promise" in line, line


def test_a_dependency_missing_in_one_layout_is_found_before_the_search():
    def factory(config):
        if config.groups:
            raise BackendUnavailableError("no module named 'triton'; install: pip install triton")
        return ReferenceManager  # never used

    found = missing_dependency(factory, ("one-group", "gemma3"), 1, None)
    assert isinstance(found, BackendUnavailableError) and "triton" in str(found)
    assert missing_dependency(factory, ("one-group",), 1, None) is None

    def refuses(config):
        raise ValueError("groups: not served")  # left to the search, which reports it with its program

    assert missing_dependency(refuses, ("gemma3",), 1, None) is None


@pytest.mark.parametrize("layout", ["gemma3", "one-group"])
def test_the_reference_and_own_managers_build_for_the_probe(layout):
    from pagedkv.testing.managers import own

    factory = ReferenceManager if layout == "gemma3" else own.cache_manager
    assert missing_dependency(factory, (layout,), 2, None) is None
