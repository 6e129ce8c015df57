"""The cache manager of the candidate, when it provides one (a ``cache_manager`` factory taking a
:class:`~pagedkv.testing.managers.protocol.ManagerConfig`): the manager state machine
(:mod:`pagedkv.testing.managers.machine`) judged by the content oracle, run as the kernel properties
are: under the loaded profile (its examples: ``ci`` 100 programs, ``nightly`` 2000; its example
database, keyed per candidate), its verdict through :func:`pagedkv.testing.verdict.decide` with the
programs and steps it measured. A failure prints the shrunk program and saves it as a case file where
the kernel properties' go (``$PAGEDKV_FAILURE_DIR``, named by the test id), read back with the kernel
case files' defences (``python -m pagedkv replay FILE``; :mod:`pagedkv.testing.managers.casefile`).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pagedkv.backends import backend_name
from pagedkv.testing.databases import property_key
from pagedkv.testing.execute import Failure
from pagedkv.testing.managers.casefile import is_program_file
from pagedkv.testing.managers.protocol import manager_factory, manager_layouts
from pagedkv.testing.settings import manager_suite_settings
from pagedkv.testing.verdict import SkipReason, decide

pytestmark = pytest.mark.pagedkv

#: Rules per program of the machine.
STEPS = 30
#: The property name of the machine in the verdict and the example database.
PROPERTY = "cache_manager"


def test_cache_manager(pagedkv_run, backend):
    """Every live request reads back, through its block table, the K/V of its own tokens (namespace,
    prefix, extra keys, position, layer), and the manager's counts, hits and holds add up."""
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for

    factory = manager_factory(backend)
    if factory is None:
        pagedkv_run.record(PROPERTY, backend, decide(
            SimpleNamespace(status="skipped", reason="no cache_manager", skip=SkipReason.NO_CACHE_MANAGER),
            kind="manager"))
        pytest.skip("cache_manager: the candidate provides no cache_manager factory (kernels only)")
    spec = pagedkv_run.spec or backend_name(backend)
    windows = getattr(backend, "cache_manager_windows", (None,))
    machine = machine_for(factory, windows=windows, layouts=manager_layouts(backend),
                          block_sizes=getattr(backend, "cache_manager_block_sizes", (1, 2, 4)),
                          name=f"{backend_name(backend)}_manager")
    # a manager whose behaviour unfolds over long decodes (sliding-window eviction) asks for longer programs
    program_steps = getattr(backend, "cache_manager_steps", STEPS)
    path = pagedkv_run.case_file
    start = time.perf_counter()
    # one search per declared layout, each with the profile's programs
    steps = programs.run_per_layout(machine, manager_suite_settings(program_steps),
                                    database_key=property_key(PROPERTY, backend_name(backend)))
    measured = dict(examples=machine.examples_run, steps=machine.checks_run, seconds=time.perf_counter() - start)
    if steps is None:
        if is_program_file(str(path)):
            path.unlink()  # a program an earlier run of this test left, fixed since
        pagedkv_run.record(PROPERTY, backend, decide(SimpleNamespace(
            status="passed", reason=f"{machine.checks_run} steps, {machine.examples_run} programs in "
                                    f"{measured['seconds']:.1f} s", **measured), kind="manager"))
        return
    measured["first_failing_example"] = steps.first_failing_example
    programs.save(path, spec, steps.machine_class, steps, steps.error, test_id=pagedkv_run.node.nodeid,
                  examples=machine.examples_run, first_failing_example=steps.first_failing_example)
    replay = programs.replay_line(path, spec)
    failure = Failure(None, AssertionError(f"{steps.error} (program {steps.first_failing_example})"),
                      case_file=path, replay=replay)
    pagedkv_run.record(PROPERTY, backend, decide(SimpleNamespace(status="failed", failures=[failure], **measured),
                                                 kind="manager"))
    pytest.fail(f"cache manager {spec}: {steps.error}\n{programs.as_text(steps)}\nreplay: {replay}", pytrace=False)
