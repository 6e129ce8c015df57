"""Continuous fuzzing of the registered properties: N worker processes, a time budget, one example database.

Each worker process loads the candidate, opens the example database (:mod:`pagedkv.testing.databases`)
and, until the budget ends, runs the registered properties (:mod:`pagedkv.testing.registry`) in turn,
each as a Hypothesis test of ``batch`` examples with a fresh random seed. Every batch first replays
what the database holds for that property and backend (phase *reuse*), then searches (*generate*,
*target*) and shrinks what fails (*shrink*). A failing example is saved to the database by Hypothesis,
so every other worker, machine and later ``pytest`` run sharing that database replays it first; the
worker writes it as a JSON case file (:func:`pagedkv.testing.casefiles.reading.save_failure`) with the command
that replays it, and the property is not fuzzed further in this run. The explicit examples are not
run here (the suite runs them every time); fuzzing is for the long tail.

As in the pytest plugin, each example's case file is written *before* the backend runs (``outcome:
running``, one file per worker and property) and removed when it passes, so a worker killed by a
device fault or the out-of-memory killer leaves the case that did it.

The parent process only collects the workers' events from a queue and tells a progress object
(:class:`Quiet` shows nothing; ``python -m pagedkv fuzz`` prints).
"""

from __future__ import annotations

import os
import queue as queue_module
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedkv.testing.casefiles.writing import DEFAULT_FAILURE_DIR

if TYPE_CHECKING:
    from pagedkv.testing.execute import Outcome

#: Examples per batch (one Hypothesis run of one property, with a fresh seed) by default.
DEFAULT_BATCH = 100
#: After the budget, how long the parent waits for a batch (and its shrinking) to finish before it
#: stops the worker.
GRACE_SECONDS = 120.0


@dataclass(frozen=True)
class FuzzConfig:
    """What to fuzz, where, for how long.

    Attributes:
        impl: the candidate's spec (:func:`pagedkv.load_backend`).
        workers: worker processes.
        seconds: the time budget; a batch running when it ends is finished (see :data:`GRACE_SECONDS`).
        database: the example database URL (:func:`pagedkv.testing.databases.open_database`).
        properties: property names to fuzz; empty: every registered property.
        device: the tensors' device; ``None``: ``cuda:<worker % device_count>`` when CUDA is present, else cpu.
        batch: examples per batch (a property's own ``max_examples`` caps it).
        failure_dir: where case files go.
        interval: seconds between progress lines.
    """

    impl: str
    workers: int = 1
    seconds: float = 60.0
    database: str | None = None
    properties: tuple[str, ...] = ()
    device: str | None = None
    batch: int = DEFAULT_BATCH
    failure_dir: Path = Path(DEFAULT_FAILURE_DIR)
    interval: float = 10.0


@dataclass
class Failure:
    """One property's failure as a worker found it."""

    prop: str
    worker: int
    first: int  # 1-based example of the batch that failed first
    saved: int  # examples the database held for this property and backend when the batch started
    outcome: str  # "failed" (a mismatch) or "raised" (the backend raised)
    error: str
    case_file: str
    replay: str

    @property
    def replayed(self) -> bool:
        """The failure came from the database (reuse phase), not from a new search."""
        return 0 < self.first <= self.saved


@dataclass
class PropertyStats:
    """Examples and batches one property had across all workers, and how it ended."""

    examples: int = 0
    batches: int = 0
    failure: Failure | None = None
    skipped: str = ""


@dataclass
class FuzzReport:
    """The outcome of :func:`fuzz`: per-property stats, worker errors and crashes."""

    impl: str
    database: str
    seconds: float = 0.0
    alive: int = 0  # workers running now
    stats: dict[str, PropertyStats] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # a worker's harness error or crash

    @property
    def examples(self) -> int:
        """Examples run by every worker (shrinking included)."""
        return sum(s.examples for s in self.stats.values())

    @property
    def failures(self) -> list[Failure]:
        """The failing properties' failures, in property order."""
        return [s.failure for s in self.stats.values() if s.failure]

    @property
    def ok(self) -> bool:
        """Nothing failed, raised or crashed."""
        return not self.failures and not self.errors


