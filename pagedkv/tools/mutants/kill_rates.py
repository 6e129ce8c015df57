"""Kill probability of mutants: every mutant run against the registered properties with N random seeds.

A *job* is one mutant: a generated source mutant (:mod:`pagedkv.tools.mutants.generate`), a shipped
faulty backend (:data:`pagedkv.tools.mutants.MUTANTS`) or a user's faulty variant (a backend
spec). Each job runs in its own child process (``python -c``), so that

- a source mutant is loaded under the original module's name before anything imports it (a
  meta-path finder, :data:`~pagedkv.tools.mutants.generate.BOOTSTRAP`): Triton compiles the mutated
  kernel from a real file, and the installed file is never touched;
- a mutant that crashes the interpreter (a segmentation fault in a kernel) is reported as *killed by
  crash*, with the property and the case file (written before every example) it crashed on: each run
  is a fork of the child (:func:`_forked_run`), so a crash ends one run and the next seed runs, and a
  crashing mutant gets a rate over N seeds like any other;
- a mutant that hangs is stopped at its time budget (plus a grace for the imports): *timeout*.

In the child, for each seed ``s`` (the same seeds for every mutant) and each mode (the explicit
examples run first, or generated examples only), the properties run in registry order at the
profile's example count, each with its own seed (:func:`property_seed`: ``s`` and the property's name,
hashed), no database, no shrinking, and the run stops at its first failure. Properties that share a
strategy would draw the very same cases from one seed, and one run would then be as strong as its
single best property; with a seed each, they search independently, as under pytest with a
derandomized profile (``ci``: Hypothesis seeds each test from its own name). The job's result: per
run, killed or not, by which property, after how many examples and seconds, and the case file of the
first failure.
:mod:`pagedkv.tools.mutants.kill_rate_tables` turns results into the JSON and markdown tables.

The one call that runs a property on a backend with a seed is :func:`_run_one`; it follows the
suite's own test (:mod:`pagedkv.testing.suite.test_properties`): cases drawn inside
``capabilities_under_test(backend, for_drawing=True)``, the explicit examples that fit it, at most
:func:`~pagedkv.testing.space.example_cap` examples for a backend Triton interprets (as the suite under the
same profile). State machines (``kind == "machine"``) are not seeded by Hypothesis's ``seed`` and are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.testing.execute import Outcome

#: Seconds a child may run past its budget (imports, the run in progress) before it is stopped.
GRACE_S = 90.0


@dataclass
class Job:
    """What one child runs (plain data: it travels as JSON).

    Attributes:
        id: the mutant's id (``"baseline"`` for the unmutated implementation).
        kind: ``"source"``, ``"shipped"``, ``"variant"`` or ``"baseline"``.
        impl: the backend spec loaded in the child (for ``"shipped"`` and ``"variant"``: the mutant itself).
        module, path, original: for ``"source"``: the module the mutated file ``path`` replaces, and
            the original file.
        properties: property names, in the order they run. seeds: one run per seed and mode.
        modes: ``True`` (explicit examples first) and/or ``False`` (generated examples only).
        profile: a :data:`pagedkv.testing.settings.PROFILES` name (its example count). device: torch device.
        budget_s: seconds for all of the job's runs; the run in progress stops at its next example.
        case_dir: where case files are written.
    """

    id: str
    kind: str
    impl: str
    properties: list[str]
    seeds: list[int]
    modes: list[bool]
    profile: str = "dev"
    device: str = "cpu"
    budget_s: float = 120.0
    case_dir: str = ".pagedkv-failures/mutate"
    module: str | None = None
    path: str | None = None
    original: str | None = None
    meta: dict = field(default_factory=dict)  # reported as is (operator, line, diff, ...)


class _OverBudget(BaseException):
    """Raised from inside a Hypothesis test body when the job's time budget is spent (not a failure)."""


def _first_line(exc: BaseException) -> str:
    text = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}"[:300]


