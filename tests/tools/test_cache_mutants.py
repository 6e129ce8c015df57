"""The properties kill every shipped cache mutant (:mod:`pagedkv.tools.mutants.caches`), under the ``ci``
profile (derandomized: a gate does not flip on a rerun), stopping at the first failing example.

Two drivers see each one: the cache state machine of the kernel property
``cache_state_machine_holds_its_invariants`` (the cache-manager machine over pagedkv's own cache with the
faulty class as its ``cache_class``: :func:`pagedkv.testing.managers.kernel_property.machine_for_backend`)
and the sharing property (``checks.sharing_isolated`` over drawn
scenarios, with the mutant's backend, whose ``cache_class`` is the faulty cache), followed, as
``python -m pagedkv mutate --kill-table`` does, by the committed scenario case files. A kill must be an
``AssertionError`` (a property's verdict), not a crash of the faulty code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from pagedkv.backends import load_backend
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.tools.mutants import caches as cache_mutants
from pagedkv.testing.properties import scenarios as scenarios_mod
from pagedkv.testing.casefiles.reading import load_case_file, shipped_regressions
from pagedkv.testing.execute import run_record
from pagedkv.tools.mutants.backends import IndexedBackend
from pagedkv.testing.strategies import scenarios
from pagedkv.testing.settings import PROFILES
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.kernel_property import STEPS, machine_for_backend

NAMES = sorted(cache_mutants.CACHE_MUTANTS)
#: Derandomized runs of the state machine per mutant, and for the real cache (the control).
RUNS = 100
#: Derandomized runs where a mutant needs more (the first failing example of its search, measured).
RUNS_FOR = {"cow_first_layer_only": 200,  # found at example 122
            "release_head_first": 500,  # found at example 460
            "evict_most_recent": 800}  # found at example 757


def ci_settings(**extra) -> settings:
    """The suite's ``ci`` profile, without shrinking or an example database (a mutant's failures must
    not be replayed against the real cache)."""
    values = {k: v for k, v in PROFILES["ci"].items() if k not in ("database", "phases", "verbosity", *extra)}
    return settings(**values, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck), **extra)


def sharing_property(backend):
    @ci_settings()
    @given(scenario=scenarios())
    def prop(scenario):
        scenarios_mod.sharing_isolated(backend, scenario)

    return prop


def machine_kill(cache_class) -> str | None:
    """The machine's verdict on ``cache_class`` (derandomized, :data:`RUNS` runs): the failure's first line, or
    ``None``; a failure must be the machine's (an ``AssertionError``), not a crash of the faulty code."""
    steps = programs.run_recorded(machine_for_backend(cache_class=cache_class),
                                  ci_settings(stateful_step_count=STEPS, max_examples=RUNS))
    if steps is None:
        return None
    assert isinstance(steps.exception, AssertionError), steps.error
    return steps.error


#: Mutants the derandomized search misses under pytest (run in a plain process, the same search finds it
#: at its 120th run): two requests must compute one system prompt's blocks each, the second copy must
#: grow a longer chain, and a later prompt must reach it. Per push each is killed by the program the
#: search found (``tests/tools/programs/``); the long search runs nightly.
SEARCH_MISSES = {"first_candidate_only": "the derandomized search reaches it in some process states only"}


#: Mutants whose derandomized search needs more than a per-push budget (over 300 runs, 15-25 s each): their
#: state-machine search runs nightly; per push the sharing property kills them (the test below).
LONG_SEARCHES = {n for n, runs in RUNS_FOR.items() if runs > 300}


def _state_machine_param(name):
    if name in SEARCH_MISSES:
        return pytest.param(name, marks=(pytest.mark.slow, pytest.mark.xfail(reason=SEARCH_MISSES[name], strict=False)))
    if name in LONG_SEARCHES:
        return pytest.param(name, marks=pytest.mark.slow(reason=f"{RUNS_FOR[name]} derandomized runs"))
    return name


