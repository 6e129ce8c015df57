"""The hybrid cache state machine against the planted faults of ``caches.HYBRID_CACHE_MUTANTS``
(derandomized, the ``ci`` profile's settings, 400 runs, no shrinking), and the real cache passes the same runs.

Nightly tier (``slow``): about 2 minutes on 2 cores (the real cache's 400 runs 45 s, the slowest kill 38 s)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.testing.properties.hybrid_machine import STEPS, HybridCacheMachine, hybrid_machine_for
from pagedkv.testing.settings import PROFILES
from pagedkv.tools.mutants.caches import HYBRID_CACHE_MUTANTS

RUNS = 400


def ci_settings() -> settings:
    values = {k: v for k, v in PROFILES["ci"].items() if k not in ("database", "phases", "verbosity", "max_examples")}
    return settings(**values, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck), stateful_step_count=STEPS,
                    max_examples=RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HYBRID_CACHE_MUTANTS))
def test_the_hybrid_machine_kills_hybrid_cache_mutant(name):
    with pytest.raises(AssertionError):
        run_state_machine_as_test(hybrid_machine_for(HYBRID_CACHE_MUTANTS[name]), settings=ci_settings())


@pytest.mark.slow
def test_the_real_hybrid_cache_passes_the_same_runs():
    run_state_machine_as_test(HybridCacheMachine, settings=ci_settings())


@pytest.mark.parametrize("name", sorted(HYBRID_CACHE_MUTANTS))
def test_every_hybrid_mutant_says_its_fault(name):
    cls = HYBRID_CACHE_MUTANTS[name]
    assert cls.__doc__ and cls.__doc__ != cls.__mro__[1].__doc__
