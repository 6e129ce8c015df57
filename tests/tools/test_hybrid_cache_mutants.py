"""pagedkv's faulty hybrid caches (``caches.HYBRID_CACHE_MUTANTS``), gated as cache managers: each one's
shipped program (``pagedkv/testing/casefiles/hybrid/``, a manager-program case file the cache-manager
machine found and shrank) fails on its mutant and passes on the real cache, per push. The searches that
find them run in ``tests/gate/test_manager_groups.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.testing import casefiles
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.casefile import KIND, trusted_manager_spec
from pagedkv.tools.mutants import caches
from pagedkv.tools.mutants.caches import HYBRID_CACHE_MUTANTS

#: The real hybrid cache through the protocol (its factory picks OwnHybridManager for a hybrid layout).
REAL = "pagedkv.testing.managers.own:cache_manager"


@pytest.mark.parametrize("name", sorted(HYBRID_CACHE_MUTANTS))
def test_every_hybrid_mutant_says_its_fault_and_loads_as_a_manager(name):
    cls = HYBRID_CACHE_MUTANTS[name]
    assert cls.__doc__ and cls.__doc__ != cls.__mro__[1].__doc__
    spec = f"pagedkv.tools.mutants.caches:{name}"
    assert trusted_manager_spec(spec) and programs.load_manager(spec).cache_class is cls


PROGRAMS = sorted((Path(casefiles.__file__).parent / "hybrid").glob("*.json"))


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_a_shipped_program_kills_its_mutant_and_the_real_cache_passes_it(path, capsys):
    record = json.loads(path.read_text())
    assert record["kind"] == KIND and record["manager"] == f"pagedkv.tools.mutants.caches:{path.stem}"
    assert programs.replay_file(str(path), quiet=True) == 1
    assert record["error"].split(":")[0] in capsys.readouterr().out  # the recorded failure, not another
    assert programs.replay_file(str(path), impl=REAL, quiet=True) == 0


def test_every_hybrid_mutant_has_a_shipped_program():
    assert sorted(p.stem for p in PROGRAMS) == sorted(HYBRID_CACHE_MUTANTS)
    assert all(hasattr(caches, name) for name in HYBRID_CACHE_MUTANTS)
