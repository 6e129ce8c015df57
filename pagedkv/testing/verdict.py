"""The verdict policy: one function (:func:`decide`) turns what a run found into passed / failed /
finding / skipped, for the properties, the regression case files and the cache-manager machine alike;
:func:`count` adds the verdicts up for the terminal summary, the no-false-green rule and the JSON.

- *passed*, *failed*: judged (``judged = passed + failed``). A failure is any exception from the
  candidate for an input in its declared space, ``MissingOp`` raised from inside an op call included,
  a guard ``ContractViolation``, a difference past a declared non-promise's bound, a crash or a timeout.
- *finding*: a difference within a declared non-promise's bound
  (:mod:`pagedkv.testing.non_promises`), or a failure on cases breaking a declared precondition.
  Counted apart, never as judged; a property's finding stays in the share's denominator.
- *skipped*: the gate decided it cannot judge, with a :class:`SkipReason` (never read from a message).
  :data:`NOT_APPLICABLE` reasons leave the share's denominator; the others count against it.

Precondition runs (``test_finding_outside_declared_preconditions``) add findings only: their passes do
not raise the share. A search that found a failure is never downgraded to a skip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SkipReason(str, enum.Enum):
    """Why the gate did not judge a property (the JSON's ``skipped_by_reason`` keys)."""

    MISSING_OP = "missing_op"  # the candidate provides no op the property needs
    FEATURE_NOT_DECLARED = "feature_not_declared"  # an optional feature it does not declare: not covered
    NOT_APPLICABLE = "not_applicable"  # the property is about another page-table format, or judged elsewhere
    NO_CACHE_MANAGER = "no_cache_manager"  # a kernels-only candidate and the cache-manager machine
    OUTSIDE_DECLARED_SPACE = "outside_declared_space"  # the property cannot be drawn in the declared space
    NOT_EXPRESSIBLE = "not_expressible"  # a regression case with no faithful form in the declared space
    CASE_REJECTED = "case_rejected"  # a fixed case the property's own assumption rejects
    MACHINE_LIMIT = "machine_limit"  # this machine cannot run it (device memory, lazily backed pools)
    BUDGET_SPENT = "budget_spent"  # a time budget stopped the search (``$PAGEDKV_TEST_BUDGET_S``): not judged


#: Skips that leave the judged share's denominator: nothing the candidate declares could be judged there.
NOT_APPLICABLE = frozenset({SkipReason.MISSING_OP, SkipReason.FEATURE_NOT_DECLARED, SkipReason.NOT_APPLICABLE,
                            SkipReason.NO_CACHE_MANAGER})

#: The judged share the quick start (a candidate named) and the ``ci`` profile require unless
#: ``--pagedkv-min-judged`` / ini ``pagedkv_min_judged`` lowers it explicitly: two properties in three
#: of those the candidate's ops allow. A candidate judged on less is mostly outside its own declared
#: space or hidden behind non-promises, and a green run would say little about it.
DEFAULT_MIN_JUDGED = 2 / 3


class Skip(str):
    """A skip's text carrying its :class:`SkipReason` (``Skip("...", SkipReason.MISSING_OP)``); a plain
    ``str`` where a skip is expected means :attr:`SkipReason.OUTSIDE_DECLARED_SPACE`."""

    reason: SkipReason

    def __new__(cls, text: str, reason: SkipReason) -> Skip:
        self = super().__new__(cls, text)
        self.reason = reason
        return self


def skip_reason(text: Any) -> SkipReason:
    """The :class:`SkipReason` of a skip's text (:class:`Skip`), else ``OUTSIDE_DECLARED_SPACE``."""
    return getattr(text, "reason", SkipReason.OUTSIDE_DECLARED_SPACE)


@dataclass
class Verdict:
    """One test's verdict: ``status`` (``passed``, ``failed``, ``finding``, ``skipped``), ``kind``
    (``property``, ``regression``, ``manager``, ``precondition``), the message, the skip reason, the
    failures or findings (each with its case file and replay command), the declared non-promise, and for
    the manager machine its declarations (:func:`pagedkv.testing.managers.declarations.summarize`)."""

    status: str
    kind: str = "property"
    message: str = ""
    skip: SkipReason | None = None
    failures: list = field(default_factory=list)
    non_promise: dict | None = None
    measured: dict = field(default_factory=dict)
    declarations: dict | None = None


def decide(outcome: Any, *, kind: str = "property", violating: bool = False, declared: Any = None) -> Verdict:
    """The verdict of one run (:class:`pagedkv.testing.execute.Outcome`, or anything with its ``status``,
    ``reason``, ``skip``, ``failures`` and ``findings``).

    Args:
        kind: ``property``, ``regression``, ``manager`` or ``precondition`` (cases breaking a declared
            precondition: a failure there is a finding, a pass counts nowhere).
        violating: the run drew cases breaking a declared precondition (the kind becomes ``precondition``).
        declared: the candidate's :class:`~pagedkv.backends.capabilities.NonPromise` of the property, if any.
    """
    kind = "precondition" if violating else kind
    promise = declared.as_dict() if declared is not None else None
    measured = measured_of(outcome)
    status = getattr(outcome, "status", "passed")
    if status == "partial":  # a search the time budget cut short judged no promise: it counts against the share
        return Verdict("skipped", kind, str(outcome.reason), SkipReason.BUDGET_SPENT, measured=measured)
    if status == "skipped":
        skip = getattr(outcome, "skip", None) or skip_reason(outcome.reason)
        return Verdict("skipped", kind, str(outcome.reason), skip)
    if status == "failed":
        first = outcome.failures[0].first_line if outcome.failures else str(getattr(outcome, "reason", ""))
        return Verdict("finding" if kind == "precondition" else "failed", kind, first,
                       failures=list(outcome.failures), non_promise=promise, measured=measured)
    findings = list(getattr(outcome, "findings", ()))
    if findings:
        return Verdict("finding", kind, findings[0].first_line, failures=findings, non_promise=promise,
                       measured=measured)
    return Verdict("passed", kind, str(getattr(outcome, "reason", "") or ""), measured=measured)


#: What a run measured, as the JSON verdict's ``measured`` holds it: the examples (state machines: the
#: programs) that ran, the first failing one (1-based; 0 when none failed), the steps a state machine
#: judged, the seconds.
MEASURED = ("examples", "first_failing_example", "steps", "seconds")


def measured_of(outcome: Any) -> dict:
    """The :data:`MEASURED` fields ``outcome`` carries (seconds rounded to 0.01)."""
    found = {name: getattr(outcome, name) for name in MEASURED
             if isinstance(getattr(outcome, name, None), (int, float))}
    if "seconds" in found:
        found["seconds"] = round(found["seconds"], 2)
    return found


def empty_counts() -> dict:
    return {"passed": 0, "failed": 0, "findings": 0, "skipped_by_reason": {}}


def count(verdicts: list[dict]) -> dict:
    """Add up recorded verdicts (as :meth:`pagedkv.testing.report.TestRun.record` stores them) of one
    candidate: ``{"properties": {...}, "regressions": {...}}``, each with ``passed``, ``failed``,
    ``judged`` (= passed + failed), ``findings``, ``skipped`` and ``skipped_by_reason``; the properties'
    also ``applicable`` (judged + their findings + skips that count against them) and ``judged_fraction``.
    Properties include the cache-manager machine; precondition runs add findings only."""
    props, regs = empty_counts(), empty_counts()
    against = 0
    for v in verdicts:
        into = regs if v["kind"] == "regression" else props
        if v["kind"] == "precondition":
            props["findings"] += v["status"] == "finding"
            continue
        if v["status"] == "skipped":
            reason = v.get("skip") or SkipReason.OUTSIDE_DECLARED_SPACE.value
            into["skipped_by_reason"][reason] = into["skipped_by_reason"].get(reason, 0) + 1
            if into is props and SkipReason(reason) not in NOT_APPLICABLE:
                against += 1
            continue
        into[{"passed": "passed", "failed": "failed", "finding": "findings"}[v["status"]]] += 1
    for c in (props, regs):
        c["judged"] = c["passed"] + c["failed"]
        c["skipped"] = sum(c["skipped_by_reason"].values())
    own_findings = sum(1 for v in verdicts if v["kind"] in ("property", "manager") and v["status"] == "finding")
    props["applicable"] = props["judged"] + own_findings + against
    props["judged_fraction"] = round(props["judged"] / props["applicable"], 4) if props["applicable"] else None
    return {"properties": props, "regressions": regs}
