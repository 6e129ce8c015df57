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
from typing import NamedTuple

import pytest

from pagedkv.backends import backend_name
from pagedkv.testing.databases import property_key
from pagedkv.testing.execute import Failure
from pagedkv.testing.managers import declarations
from pagedkv.testing.managers.calls import call_manager
from pagedkv.testing.managers.casefile import is_program_file
from pagedkv.testing.managers.protocol import ManagerConfig, layout_groups, layout_retention, manager_factory
from pagedkv.testing.settings import manager_suite_settings
from pagedkv.testing.verdict import SkipReason, decide

pytestmark = pytest.mark.pagedkv

#: Rules per program of the machine.
STEPS = 30
#: The property name of the machine in the verdict and the example database.
PROPERTY = "cache_manager"


def test_cache_manager(pagedkv_run, backend, manager_layout):
    """Every live request reads back, through its block table, the K/V of its own tokens (namespace,
    prefix, extra keys, position, layer), and the manager's counts, hits and holds add up: one search in
    ``manager_layout``, one of the layouts the candidate declares (``cache_manager_layouts``; each its own
    test, so ``pytest -n auto`` spreads a hybrid manager's layouts over the workers)."""
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.api_rules import ApiRules
    from pagedkv.testing.managers.machine import machine_for

    factory = manager_factory(backend)
    if factory is None:
        pagedkv_run.record(PROPERTY, backend, decide(
            SimpleNamespace(status="skipped", reason="no cache_manager", skip=SkipReason.NO_CACHE_MANAGER),
            kind="manager"))
        pytest.skip("cache_manager: the candidate provides no cache_manager factory (kernels only)")
    prop = layout_property(manager_layout)
    spec = pagedkv_run.spec or backend_name(backend)
    windows = getattr(backend, "cache_manager_windows", (None,))
    block_sizes = getattr(backend, "cache_manager_block_sizes", (1, 2, 4))
    probe = probe_manager(factory, manager_layout, block_sizes[0], windows[0])
    if probe.missing is not None:  # an install problem, not a program to shrink and keep
        pagedkv_run.record(prop, backend, decide(
            SimpleNamespace(status="failed", failures=[Failure(None, probe.missing)]), kind="manager"))
        pytest.fail(f"cache manager {spec} cannot run here (no program ran): {probe.missing}", pytrace=False)
    # a manager declaring how it refuses misuse (capabilities.misuse) is judged on it: the API rules mixed in
    rule_sets = (ApiRules,) if probe.misuse else ()
    machine = machine_for(factory, windows=windows, layouts=(manager_layout,), block_sizes=block_sizes,
                          name=f"{backend_name(backend)}_manager", rule_sets=rule_sets, probed_misuse=probe.misuse)
    # a manager whose behaviour unfolds over long decodes (sliding-window eviction) asks for longer programs
    program_steps = getattr(backend, "cache_manager_steps", STEPS)
    path = pagedkv_run.case_file
    start = time.perf_counter()
    steps = programs.run_per_layout(machine, manager_suite_settings(program_steps),
                                    database_key=property_key(PROPERTY, backend_name(backend))
                                    + b"/" + manager_layout.encode())
    measured = dict(examples=machine.examples_run, steps=machine.checks_run, seconds=time.perf_counter() - start)
    # what the search covered, beside the declarations: a manager that narrows its sizes, or behaves otherwise
    # in pools larger than these, is judged on these alone
    pools = sorted(machine.pools_seen)
    searched = dict(block_sizes=list(block_sizes), windows=list(windows), steps_per_program=program_steps,
                    pool_blocks=[pools[0], pools[-1]] if pools else [])

    def record(verdict) -> None:  # every verdict of the search says what it covered
        verdict.measured["searched"] = searched
        pagedkv_run.record(prop, backend, verdict)

    # what the declarations waived (a promise left off) and left undrawn, for the verdict's reader
    declared = declarations.summarize(tuple(seen) for seen in machine.capabilities_seen.values())
    unjudged = None
    if steps is None and not machine.tokens_read:  # every request refused: nothing the manager stores was read
        unjudged = (f"the manager served no request in {machine.examples_run} programs ({machine.checks_run} steps): "
                    f"every admission or reservation was refused, so no token was read back and nothing it stores "
                    f"was judged")
    elif steps is None and machine.hits_due and not machine.prefix_hits:  # every promised hit refused
        unjudged = (f"the hit promise gave {machine.hits_due} admissions a hit in {machine.examples_run} programs, "
                    f"but the manager served none of them one (each refused): the promise was never met")
    if unjudged:
        failure = Failure(None, AssertionError(unjudged))
        record(decide(SimpleNamespace(status="failed", failures=[failure], **measured), kind="manager"))
        pytest.fail(f"cache manager {spec} ({manager_layout}): {unjudged}", pytrace=False)
    if steps is None:
        if is_program_file(str(path)):
            path.unlink()  # a program an earlier run of this test left, fixed since
        verdict = decide(SimpleNamespace(
            status="passed", reason=f"{machine.checks_run} steps, {machine.examples_run} programs, "
                                    f"{machine.tokens_read} tokens read back in {measured['seconds']:.1f} s (block "
                                    f"sizes {tuple(block_sizes)}, windows {tuple(windows)}, pools of "
                                    f"{'-'.join(map(str, searched['pool_blocks']))} blocks)", **measured),
            kind="manager")
        verdict.declarations = declared
        record(verdict)
        return
    measured["first_failing_example"] = steps.first_failing_example
    programs.save(path, spec, steps.machine_class, steps, steps.error, test_id=pagedkv_run.node.nodeid,
                  examples=machine.examples_run, first_failing_example=steps.first_failing_example)
    replay = programs.replay_line(path, spec)
    failure = Failure(None, AssertionError(f"{steps.error} (program {steps.first_failing_example})"),
                      case_file=path, replay=replay)
    verdict = decide(SimpleNamespace(status="failed", failures=[failure], **measured), kind="manager")
    verdict.declarations = declared
    record(verdict)
    pytest.fail(f"cache manager {spec} ({manager_layout}): {steps.error}\n{programs.as_text(steps)}\n"
                f"replay: {replay}", pytrace=False)