def property_seed(seed: int, name: str) -> int:
    """The Hypothesis seed of property ``name`` in the run of ``seed``: a 64-bit hash of both, the same
    on every machine and Python (not ``hash()``, which is salted per process)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")


def _run_one(prop: Any, backend: Any, device: str, seed: int, max_examples: int, explicit: bool, *,
             caps: Any, deadline: float | None = None, case_file: Path | None = None) -> Outcome:
    """Run property ``prop`` on ``backend`` once: Hypothesis seeded with :func:`property_seed` of ``seed``,
    ``max_examples`` generated examples (the profile's count: the property's own cap and an interpreted
    backend's, :func:`pagedkv.testing.space.example_cap`, apply inside the execution core, as in the suite;
    after the explicit ones that fit ``caps`` when ``explicit``), no database, no
    shrinking, stopping at the first failure; each example is written to ``case_file`` before it runs.

    It runs through the execution core (:func:`pagedkv.testing.execute.run`), like every other entry point.

    Returns:
        The run's :class:`~pagedkv.testing.execute.Outcome` (its ``examples_judged``: the 1-based index of
        the first failing example, else the count run).

    Raises:
        _OverBudget: ``time.monotonic()`` passed ``deadline`` between two examples.
    """
    from pagedkv.testing.execute import BudgetSpent, run
    from pagedkv.testing.settings import kill_rate_settings

    def before():
        if deadline is not None and time.monotonic() > deadline:
            raise BudgetSpent
    outcome = run(prop, (backend,), device, kill_rate_settings(max_examples, explicit), caps=caps, explicit=explicit,
                  seed=property_seed(seed, prop.name), on_example=before, case_file=case_file)
    if outcome.status == "partial":
        raise _OverBudget
    return outcome


# -- the child ---------------------------------------------------------------------------------------------
def runnable_properties(backend: Any, names: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The registered properties ``backend`` can run (registry order, or the order of ``names``: exact
    names or globs) and ``{name: reason}`` for those left out (missing op, undeclared space, state machine).

    Raises:
        KeyError: a name or glob in ``names`` matches no property.
    """
    from pagedkv.testing.registry import properties
    from pagedkv.testing.space import capabilities_under_test

    props = properties()
    if names:
        chosen = []
        for pattern in names:
            hits = [n for n in props if fnmatch(n, pattern) and n not in chosen]
            if not hits and pattern not in chosen and not fnmatch(MANAGER_MACHINE, pattern):
                raise KeyError(f"--properties: {pattern!r} matches no registered property")
            chosen += hits
    else:
        chosen = list(props)
    from pagedkv.testing.managers.protocol import manager_factory

    if manager_factory(backend) is not None and (not names or any(fnmatch(MANAGER_MACHINE, p) for p in names)):
        return [MANAGER_MACHINE], ({f"{len(chosen)} kernel properties": "the candidate is judged as a cache manager"}
                                   if chosen else {})
    caps = capabilities_under_test(backend, for_drawing=True)
    keep, left_out = [], {}
    for name in chosen:
        prop = props[name]
        reason = "a state machine (not seeded)" if prop.kind == "machine" else prop.cannot_run((backend,), caps)
        if reason:
            left_out[name] = reason
        else:
            keep.append(name)
    return keep, left_out


#: The property name of the cache-manager state machine, which runs for a candidate with a ``cache_manager``.
MANAGER_MACHINE = "cache_manager"


def _run_manager_machine(backend: Any, seed: int, max_examples: int) -> Outcome:
    """The cache-manager state machine on ``backend``'s ``cache_manager``, Hypothesis seeded with
    :func:`property_seed` (a state machine's test is built inside Hypothesis, so the seed is forced), no
    database, no shrinking: an :class:`~pagedkv.testing.execute.Outcome` as :func:`_run_one` gives."""
    from pagedkv.testing.execute import Failure, Outcome
    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.managers.protocol import manager_factory, manager_layouts
    from pagedkv.testing.settings import manager_kill_rate_settings

    machine = machine_for(manager_factory(backend), windows=getattr(backend, "cache_manager_windows", (None,)),
                          layouts=manager_layouts(backend))
    with forced_seed(property_seed(seed, MANAGER_MACHINE)):
        steps = programs.run_per_layout(machine, manager_kill_rate_settings(max_examples))  # each layout all of them
    outcome = Outcome(MANAGER_MACHINE, examples=machine.examples_run)
    if steps is not None:
        outcome.status, outcome.first_failing_example = "failed", steps.first_failing_example
        outcome.failures.append(Failure(None, AssertionError(steps.error[:300])))
    return outcome


def _one_run(job: dict, seed: int, explicit: bool, ctx: dict, on_property) -> dict:
    """One run of ``job``: its properties in order, ``seed``, explicit examples first or not, until the
    first failure. ``ctx``: the loaded backend and settings (:func:`child_main`). ``on_property(name)`` is
    called as each property starts (what a crashed run reports)."""
    from pagedkv.testing.casefiles.writing import save_failure

    run = _new_run(seed, explicit)
    t0 = time.monotonic()
    for name in job["properties"]:
        on_property(name)
        if name == MANAGER_MACHINE:
            outcome = _run_manager_machine(ctx["backend"], seed, ctx["limit"])
            run["properties_run"] += 1
            run["examples"] += outcome.examples_judged
            if outcome.failed:
                run.update(killed=True, property=name, error=outcome.first_line, examples=outcome.examples_judged)
                break
            continue
        prop = ctx["props"][name]
        try:  # the profile's count: execute.run applies the property's cap and the interpreter's, once
            outcome = _run_one(prop, ctx["backend"], job["device"], seed, ctx["limit"], explicit, caps=ctx["caps"],
                               deadline=ctx["deadline"], case_file=ctx["running"])
        except _OverBudget:  # the run so far is kept, marked partial
            run.update(partial=True, seconds=round(time.monotonic() - t0, 3))
            return run
        run["properties_run"] += 1
        run["examples"] += outcome.examples_judged
        if outcome.failed:
            run.update(killed=True, property=name, error=outcome.first_line, examples=outcome.examples_judged)
            case = outcome.failures[0].case
            if case is not None and not ctx["saved"][explicit]:
                path = _case_path(ctx, job, seed, explicit)
                save_failure(name, job["impl"], case, path=path,
                             error=f"[mutant {job['id']}] {outcome.first_line}")
                run["case_file"] = str(path)
            break
    run["seconds"] = round(time.monotonic() - t0, 3)
    return run