def select_properties(names: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The registered property names to fuzz: ``names`` in registry order, or all of them.

    Raises:
        ValueError: a name that is not registered (the message suggests close ones).
    """
    import difflib

    from pagedkv.testing.registry import properties

    registered = list(properties())
    unknown = [n for n in names if n not in registered]
    if unknown:
        hints = {n: difflib.get_close_matches(n, registered, n=2) for n in unknown}
        raise ValueError("unknown property " + "; ".join(
            f"{n!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for n, h in hints.items())
            + " (python -m pagedkv fuzz --list names them)")
    return [n for n in registered if not names or n in names]


def case_file_name(backend: str, prop: str, suffix: str = "") -> str:
    """``fuzz_<backend>_<property><suffix>.json`` with unsafe characters replaced."""
    from pagedkv.testing.casefiles.writing import safe_name

    return safe_name(f"fuzz_{backend}_{prop}{suffix}", 180) + ".json"


def declared_capabilities(backend: Any) -> Any:
    """The input space ``backend`` declares, as the pytest suite reads it
    (:func:`pagedkv.testing.space.capabilities_under_test`, drawing space)."""
    from pagedkv.testing.space import capabilities_under_test

    return capabilities_under_test(backend, for_drawing=True)


def worker_device(index: int, chosen: str | None) -> str:
    """``chosen``, else ``cuda:<index % device_count>`` when CUDA is present, else ``cpu``."""
    if chosen:
        return chosen
    import torch

    return f"cuda:{index % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"


def run_batch(prop: Any, backend: Any, reference: Any | None, impl: str, device: str, db: Any, examples: int,
              failure_dir: Path, worker: int = 0, on_example: Any = None, caps: Any = None,
              seed: int | None = None) -> Outcome:
    """One Hypothesis run of ``prop`` against ``backend`` through :func:`pagedkv.testing.execute.run`:
    replay the database's examples, search ``examples`` new ones, shrink a failure. ``on_example()``
    is called before each example runs; ``caps`` (:func:`declared_capabilities`) limits the cases to
    the backend's declared space; ``seed`` fixes the batch's draws (``None``: a fresh random batch, as a
    fuzz worker wants).

    Returns:
        The run's :class:`~pagedkv.testing.execute.Outcome`; a failure's case file is moved to the
        property's one file in ``failure_dir`` (whichever worker found it), its replay line with it.

    Raises:
        Exception: a harness error (no example failed, yet Hypothesis raised: e.g. an unsatisfiable strategy).
    """
    from pagedkv.backends import backend_name
    from pagedkv.testing.databases import property_key
    from pagedkv.testing.execute import replay_command, run
    from pagedkv.testing.settings import fuzz_settings

    backends = (reference, backend) if prop.pair else (backend,)
    names = tuple(backend_name(b) for b in backends)
    path = failure_dir / case_file_name(names[-1], prop.name, f".w{worker}")
    outcome = run(prop, backends, device, fuzz_settings(db, examples), caps=caps, spec=impl,
                  other=names[0] if prop.pair else None, case_file=path, on_example=on_example, explicit=False,
                  database_key=property_key(prop.name, *names), seed=seed)
    found = outcome.failures[0] if outcome.failed else None
    if found is not None and found.case_file is not None:
        final = failure_dir / case_file_name(names[-1], prop.name)
        found.case_file.replace(final)  # one file per property, whichever worker found it
        found.case_file, found.replay = final, replay_command(final, impl, device)
    return outcome


def reported_failure(outcome: Outcome, worker: int, saved: int, impl: str) -> Failure:
    """The worker's report of a failed batch (``saved``: the examples the database held when it started)."""
    found = outcome.failures[0]
    kind = "failed" if isinstance(found.error, AssertionError) else "raised"
    if found.case is None:  # the state machine: no case file; its steps are in the worker's output
        return Failure(outcome.prop, worker, 0, 0, kind, found.first_line[:300], "",
                       f"PAGEDKV_PROFILE=gpu PAGEDKV_DATABASE=<this run's database> pytest --pyargs "
                       f"pagedkv.testing.suite --pagedkv-impl {impl} -k test_{outcome.prop}")
    return Failure(outcome.prop, worker, outcome.first_failing_example, saved, kind, found.first_line[:300],
                   str(found.case_file), found.replay)


def worker_main(index: int, config: FuzzConfig, deadline: float, events: Any, control: Any) -> None:
    """A worker process: fuzz the properties in turn (starting at a different one per worker) until
    ``deadline`` (``time.time()``), reporting to ``events``; ``control`` brings the names of properties
    that failed elsewhere (not fuzzed further)."""
    try:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.workers))
        import pagedkv
        from pagedkv.backends import backend_name
        from pagedkv.testing.databases import open_database, property_key, saved_examples
        from pagedkv.testing.registry import properties

        backend = pagedkv.load_backend(config.impl)
        reference = pagedkv.get_backend("loop" if backend_name(backend) == "indexed" else "indexed")
        db = open_database(config.database)
        device = worker_device(index, config.device)
        props = properties()
        caps = declared_capabilities(backend)
        pending = []
        for name in select_properties(config.properties):
            backends = (reference, backend) if props[name].pair else (backend,)
            reason = props[name].cannot_run(backends, caps)
            if reason:
                events.put(("skip", index, name, reason))
            else:
                pending.append(name)
        events.put(("start", index, "", device))
        turn = index * len(pending) // config.workers  # workers start spread over the properties
        while pending and time.time() < deadline:
            while True:
                try:
                    done = control.get_nowait()
                except queue_module.Empty:
                    break
                if done in pending:
                    pending.remove(done)
            if not pending:
                break
            name = pending[turn % len(pending)]
            turn += 1
            prop = props[name]
            count = config.batch if prop.max_examples is None else min(config.batch, prop.max_examples)
            tick = {"n": 0, "at": time.time()}

            def on_example(name=name, tick=tick):
                tick["n"] += 1
                if time.time() - tick["at"] >= 1.0:  # a long batch still shows progress
                    events.put(("examples", index, name, tick["n"]))
                    tick["n"], tick["at"] = 0, time.time()

            try:
                pair = (reference, backend) if prop.pair else (backend,)
                saved = saved_examples(db, property_key(name, *map(backend_name, pair)))
                outcome = run_batch(prop, backend, reference, config.impl, device, db, count,
                                    config.failure_dir, index, on_example, caps)
            except Exception:  # the harness, not the backend: report it, fuzz the other properties
                pending.remove(name)
                events.put(("batch", index, name, tick["n"]))
                events.put(("error", index, name, traceback.format_exc()))
                continue
            events.put(("batch", index, name, tick["n"]))
            if outcome.failed or outcome.status == "skipped":
                pending.remove(name)
                events.put(("failure", index, name, reported_failure(outcome, index, saved, config.impl))
                           if outcome.failed else ("skip", index, name, outcome.reason))
    except BaseException:
        events.put(("error", index, "", traceback.format_exc()))
    finally:
        events.put(("done", index, "", None))