@pytest.mark.parametrize("name", [_state_machine_param(n) for n in NAMES])
def test_the_state_machine_kills_cache_mutant(name):
    """Each mutant dies within :data:`RUNS` derandomized runs (:data:`RUNS_FOR` where it needs more, 1500 for a
    search miss, nightly)."""
    runs = 1500 if name in SEARCH_MISSES else RUNS_FOR.get(name, RUNS)
    steps = programs.run_recorded(machine_for_backend(cache_class=cache_mutants.CACHE_MUTANTS[name]),
                                  ci_settings(stateful_step_count=STEPS, max_examples=runs))
    assert steps is not None, f"{name} survived: {cache_mutants.CACHE_MUTANTS[name].__doc__}"
    assert isinstance(steps.exception, AssertionError), steps.error  # the machine's verdict, not a crash


PROGRAMS = Path(__file__).parent / "programs"


@pytest.mark.parametrize("name", sorted(SEARCH_MISSES))
def test_a_found_program_kills_a_search_miss_and_the_real_cache_passes_it(name):
    record = json.loads((PROGRAMS / f"{name}.json").read_text())
    with pytest.raises(AssertionError, match=re.escape(record["error"].split(", ", 1)[1])):  # the same check
        programs.run_program(machine_for_backend(cache_class=cache_mutants.CACHE_MUTANTS[name]), record["steps"])
    programs.run_program(machine_for_backend(), record["steps"])


REGRESSIONS = shipped_regressions()


def sharing_kill(backend) -> str | None:
    """What kills ``backend``: the sharing property, else the first scenario case file; ``None`` if nothing."""
    try:
        sharing_property(backend)()
    except AssertionError:
        return "sharing property"
    for path in REGRESSIONS:
        record = load_case_file(path)
        if record["kind"] == "CacheScenario" and run_record(record, backend).failed:
            return f"case file {path.name}"
    return None


@pytest.mark.parametrize("name", NAMES)
def test_the_sharing_property_and_case_files_kill_cache_mutant(name):
    assert sharing_kill(cache_mutants.CACHE_MUTANT_BACKENDS[name]()) is not None, \
        f"{name} survived: {cache_mutants.CACHE_MUTANTS[name].__doc__}"


def test_the_unmutated_cache_passes_the_same_drivers():
    """Kills come from the planted faults: the real cache passes both drivers under the same settings."""
    assert machine_kill(PagedKVCache) is None
    assert sharing_kill(IndexedBackend()) is None


@pytest.mark.parametrize("name", NAMES)
def test_every_cache_mutant_has_a_docstring_and_loads_as_a_candidate(name):
    cls = cache_mutants.CACHE_MUTANTS[name]
    assert cls.__doc__ and cls.__doc__ != cls.__mro__[1].__doc__
    backend = load_backend(f"pagedkv.tools.mutants:{name}")
    assert backend.name == name and backend.cache_class is cls
    from pagedkv.testing import registry

    assert cache_mutants.CACHE_TARGETS[name]
    assert set(cache_mutants.CACHE_TARGETS[name]) <= {p.name for p in registry.properties().values()}


#: A whole chat turn (``serve``) on a pool of four one-token blocks, then a turn under another namespace that
#: takes every block and releases them again.
SERVED_TWICE = [
    ["start", {"num_blocks": 4, "block_size": 1, "num_layers": 3, "window": 0, "layout": 11, "features": 2}],
    ["system_prompts", {"prompts": [[2, 3], [0, 3, 1, 0, 1, 3, 0, 3, 3]]}],
    ["serve", {"system": [2, 3], "suffix": [], "namespace": [["salt", "a"]], "extra": "image-0", "image_at": 1,
               "tail": 3, "tokens": [3, 1, 2, 2], "reply": [3, 1]}],
    ["serve", {"system": [2, 3], "suffix": [2], "namespace": [["salt", "a"], ["lora", "lora-a", "/adapters/1"]],
               "extra": "image-0", "image_at": 2, "tail": 3, "tokens": [3, 3, 0, 1], "reply": [2, 0, 3]}],
]


def test_a_rule_running_several_steps_is_judged_after_each():
    # Failed before on pagedkv's own cache (a false alarm): the second turn took all four blocks from the front
    # of the eviction order and released them within one rule, and the eviction-order check, run only between
    # rules, saw block 0 gone while 3 (handed out and released again) still led the list.
    programs.run_program(machine_for_backend(), SERVED_TWICE)