def layout_property(layout: str) -> str:
    """The property a layout's search is recorded as in the verdict: ``cache_manager[<layout>]``."""
    return f"{PROPERTY}[{layout}]"


def probe_config(layout: str, block_size: int, window_left) -> ManagerConfig:
    """A small pool of ``layout`` at ``block_size`` and ``window_left`` (window 1 in a hybrid layout): what the
    suite builds a manager with before its search."""
    groups = layout_groups(layout, block_size, 1)
    return ManagerConfig(8, block_size, None if groups else window_left, 2, groups=groups,
                         retention_interval=layout_retention(layout, block_size, 1))


class Probe(NamedTuple):
    """What building a manager for :func:`probe_config` told the suite before its search."""

    #: The ``BackendUnavailableError`` the factory raised (a dependency missing in this layout), or ``None``.
    missing: Exception | None
    #: Whether the manager declares ``capabilities.misuse`` (False where it could not be built).
    misuse: bool


def probe_manager(factory, layout: str, block_size: int, window_left) -> Probe:
    """Build one manager for :func:`probe_config` of ``layout`` and read what the search needs before it starts.

    A missing dependency of one layout only (vLLM's hybrid peer needs Triton for its slot mapping, its one-group
    manager does not) shows before the search, not as a shrunk program after hundreds of others. Any other
    exception (from the factory or from ``capabilities``) is left to the search, which reports it with the
    program that raised it; a control signal (``pytest.skip``, ``SystemExit``) raised here is a failure.
    """
    from pagedkv.errors import BackendUnavailableError

    try:
        manager = call_manager("the manager factory", factory, probe_config(layout, block_size, window_left))
    except BackendUnavailableError as exc:
        return Probe(exc, False)
    except Exception:  # noqa: BLE001 - the search builds it again and reports the error with its program
        return Probe(None, False)
    try:
        return Probe(None, bool(call_manager("looking up capabilities", getattr, manager, "capabilities").misuse))
    except Exception:  # noqa: BLE001 - as above
        return Probe(None, False)
