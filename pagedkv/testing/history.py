"""What a process did to a candidate before a case failed: its op calls and the cases that made them.

A kernel can fail only after earlier calls of the *process* (right for its first N calls, a cache that
fills up, a race every tenth call), and those calls may come from other properties than the failing one.
So every judged case is logged here per candidate object, process-wide (:func:`judged`), and every op
call the guard sees is counted (:func:`count_call`). A failure's case file records the last
:data:`KEEP` cases (``history``: each with its property) and how many op calls the process had made to
the candidate before the failing case (``calls_before``) and how many of those the recorded cases made
(``history_calls``): when they differ, the file says its history is incomplete, and replay repeats the
recorded cases until the candidate has had as many calls (:mod:`pagedkv.cli.replay`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

#: How many earlier cases a case file records, oldest first.
KEEP = 16


@dataclass(frozen=True)
class Earlier:
    """A snapshot of the process's earlier calls to one candidate.

    Attributes:
        cases: ``(check, case, calls)`` of the last :data:`KEEP` judged cases, oldest first (``calls``: the
            op calls that case made).
        calls_before: every op call the process made to the candidate so far.
    """

    cases: list = field(default_factory=list)
    calls_before: int = 0

    @property
    def history_calls(self) -> int:
        """The op calls the recorded cases made; less than :attr:`calls_before` when the log is incomplete."""
        return sum(calls for _, _, calls in self.cases)

    def to_record(self) -> dict:
        """The case-file fields: ``history`` (``{"check", "kind", "case"}`` each), ``calls_before``,
        ``history_calls``."""
        return {"history": [{"check": check, "kind": type(case).__name__, "case": case.to_dict()}
                            for check, case, _ in self.cases],
                "calls_before": self.calls_before, "history_calls": self.history_calls}


class _Log:
    def __init__(self, backend: Any):
        self.backend = backend  # held: the id stays this object's while it is logged
        self.calls = 0
        self.cases: collections.deque = collections.deque(maxlen=KEEP)


_LOGS: dict[int, _Log] = {}


def _log(backend: Any) -> _Log:
    log = _LOGS.get(id(backend))
    if log is None or log.backend is not backend:
        log = _LOGS[id(backend)] = _Log(backend)
    return log


def count_call(backend: Any) -> None:
    """One more op call of ``backend`` (the guard calls this for every call it sees)."""
    _log(backend).calls += 1


def calls(backend: Any) -> int:
    """The op calls of ``backend`` counted in this process."""
    return _log(backend).calls


def earlier(backend: Any) -> Earlier:
    """The snapshot to take before a case runs (what its case file records should it fail)."""
    log = _log(backend)
    return Earlier(list(log.cases), log.calls)


def judged(backend: Any, check: str, case: Any, calls_before: int) -> None:
    """Log a case of ``check`` judged on ``backend`` (passed or failed), which started at ``calls_before``."""
    log = _log(backend)
    if hasattr(case, "to_dict"):
        log.cases.append((check, case, log.calls - calls_before))
