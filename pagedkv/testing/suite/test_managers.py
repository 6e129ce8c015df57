"""The cache manager of the candidate, when it provides one (a ``cache_manager`` factory taking a
:class:`~pagedkv.testing.managers.protocol.ManagerConfig`): the manager state machine
(:mod:`pagedkv.testing.managers.machine`) judged by the content oracle. A failure prints the shrunk
program and saves it as a case file under ``.pagedkv-failures/`` (``python -m pagedkv replay FILE``).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedkv.backends import backend_name
from pagedkv.testing.execute import Failure
from pagedkv.testing.verdict import SkipReason, decide
from pagedkv.testing.settings import manager_settings, suite_settings
from pagedkv.testing.managers.protocol import manager_factory, manager_layouts

pytestmark = pytest.mark.pagedkv

#: Rules per run of the machine.
STEPS = 30


def test_cache_manager(pagedkv_run, backend):
    """Every live request reads back, through its block table, the K/V of its own tokens (namespace,
    prefix, extra keys, position, layer), and the manager's counts, hits and holds add up."""
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for

    factory = manager_factory(backend)
    if factory is None:
        pagedkv_run.record("cache_manager", backend, decide(
            SimpleNamespace(status="skipped", reason="no cache_manager", skip=SkipReason.NO_CACHE_MANAGER),
            kind="manager"))
        pytest.skip("cache_manager: the candidate provides no cache_manager factory (kernels only)")
    spec = pagedkv_run.spec or backend_name(backend)
    windows = getattr(backend, "cache_manager_windows", (None,))
    machine = machine_for(factory, windows=windows, layouts=manager_layouts(backend),
                          name=f"{backend_name(backend)}_manager")
    # a manager whose behaviour unfolds over long decodes (sliding-window eviction) asks for longer programs
    settings = manager_settings(100, getattr(backend, "cache_manager_steps", STEPS), base=suite_settings())
    start = time.perf_counter()
    steps = programs.run_recorded(machine, settings)
    seconds = time.perf_counter() - start
    if steps is None:
        pagedkv_run.record("cache_manager", backend, decide(SimpleNamespace(
            status="passed",
            reason=f"{machine.checks_run} steps, {machine.examples_run} examples in {seconds:.1f} s"), kind="manager"))
        return
    path = programs.save(Path(".pagedkv-failures") / f"manager-{backend_name(backend).replace(':', '_')}.json",
                         spec, machine, steps, steps.error)
    failure = Failure(None, AssertionError(f"{steps.error} (example {steps.first_failing_example})"),
                      case_file=path, replay=f"python -m pagedkv replay {path}")
    pagedkv_run.record("cache_manager", backend, decide(SimpleNamespace(status="failed", failures=[failure]),
                                                        kind="manager"))
    pytest.fail(f"cache manager {spec}: {steps.error}\n{programs.as_text(steps)}\n"
                f"replay: python -m pagedkv replay {path}", pytrace=False)