def _new_run(seed: int, explicit: bool, **fields) -> dict:
    """A run record: not killed, nothing run yet, ``fields`` set."""
    return {"seed": seed, "explicit": explicit, "killed": False, "property": "", "examples": 0, "seconds": 0.0,
            "error": "", "case_file": "", "properties_run": 0, "partial": False, **fields}


def _case_path(ctx: dict, job: dict, seed: int, explicit: bool, suffix: str = "") -> Path:
    """Where the case file of ``job``'s first failure (``suffix="-crash"``: its crash) in a mode goes."""
    return ctx["case_dir"] / f"{job['id']}-seed{seed}{'-explicit' if explicit else ''}{suffix}.json"


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a child stopped at its budget, or a
    ``mutate`` stopped by Ctrl-C, takes its forked run along). Elsewhere nothing."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _forked_run(job: dict, seed: int, explicit: bool, ctx: dict) -> dict:
    """:func:`_one_run` in a forked process, so that a mutant that crashes the interpreter (a segmentation
    fault in a kernel) ends that run alone, as *killed by crash*, and the next seed runs: the fork shares
    the loaded backend, so a run costs no import. The crashed run names the property in progress and
    keeps the case file it was running (written before every example)."""
    result, progress = ctx["workdir"] / f"{job['id']}.run.json", ctx["workdir"] / f"{job['id']}.progress.json"
    for path in (result, progress, ctx["running"]):
        path.unlink(missing_ok=True)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the run; nothing of the parent's (pytest, open files) must run on exit
        _die_with_parent()
        code = 0
        try:
            run = _one_run(job, seed, explicit, ctx, lambda name: progress.write_text(json.dumps({"property": name})))
            result.write_text(json.dumps(run))
        except BaseException:  # noqa: BLE001  (reported by the parent as a harness error)
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        at = json.loads(progress.read_text()) if progress.is_file() and progress.stat().st_size else {}
        sig = os.WTERMSIG(status)
        run = _new_run(seed, explicit, killed=True, crashed=True, property=at.get("property", ""), signal=sig,
                       seconds=round(time.monotonic() - t0, 3), error=f"the run died of signal {sig}")
        if ctx["running"].is_file() and not ctx["saved"][explicit]:  # the case it was running
            kept = _case_path(ctx, job, seed, explicit, "-crash")
            ctx["running"].replace(kept)
            run["case_file"] = str(kept)
        return run
    if os.WEXITSTATUS(status) != 0 or not result.is_file():
        raise RuntimeError(f"the run of seed {seed} exited with status {os.WEXITSTATUS(status)} outside any property")
    return json.loads(result.read_text())