class Quiet:
    """A progress sink that shows nothing, the default of :func:`fuzz`; the command line's
    (:class:`pagedkv.cli.fuzz.Progress`) prints each call."""

    def __init__(self, report: FuzzReport, config: FuzzConfig):
        self.report, self.config, self.start = report, config, time.time()

    def line(self, text: str) -> None:
        """A line of news (a worker started, an error)."""

    def status(self) -> None:
        """Called every ``config.interval`` seconds and at the end."""

    def failure(self, failure: Failure) -> None:
        """A property failed (the first failure of each property only)."""

    def summary(self) -> None:
        """Called once, after every worker stopped."""


def fuzz(config: FuzzConfig, progress: Callable[[FuzzReport, FuzzConfig], Quiet] = Quiet) -> FuzzReport:
    """Fuzz ``config.impl`` with ``config.workers`` processes for ``config.seconds`` and return the report;
    ``progress(report, config)`` builds the object told about the run as it goes (see :class:`Quiet`).

    Raises:
        pagedkv.BackendError: the candidate cannot be loaded.
        pagedkv.testing.databases.DatabaseError: the database URL is bad or its server does not answer.
        ValueError: an unknown property name, or a non-positive worker count, budget or batch.
    """
    import multiprocessing

    import pagedkv
    from pagedkv.testing.databases import describe, open_database

    if config.workers < 1 or config.seconds <= 0 or config.batch < 1:
        raise ValueError("workers, the budget and the batch must be positive")
    names = select_properties(config.properties)
    pagedkv.load_backend(config.impl)  # a bad spec fails here, with the loader's message
    report = FuzzReport(config.impl, describe(open_database(config.database)))
    report.stats = {n: PropertyStats() for n in names}
    progress = progress(report, config)
    progress.line(f"fuzz: {config.impl}: {len(names)} properties, {config.workers} worker(s), budget "
                    f"{config.seconds / 60:g} min, batches of {config.batch}; database: {report.database}; "
                    f"case files: {config.failure_dir}/")
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    controls = [ctx.Queue() for _ in range(config.workers)]
    t0 = time.time()
    deadline = t0 + config.seconds
    procs = [ctx.Process(target=worker_main, args=(i, config, deadline, events, controls[i]), daemon=True)
             for i in range(config.workers)]
    for p in procs:
        p.start()
    done: set[int] = set()
    next_status = time.time() + config.interval
    try:
        while len(done) < len(procs):
            try:
                kind, index, name, data = events.get(timeout=0.5)
            except queue_module.Empty:
                kind = None
            if kind == "start":
                report.alive += 1
                progress.line(f"worker {index}: started on {data}")
            elif kind in ("examples", "batch"):
                report.stats[name].examples += data
                report.stats[name].batches += kind == "batch"
            elif kind == "skip":
                report.stats[name].skipped = report.stats[name].skipped or data
            elif kind == "failure":
                stats = report.stats[name]
                if stats.failure is None:
                    stats.failure = data
                    progress.failure(data)
                    for i, c in enumerate(controls):
                        if i != index:
                            c.put(name)
            elif kind == "error":
                report.errors.append(f"worker {index}{' on ' + name if name else ''}: {data.strip().splitlines()[-1]}")
                progress.line(f"ERROR {report.errors[-1]}\n{data}")
            elif kind == "done" and index not in done:
                done.add(index)
                report.alive = max(0, report.alive - 1)
            for i, p in enumerate(procs):
                if i not in done and not p.is_alive() and p.exitcode not in (None, 0):
                    done.add(i)
                    report.alive = max(0, report.alive - 1)
                    report.errors.append(_crash_message(i, p.exitcode, config))
                    progress.line("ERROR " + report.errors[-1])
            now = time.time()
            if now >= deadline + GRACE_SECONDS:
                for i, p in enumerate(procs):
                    if i not in done:
                        p.terminate()
                        done.add(i)
                        report.errors.append(f"worker {i}: still in a batch {GRACE_SECONDS:.0f} s after the budget; "
                                             "stopped")
            if now >= next_status:
                progress.status()
                next_status = now + config.interval
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    report.seconds = time.time() - t0
    progress.status()
    progress.summary()
    return report


def _crash_message(index: int, exitcode: int, config: FuzzConfig) -> str:
    left = sorted(config.failure_dir.glob(f"fuzz_*.w{index}*.json"))
    where = ("; the case it was running: " + ", ".join(
        f"{p} (python -m pagedkv replay {p})" for p in left)) if left else ""
    return f"worker {index} died (exit code {exitcode}){where}"
