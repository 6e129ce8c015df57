"""The suite kills every shipped mutant (pagedkv.tools.mutants): each a real fault planted in the indexed backend.

Each mutant runs only the properties it targets, under the ``ci`` profile (derandomized, so a gate
does not flip on a rerun), stopping at the first failing example without shrinking. The full sweep
(every property, shrinking, a table) is ``python -m pagedkv mutate --kill-table``. The cache mutants die per
push in tests/tools/test_cache_mutants.py to the same checks; here they run in the nightly tier.
"""

import pytest

from pagedkv.tools import mutants
from pagedkv.tools.mutants import caches as cache_mutants, features as feature_mutants, kill_table as runner
from pagedkv.testing.registry import properties
from pagedkv.backends import load_backend, missing_ops


BACKEND_MUTANTS = {**mutants.MUTANTS, **feature_mutants.FEATURE_MUTANTS}

#: The cache mutants die per push in tests/tools/test_cache_mutants.py, each to the same checks under the same
#: derandomized ``ci`` search: the sharing property (``every_live_sequence_reads_only_its_own_tokens``' check)
#: kills all of them, the cache state machine (``cache_state_machine_holds_its_invariants``') all but its search
#: miss, and the real cache passes both. Here, run as the kill table runs them (through the suite's guard, about
#: three times the cost), they wait for the nightly tier.
CACHE_KILLS_PER_PUSH = pytest.mark.slow(reason="killed per push by the same sharing property and cache state machine "
                                                "in tests/tools/test_cache_mutants.py; here through the guard, nightly")


def _tier(name: str):
    return pytest.param(name, marks=CACHE_KILLS_PER_PUSH) if name in cache_mutants.CACHE_MUTANTS else name


@pytest.mark.parametrize("name", [_tier(n) for n in sorted(BACKEND_MUTANTS)])
def test_the_suite_kills_mutant(name):
    result = runner.run_mutant(name, "ci", only_targets=True, regressions=False, shrink=False)
    assert result.killed, f"mutant {name} survived {result.ran} ({result.examples} examples): " \
                          f"{BACKEND_MUTANTS[name].__doc__}"


@pytest.mark.parametrize("name", sorted(BACKEND_MUTANTS))
def test_every_mutant_has_targets_a_docstring_and_loads_as_a_candidate(name):
    cls = BACKEND_MUTANTS[name]
    assert cls.__doc__ and cls.__doc__ != mutants.IndexedBackend.__doc__
    assert runner.ALL_TARGETS[name] and set(runner.ALL_TARGETS[name]) <= set(properties())
    backend = load_backend(runner.mutant_spec(name))
    assert backend.name == name and missing_ops(backend) == {}


def _targeted() -> list:
    """Every property a mutant here targets (the 2**24-slot pools: tests/gate/test_large_pool_geometry.py); one
    targeted by cache mutants alone waits with their kills (their per-push control: test_cache_mutants)."""
    by = {}
    for m in BACKEND_MUTANTS:
        for p in runner.ALL_TARGETS[m]:
            by.setdefault(p, set()).add(m)
    return [pytest.param(p, marks=CACHE_KILLS_PER_PUSH) if ms <= set(cache_mutants.CACHE_MUTANTS) else p
            for p, ms in sorted(by.items()) if "2_24" not in p]


@pytest.mark.parametrize("prop", _targeted())
def test_the_unmutated_base_passes_the_targeted_property(prop):
    """Kills come from the planted faults: the base class the mutants derive from passes, under the profile the
    kills run on (``ci``: its derandomized examples are the ones that kill)."""
    outcome = runner.run_property(mutants.IndexedBackend(), properties()[prop], "ci", shrink=False)
    assert not outcome.failed, f"{prop}: {outcome.first_line} on {runner.case_summary(outcome)}"


def test_the_cli_prints_a_table_and_exits_0_when_all_are_killed(capsys):
    from pagedkv.cli import main

    assert main(["mutate", "--kill-table", "--profile", "ci", "--only", "scale_ignored", "negative_slot_written",
                 "--targets-only", "--no-shrink"]) == 0
    out = capsys.readouterr().out
    assert "scale_ignored" in out and "negative_slot_written" in out and "2/2 mutants killed" in out
    assert main(["mutate", "--kill-table", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in mutants.MUTANTS)