def child_main(job: dict, out_path: str) -> None:
    """Run one job (a :class:`Job` as a dict) and keep ``out_path`` (JSON) up to date after every run.

    Where the platform forks, each run is a forked process (:func:`_forked_run`): a crash ends one run,
    not the job. Elsewhere the runs share this process and a crash ends the job, leaving the runs so far
    and the run in progress (``"current"``)."""
    import torch

    torch.set_num_threads(1)
    from pagedkv.backends import load_backend
    from pagedkv.tools.mutants.generate import loaded_from
    from pagedkv.testing.registry import properties
    from pagedkv.testing.space import capabilities_under_test
    from pagedkv.testing.settings import PROFILES

    out: dict = {"id": job["id"], "status": "ran", "runs": [], "current": None, "error": ""}

    def flush():
        if job.get("module"):  # which file the backend runs for the mutated module (None: not imported yet)
            out["loaded_from"] = loaded_from(job["module"])
        Path(out_path).write_text(json.dumps(out))

    try:
        backend = load_backend(job["impl"])
    except Exception as exc:  # a mutant that does not even import
        out.update(status="import_error", error=_first_line(exc))
        return flush()
    if MANAGER_MACHINE in job["properties"]:  # the engine's imports once, before the runs fork
        from pagedkv.testing.managers.protocol import ManagerConfig, layout_groups, manager_factory, manager_layouts

        try:
            manager_factory(backend)(ManagerConfig(4, 1, groups=layout_groups(manager_layouts(backend)[0], 1, 0)))
        except Exception as exc:  # a mutant that breaks the manager's construction
            out.update(status="import_error", error=_first_line(exc))
            return flush()
    case_dir = Path(job["case_dir"])
    ctx = {"backend": backend, "caps": capabilities_under_test(backend, for_drawing=True), "props": properties(),
           "limit": PROFILES[job["profile"]]["max_examples"],
           "case_dir": case_dir, "running": case_dir / f"{job['id']}.running.json",
           "workdir": Path(out_path).parent, "deadline": time.monotonic() + job["budget_s"],
           "saved": {True: False, False: False}}
    fork = hasattr(os, "fork")

    def in_progress(name):  # without a fork: the run in progress is what a crash of this process leaves
        out["current"]["property"] = name
        flush()
    t_job = time.monotonic()
    for seed in job["seeds"]:
        for explicit in job["modes"]:
            if time.monotonic() > ctx["deadline"]:
                out["budget_spent"] = True
                return flush()
            out["current"] = {"seed": seed, "explicit": explicit, "property": "", "case_file": str(ctx["running"])}
            flush()
            run = _forked_run(job, seed, explicit, ctx) if fork else _one_run(job, seed, explicit, ctx, in_progress)
            ctx["saved"][explicit] |= bool(run["case_file"])
            out["runs"].append(run)
            out["current"] = None
            if run["partial"]:
                out["budget_spent"] = True
                ctx["running"].unlink(missing_ok=True)
                return flush()
            flush()
    ctx["running"].unlink(missing_ok=True)
    out["seconds"] = round(time.monotonic() - t_job, 3)
    flush()


_CHILD_TAIL = r'''
import json, sys
job = json.load(open(sys.argv[1]))
if job.get("path"):
    install_mutant(job["module"], job["path"], job["original"])
from pagedkv.tools.mutants.kill_rates import child_main
child_main(job, sys.argv[2])
'''


def _package_root() -> str:
    import pagedkv

    return str(Path(pagedkv.__file__).resolve().parents[1])


def run_job(job: Job, workdir: str | Path) -> dict:
    """Run ``job`` in a child process and return its raw result: the child's JSON plus ``returncode``,
    ``signal`` (when it died of one), ``timed_out`` and ``wall_s``."""
    workdir = Path(workdir)
    spec_path, out_path = workdir / f"{job.id}.job.json", workdir / f"{job.id}.out.json"
    spec_path.write_text(json.dumps(asdict(job)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (_package_root(), os.environ.get("PYTHONPATH")))),
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    from pagedkv.tools.mutants.generate import BOOTSTRAP

    t0 = time.monotonic()
    timed_out = False
    proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP + _CHILD_TAIL, str(spec_path), str(out_path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=job.budget_s + GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # its forked run dies with it (_die_with_parent)
        _, stderr = proc.communicate()
        timed_out = True
    result = json.loads(out_path.read_text()) if out_path.is_file() and out_path.stat().st_size else \
        {"id": job.id, "status": "no_result", "runs": [], "current": None, "error": ""}
    result.update(returncode=proc.returncode, timed_out=timed_out, wall_s=round(time.monotonic() - t0, 2),
                  signal=-proc.returncode if proc.returncode and proc.returncode < 0 and not timed_out else None)
    if proc.returncode and not timed_out and not result.get("error"):
        result["error"] = (stderr or "").strip().splitlines()[-1][:300] if (stderr or "").strip() else ""
    return result


def run_jobs(jobs: list[Job], workdir: str | Path, workers: int = 1, *, progress=None) -> list[dict]:
    """Run every job, ``workers`` children at a time (``workdir``: their job and result files); results in
    the order of ``jobs``. ``progress(job, result)`` is called as each finishes."""
    def one(job):
        result = run_job(job, workdir)
        if progress is not None:
            progress(job, result)
        return result
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(one, jobs))


def source_job(mutant: Any, workdir: str | Path, **common) -> Job:
    """The :class:`Job` of a :class:`~pagedkv.tools.mutants.generate.SourceMutant`: its mutated file is
    written under ``workdir`` (``common``: the other :class:`Job` fields)."""
    from pagedkv.tools.mutants.generate import write_mutant

    path = write_mutant(mutant, Path(workdir) / "src")
    meta = {k: getattr(mutant, k) for k in ("operator", "file", "line", "function", "before", "after")}
    return Job(mutant.id, "source", module=mutant.module, path=str(path), original=mutant.file,
               meta={**meta, "diff": mutant.diff}, **common)
