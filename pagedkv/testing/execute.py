"""The execution core: the one place a property runs on backends.

Every entry point calls it: the pytest suite (:mod:`pagedkv.testing.suite`), the regression and
limit tests, ``python -m pagedkv replay`` / ``mutants`` / ``fuzz`` / ``peers`` and the mutation
command. So they agree on what is skipped and why (:meth:`Property.cannot_run
<pagedkv.testing.registry.Property.cannot_run>`), where cases are drawn
(:meth:`~pagedkv.testing.registry.Property.strategy_in`, inside the declared space), which explicit
examples run, when a case file is written and what a failure says.

- :func:`run`: a Hypothesis search of one property (explicit examples first), stopping at the first
  failing example and shrinking it unless the settings say otherwise;
- :func:`run_case`: one fixed case (a case file, a regression, a limit), the same case-file and
  message rules;
- :func:`run_record`: a case file's record, on the recorded or a given backend.

Case files: each example is written to ``case_file`` *before* the backend runs (``"outcome":
"running"``) and removed when it passes, so a crash leaves it behind. When Hypothesis reports
several distinct failures, each gets a file of its own (``NAME.json``, ``NAME-2.json``, ...) and a
replay line of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.testing import history as process_history
from pagedkv.testing.candidate import Candidate, OpCalls, candidate as candidate_of
from pagedkv.testing.compare import BudgetSpent, MissingOp  # BudgetSpent: re-exported
from pagedkv.testing.hypothesis_internals import failure_origin, set_database_key
from pagedkv.testing.non_promises import bounded as bound_in_force
from pagedkv.testing.verdict import Skip, SkipReason, skip_reason

#: How many cases run before a failing one its case file records (``history``, process-wide: any property's),
#: oldest first: replay reruns them in order (:mod:`pagedkv.testing.history`).
HISTORY = process_history.KEEP


class _OpMissing(BaseException):
    """Stops a search whose case needs an op the backend lacks (the gate's :func:`~pagedkv.testing.compare.
    require`, before any failure was found): the property is skipped, not passed."""


def _gate_skip(exc: MissingOp) -> Skip:
    """A ``MissingOp`` the gate raised (an op looked up, a check's cannot-run path): a skip with its reason."""
    return Skip(str(exc), SkipReason(getattr(exc, "reason", SkipReason.MISSING_OP.value)))


@dataclass
class Failure:
    """One distinct failure: the (shrunk) case, the exception, its case file and replay command."""

    case: Any
    error: BaseException
    case_file: Path | None = None
    replay: str = ""
    history: Any = None  # the process's earlier calls to the backend (pagedkv.testing.history.Earlier)

    @property
    def first_line(self) -> str:
        text = next((line for line in str(self.error).splitlines() if line.strip()), "")
        return f"{type(self.error).__name__}: {text}" if not isinstance(self.error, AssertionError) else text


@dataclass
class Outcome:
    """What one run of a property found.

    ``status`` is ``"passed"``, ``"failed"``, ``"skipped"`` (``reason`` says why it could not be judged,
    ``skip`` as a :class:`~pagedkv.testing.verdict.SkipReason`) or ``"partial"`` (the time budget ran out
    after ``examples`` passing examples). ``examples`` counts the examples that ran (the state machine:
    its runs); ``findings`` are differences within a declared non-promise's bound (the first case's,
    with its case file), ``bound`` that bound in words.
    """

    prop: str
    status: str = "passed"
    reason: str = ""
    examples: int = 0
    first_failing_example: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    findings: list[Failure] = field(default_factory=list)
    skip: SkipReason | None = None
    bound: str = ""

    def skipped(self, reason: str) -> Outcome:
        """Mark skipped with ``reason`` (a :class:`~pagedkv.testing.verdict.Skip` or text)."""
        self.status, self.reason, self.skip = "skipped", str(reason), skip_reason(reason)
        return self

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def first_line(self) -> str:
        return self.failures[0].first_line if self.failures else self.reason

    @property
    def examples_judged(self) -> int:
        """Examples run up to and including the first failing one (all of them when none failed; 0 when
        skipped): what the mutation tables count."""
        if self.status == "skipped":
            return 0
        return (self.first_failing_example or 1) if self.failed else self.examples


def _with_reference(prop: Any, backends: tuple) -> tuple:
    """A pair property compares the candidate (last) with a reference: pagedkv's ``indexed`` by default."""
    if prop.pair and len(backends) == 1:
        from pagedkv.backends import get_backend

        return (get_backend("indexed"), backends[0])
    return backends


def call(prop: Any, backends: tuple, case: Any, device: str, candidate: Candidate | None = None,
         bound: Any = None) -> None:
    """Check ``case`` on ``backends`` (``(reference, candidate)`` for a pair property, else one backend),
    the candidate's ops under a fresh guard, and under the bound of its declared non-promise of ``prop``.

    Args:
        candidate: the run's :class:`~pagedkv.testing.candidate.Candidate` of ``backends[-1]`` (``None``:
            built here).
        bound: the :class:`~pagedkv.testing.non_promises.Bound` of the candidate's non-promise of ``prop``
            (``None``: the strict bar); each difference it lets through is appended to its ``seen``.

    Raises:
        Mismatch (an ``AssertionError``): the property fails. MissingOp: the gate found an op missing.
        Exception: whatever the candidate raised (``MissingOp`` from inside an op call as
        :class:`~pagedkv.testing.candidate.OpRaisedMissingOp`).
    """
    __tracebackhide__ = True
    from pagedkv.testing.cases.memory import pool_layout

    backends = _with_reference(prop, tuple(backends))
    candidate = candidate if candidate is not None else candidate_of(backends[-1])
    guard, ops = candidate.view()  # the output and input contract of every op call
    calls_before = process_history.calls(backends[-1])
    try:
        with pool_layout(candidate.declared.layout), bound_in_force(bound):  # memory order; compared as NHD
            if prop.pair:
                prop.check(backends[0], ops, case, device)
            else:
                prop.check(ops, case, device)
        guard.judge_again(seed=getattr(case, "seed", 0) or 0)  # the same bits again, after other values
    finally:  # passed or not, the calls happened: a later failure's case file records them
        process_history.judged(backends[-1], prop.name, case, calls_before)


def replay_command(path: Path | str, impl: str | None = None, device: str = "cpu", other: str | None = None) -> str:
    """The command that reruns a case file; ``--impl`` / ``--other`` when the file may not name them itself."""
    from pagedkv.testing.casefiles.reading import trusted_backend_spec

    cmd = f"python -m pagedkv replay {path}"
    if impl and not trusted_backend_spec(impl):
        cmd += f" --impl {impl}"
    if other and not trusted_backend_spec(other):
        cmd += f" --other {other}"
    return cmd + ("" if device == "cpu" else f" --device {device}")


def _rejections() -> tuple:
    """The exceptions that reject a case instead of failing it (Hypothesis' ``assume``)."""
    try:
        from hypothesis.errors import UnsatisfiedAssumption
    except ImportError:  # replays run without Hypothesis
        return ()
    return (UnsatisfiedAssumption,)


class _Recorder:
    """Writes the case file of each example before it runs and keeps one file per distinct failure
    (``NAME.json``, ``NAME-2.json``, ...); once a failure is on disk, later examples run under
    ``NAME-running.json`` so shrinking never overwrites it."""

    def __init__(self, prop: Any, spec: str, other: str | None, case_file: Path | None, device: str):
        self.prop, self.spec, self.other, self.base, self.device = prop, spec, other, case_file, device
        self.by_origin: dict[tuple, Failure] = {}
        self.by_error: dict[int, Failure] = {}

    def _path(self, index: int) -> Path:
        assert self.base is not None
        return self.base if index == 0 else self.base.with_name(f"{self.base.stem}-{index + 1}{self.base.suffix}")

    @property
    def running(self) -> Path | None:
        if self.base is None:
            return None
        return self.base if not self.by_origin else self.base.with_name(f"{self.base.stem}-running{self.base.suffix}")

    def before(self, case: Any) -> None:
        from pagedkv.testing.casefiles.writing import save_failure

        if self.running is not None:
            save_failure(self.prop.name, self.spec, case, other=self.other, outcome="running", path=self.running)

    def passed(self) -> None:
        if self.running is not None:
            self.running.unlink(missing_ok=True)

    def _save(self, failure: Failure, path: Path) -> None:
        """Write ``failure``'s case file at ``path`` (outcome ``failed`` for an assertion, else ``raised``)."""
        from pagedkv.testing.casefiles.writing import save_failure

        exc = failure.error
        outcome = "failed" if isinstance(exc, AssertionError) else "raised"
        error = str(exc) if outcome == "failed" else f"{type(exc).__name__}: {exc}"
        earlier = failure.history or process_history.Earlier()
        failure.case_file = save_failure(self.prop.name, self.spec, failure.case, other=self.other, outcome=outcome,
                                         error=error, path=path, extra=earlier.to_record())
        failure.replay = replay_command(path, self.spec, self.device, self.other)

    def finding(self, case: Any, message: str, history: Any = None) -> Failure:
        """A difference within a declared non-promise's bound: its case file, ``NAME-finding.json``
        (replayed at the strict bar, it fails), in place of the running one."""
        from pagedkv.testing.casefiles.writing import save_failure

        finding = Failure(case, AssertionError(message), history=history)
        if self.base is not None:
            path = self.base.with_name(f"{self.base.stem}-finding{self.base.suffix}")
            finding.case_file = save_failure(self.prop.name, self.spec, case, other=self.other, outcome="failed",
                                             error=message, path=path,
                                             extra=(history or process_history.Earlier()).to_record())
            finding.replay = replay_command(path, self.spec, self.device, self.other)
        self.passed()
        return finding

    def failed(self, case: Any, exc: BaseException, history: Any = None) -> Failure:
        origin = failure_origin(exc)
        running = self.running
        origins = list(self.by_origin)
        failure = Failure(case, exc, history=history)
        if self.base is not None:
            path = self._path(origins.index(origin) if origin in origins else len(origins))
            self._save(failure, path)
            if running is not None and running != path:
                running.unlink(missing_ok=True)
        self.by_origin[origin] = failure  # shrinking replaces a failure by its smaller case
        self.by_error[id(exc)] = failure  # the exception Hypothesis reports in the end is this object
        return failure

    def finish(self, errors: list[BaseException]) -> list[Failure]:
        """One failure, case file and replay line per exception Hypothesis reports in the end
        (``NAME.json``, ``NAME-2.json``, ...); files of failures seen only while shrinking are removed."""
        final = []
        for i, error in enumerate(errors):
            found = self.by_error.get(id(error)) or self.by_origin.get(failure_origin(error))
            failure = Failure(found.case if found else None, error, history=found.history if found else None)
            if self.base is not None and failure.case is not None:
                self._save(failure, self._path(i))
            final.append(failure)
        keep = {f.case_file for f in final}
        for old in self.by_origin.values():
            if old.case_file is not None and old.case_file not in keep:
                old.case_file.unlink(missing_ok=True)
        if self.running is not None and self.running not in keep:
            self.running.unlink(missing_ok=True)
        return final


def run_case(prop: Any, backends: tuple, case: Any, device: str = "cpu", *, spec: str | None = None,
             other: str | None = None, case_file: Path | None = None, bounded: bool = True) -> Outcome:
    """Run one fixed ``case`` of ``prop`` (a case file, a regression, a limit test).

    Args:
        prop: a registered :class:`~pagedkv.testing.registry.Property`.
        backends: the candidate, or ``(reference, candidate)`` for a pair property.
        case: a case of the property's kind.
        device: where tensors live.
        spec: the candidate's spec, recorded in the case file (default: its name).
        other: the reference's spec of a pair property (recorded).
        case_file: where the case is written before it runs (removed when it passes; ``None``: nowhere).
        bounded: judge under the bound of the candidate's declared non-promise of ``prop`` (a difference
            within it is a finding, ``outcome.findings``); ``False``: at the strict bar (a replay).

    Returns:
        An :class:`Outcome` with ``status`` ``passed``, ``failed`` (one :class:`Failure`) or ``skipped``
        (the gate found an op the property needs missing, or the property rejects the case).
    """
    from pagedkv.backends import backend_name

    backends = _with_reference(prop, tuple(backends))
    outcome = Outcome(prop.name)
    chosen = candidate_of(backends[-1])
    recorder = _Recorder(prop, spec or backend_name(backends[-1]), other if prop.pair else None, case_file, device)
    start = time.perf_counter()
    recorder.before(case)
    bound = chosen.bound(prop.name) if bounded else None
    outcome.bound = bound.describe() if bound is not None else ""
    earlier = process_history.earlier(backends[-1])
    try:
        call(prop, backends, case, device, chosen, bound)
    except MissingOp as exc:  # the gate's own look-up (a candidate's is OpRaisedMissingOp): nothing ran
        recorder.passed()
        outcome.skipped(_gate_skip(exc))
    except _rejections() as exc:  # the case breaks the property's assumption: nothing was judged
        recorder.passed()
        outcome.skipped(Skip(f"the case is rejected by the property ({type(exc).__name__})", SkipReason.CASE_REJECTED))
    except Exception as exc:  # noqa: BLE001 - any exception from a backend is a failure, reported with its case
        outcome.status, outcome.examples, outcome.first_failing_example = "failed", 1, 1
        outcome.failures.append(recorder.failed(case, exc, earlier))
    else:
        outcome.examples = 1
        if bound is not None and bound.seen:  # within the declared bound: a finding, its case file kept
            outcome.findings.append(recorder.finding(case, bound.seen[0], earlier))
        else:
            recorder.passed()
    outcome.seconds = time.perf_counter() - start
    return outcome


def run(prop: Any, backends: tuple, device: str = "cpu", settings: Any = None, *, caps: Any = None,
        spec: str | None = None, other: str | None = None, case_file: Path | None = None,
        on_example: Callable[[], None] | None = None, explicit: bool = True, budget_s: float = 0.0,
        database_key: bytes | None = None, overrides: dict | None = None, violating: bool = False,
        after_pass: Callable[[tuple, Any], None] | None = None, seed: int | None = None) -> Outcome:
    """Search ``prop`` on ``backends`` with Hypothesis: explicit examples first (when ``explicit``), then
    cases drawn inside the declared space, shrinking a failure unless ``settings`` leave out the shrink phase.

    Args:
        prop: a registered :class:`~pagedkv.testing.registry.Property`.
        backends: the candidate, or ``(reference, candidate)`` for a pair property.
        device: where tensors live.
        settings: Hypothesis settings (``None``: the loaded profile as
            :func:`pagedkv.testing.settings.suite_settings` makes it); ``max_examples`` is capped by the
            property's own cap and by :func:`pagedkv.testing.space.example_cap`.
        caps: the declared space to draw in (``None``: :func:`pagedkv.testing.space.capabilities_under_test`
            of the candidate, drawing space).
        spec, other: the specs recorded in case files (default: the backends' names).
        case_file: the case file of this run (``None``: none is written).
        on_example: called before each example runs (fuzz workers count with it).
        explicit: run the property's explicit examples that fit ``caps``.
        budget_s: stop after this many seconds without a failure (``status`` ``"partial"``); 0: no budget.
        database_key: the example database key (see :func:`pagedkv.testing.databases.property_key`).
        overrides: strategy keyword arguments (a finding draws cases that break a precondition).
        violating: the explicit examples that break the declared precondition instead of those that keep it.
        after_pass: ``after_pass(backends, case)`` after each passing example (the baseline comparison of
            :mod:`pagedkv.tools.baseline.gate`); what it raises fails that example, and is shrunk.
        seed: Hypothesis' random seed (independent runs of the kill-rate table); ``None``: the settings decide.

    Returns:
        An :class:`Outcome`; a failure's exception is in ``outcome.failures`` (never raised here).

    Raises:
        Exception: a harness error (Hypothesis raised although no example failed, e.g. an unsatisfiable
            strategy).
    """
    import hypothesis
    from hypothesis import given

    from pagedkv.backends import backend_name
    from pagedkv.testing import specialisations
    from pagedkv.testing.settings import suite_settings
    from pagedkv.testing.space import example_cap

    backends = _with_reference(prop, tuple(backends))
    outcome = Outcome(prop.name)
    chosen_candidate = candidate_of(backends[-1], caps)
    caps = chosen_candidate.space
    reason = prop.cannot_run(backends, caps)
    if reason:
        return outcome.skipped(reason)
    bound = chosen_candidate.bound(prop.name)
    outcome.bound = bound.describe() if bound is not None else ""
    chosen = settings if settings is not None else suite_settings()
    cap = example_cap(backends, chosen.max_examples)
    if cap is not None and prop.kind == "machine":
        cap //= 3  # a run of the state machine is 50 steps: a third of the examples under Triton's interpreter
    limit = min(x for x in (prop.max_examples, cap, chosen.max_examples) if x is not None)
    if limit < chosen.max_examples:
        chosen = hypothesis.settings(chosen, max_examples=limit)
    start = time.perf_counter()
    if prop.kind == "machine":  # a Hypothesis state machine: it prints its own shrunk steps, no case file
        return _run_machine(prop, chosen_candidate, device, chosen, outcome, start)
    recorder = _Recorder(prop, spec or backend_name(backends[-1]), (other or backend_name(backends[0]))
                         if prop.pair else None, case_file, device)
    state = {"calls": 0}
    rejections = _rejections()

    def body(case):
        __tracebackhide__ = True
        if budget_s and not recorder.by_origin and time.perf_counter() - start > budget_s:
            raise BudgetSpent
        state["calls"] += 1
        if on_example is not None:
            on_example()
        recorder.before(case)
        specialisations.record(prop.ops, case, caps)  # what a GPU run compiles for this example
        seen = len(bound.seen) if bound is not None else 0
        earlier = process_history.earlier(backends[-1])
        try:
            call(prop, backends, case, device, chosen_candidate, bound)
            if after_pass is not None:
                after_pass(backends, case)
        except MissingOp as exc:
            if not recorder.by_origin:  # the gate's look-up before anything failed: the property is skipped
                recorder.passed()
                raise _OpMissing(_gate_skip(exc)) from None
            outcome.first_failing_example = outcome.first_failing_example or state["calls"]
            recorder.failed(case, exc, earlier)  # a search that failed is never downgraded to a skip
            raise
        except rejections:  # assume() rejected the case: not a failure, no case file
            recorder.passed()
            raise
        except Exception as exc:
            outcome.first_failing_example = outcome.first_failing_example or state["calls"]
            recorder.failed(case, exc, earlier)
            raise
        if bound is not None and len(bound.seen) > seen and not outcome.findings:
            outcome.findings.append(recorder.finding(case, bound.seen[seen], earlier))
        else:
            recorder.passed()

    test = given(prop.strategy_in(caps, **(overrides or {})))(body)
    if explicit:
        for case in reversed(prop.examples_in(caps, violating=violating)):
            test = hypothesis.example(case)(test)
    test = chosen(test)
    if seed is not None:
        test = hypothesis.seed(seed)(test)
    set_database_key(test, database_key or f"{prop.name}/{violating}".encode())
    try:
        test()
    except _OpMissing as exc:
        outcome.skipped(exc.args[0])
    except BudgetSpent:
        outcome.status = "partial"
        outcome.reason = (f"time budget of {budget_s:g} s spent: {state['calls']} examples passed, "
                          f"the remaining examples did not run")
    except BaseException as exc:  # noqa: BLE001 - Hypothesis re-raises the shrunk failure(s)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or not recorder.by_origin:
            raise  # an interrupt, or a harness error: no example failed
        errors = list(getattr(exc, "exceptions", None) or [exc])  # an exception group: several failures
        outcome.status = "failed"
        outcome.failures = recorder.finish(errors)
        for finding in outcome.findings:  # the failure is the verdict: no finding's file beside its own
            if finding.case_file is not None:
                finding.case_file.unlink(missing_ok=True)
        outcome.findings = []
    outcome.examples = state["calls"]
    outcome.seconds = time.perf_counter() - start
    return outcome


def _run_machine(prop: Any, candidate: Candidate, device: str, chosen: Any, outcome: Outcome,
                 start: float) -> Outcome:
    """Run a state-machine property; ``outcome.examples`` is the number of runs of the machine that started."""
    from pagedkv.testing.cases.memory import pool_layout
    from pagedkv.testing.guard import GuardedBackend
    from pagedkv.testing.managers.kernel_property import RUNS_STARTED
    from pagedkv.testing.space import as_declared_layout

    started = RUNS_STARTED[0]
    try:
        with pool_layout(candidate.space.layout):
            guard = GuardedBackend(candidate.backend, candidate.declared)
            ops = as_declared_layout(OpCalls(guard, candidate.provided), candidate.declared)
            prop.check(ops, device, chosen, candidate.space)
    except MissingOp as exc:
        outcome.skipped(_gate_skip(exc))
    except Exception as exc:  # noqa: BLE001 - the state machine's failure, steps printed by Hypothesis
        outcome.status = "failed"
        outcome.failures.append(Failure(None, exc))
    outcome.examples = RUNS_STARTED[0] - started
    outcome.seconds = time.perf_counter() - start
    return outcome


def run_record(record: dict, backend: Any | None = None, device: str = "cpu", *, other: Any | None = None,
               case_file: Path | None = None, bounded: bool = False) -> Outcome:
    """Rerun a case file's record (:func:`pagedkv.testing.casefiles.reading.load_case_file`): its property
    on ``backend`` (default: the recorded one) and, for a pair property, ``other`` (default: the recorded
    ``other``, else ``indexed``); at the strict bar unless ``bounded`` (:func:`run_case`).

    Raises:
        KeyError: the record names no registered property.
        pagedkv.errors.CaseFileError: the property runs on another kind of case than the file holds.
    """
    from pagedkv.backends import load_backend
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.registry import property_for_record

    prop = property_for_record(record["check"])
    kind = {"case": "Case", "scenario": "CacheScenario", "invalid": "InvalidCall", "limit": "LimitCase"}.get(prop.kind)
    if kind != record.get("kind", "Case"):
        raise CaseFileError("kind", f"property {prop.name!r} runs on a {kind or 'state machine'}, but the file "
                                    f"holds a {record.get('kind', 'Case')}")
    impl = backend if backend is not None else load_backend(record["backend"])
    backends: tuple = (impl,)
    if prop.pair:
        backends = (other if other is not None else load_backend(record.get("other") or "indexed"), impl)
    return run_case(prop, backends, record["case"], device, spec=record.get("backend"), other=record.get("other"),
                    case_file=case_file, bounded=bounded)
