"""One test per registered property (:mod:`pagedkv.testing.registry`), named ``test_<property>``.

Each runs its property through :func:`pagedkv.testing.execute.run`: cases drawn inside the backend's
declared space (:class:`~pagedkv.backends.capabilities.Capabilities`), the explicit examples that fit
it first, a skip with the reason when the property cannot be judged through the backend's ops or
space. A failure shows the property's sentence, the located mismatch, the case and its replay line.

A backend that declares a *precondition* (for example ``finite_unused_slots``) is also run, by
``test_finding_outside_declared_preconditions``, on cases that break it: a failure there is reported
as a finding (an ``xfail`` naming what happened, plus the case file), never hidden and never passed
off as conformance; its passes count nowhere. A property the backend declares it does not promise
exactly (``Capabilities.non_promises``, :mod:`pagedkv.testing.non_promises`) runs under the declared
bound: a difference within it is a finding with the declared reason and bound, anything else fails.
The verdict is :func:`pagedkv.testing.verdict.decide`'s.
"""

from __future__ import annotations

import os

import pytest

from pagedkv.backends import backend_name
from pagedkv.backends.capabilities import capabilities_of
from pagedkv.testing import execute
from pagedkv.testing.databases import property_key
from pagedkv.testing.non_promises import finding_reason as non_promise_finding
from pagedkv.testing.registry import Property, properties
from pagedkv.testing.report import failure_text
from pagedkv.testing.settings import suite_settings
from pagedkv.testing.verdict import decide

pytestmark = pytest.mark.pagedkv

#: What a precondition forbids, as the strategy override that draws cases breaking it.
VIOLATIONS = {"finite_unused_slots": {"poisons": ("nan", "inf")}}


def _judge(prop: Property, pagedkv_run, backends: tuple, device: str, **options) -> execute.Outcome:
    """Run ``prop`` on ``backends`` (the candidate last), record the verdict, skip or fail the test."""
    __tracebackhide__ = True
    candidate = backends[-1]
    config = pagedkv_run.node.config

    def after_pass(backends: tuple, case) -> None:  # other plugins' turn (--pagedkv-baseline: the replaced code)
        config.hook.pytest_pagedkv_case_passed(config=config, prop=prop, backends=backends, case=case, device=device,
                                        spec=pagedkv_run.spec or backend_name(candidate),
                                        case_file=pagedkv_run.case_file)

    outcome = execute.run(prop, backends, device, suite_settings(), spec=pagedkv_run.spec,
                          case_file=pagedkv_run.case_file,
                          budget_s=float(os.environ.get("PAGEDKV_TEST_BUDGET_S") or 0),
                          database_key=property_key(prop.name, *(backend_name(b) for b in backends)),
                          after_pass=after_pass, **options)
    violating = options.get("violating", False)
    declared = capabilities_of(candidate).non_promise(prop.name)
    verdict = decide(outcome, violating=violating, declared=declared)
    pagedkv_run.record(prop.name, candidate, verdict)
    if verdict.status == "skipped":
        pytest.skip(f"{prop.name}: {outcome.reason}")
    if verdict.status == "finding" and violating:
        return outcome  # the caller's xfail names the precondition
    if verdict.status == "finding":  # within the declared non-promise's bound: reported, never gating
        pytest.xfail(non_promise_finding(declared, outcome))
    if verdict.status == "failed":
        pytest.fail(failure_text(prop.sentence, outcome, candidate), pytrace=False)
    if outcome.status == "partial":
        pytest.skip(f"{prop.name}: {outcome.reason}")
    return outcome


def _make_test(prop: Property):
    if prop.pair:
        def run(pagedkv_run, backend_pair, device):
            _judge(prop, pagedkv_run, tuple(backend_pair), device)
    else:
        def run(pagedkv_run, backend, device):
            _judge(prop, pagedkv_run, (backend,), device)
    run.__name__ = run.__qualname__ = f"test_{prop.name}"
    run.__doc__ = prop.sentence
    return run


for _prop in properties().values():
    globals()[f"test_{_prop.name}"] = _make_test(_prop)

def test_finding_outside_declared_preconditions(pagedkv_run, finding, device):
    """Non-gating: a property on cases that break a precondition the backend declares (the plugin
    parametrizes ``finding`` as ``(backend, precondition, property)``)."""
    backend, precondition, prop = finding
    outcome = _judge(prop, pagedkv_run, (backend,), device, overrides=VIOLATIONS.get(precondition, {}),
                     violating=True)
    if outcome.failed:
        pytest.xfail(finding_reason(precondition, outcome))


def finding_reason(precondition: str, outcome: execute.Outcome) -> str:
    """The xfail reason of a finding: its first line and the replay command of its case file."""
    failure = outcome.failures[0]
    return (f"finding (outside the declared precondition '{precondition}'): {failure.first_line}"
            + (f"; replay: {failure.replay}" if failure.replay else ""))
