"""Run registered properties against one backend outside pytest: the mutants' kill table, the peers'
conformance table, anything that needs "does this backend pass property P, and on what case not".

Each property runs with Hypothesis under one of the suite's profiles, its explicit examples first;
the result is ``(failed, examples, shrunk case, first error line)``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.testing.cases.notation import brief
from pagedkv.tools.mutants import MUTANTS as ALL_MUTANTS, TARGETS as ALL_TARGETS
from pagedkv.testing.registry import properties


@dataclass
class Result:
    """Outcome of running the suite against one mutant."""

    mutant: str
    killed: bool = False
    killed_by: str = ""  # property name, "regression FILE" or "pytest"
    examples: int = 0  # examples run until the first failure (or in total, when it survived)
    seconds: float = 0.0
    case: str = ""  # the shrunk failing case (repr)
    error: str = ""  # first line of the failure
    ran: list[str] = field(default_factory=list)


def hypothesis_settings(profile: str, *, shrink: bool = True):
    """Settings for running a property against a mutant under the suite's profile ``profile``.

    Example databases are off (a mutant's failures must not be replayed against the real backends),
    and only the first distinct failure is reported. ``shrink=False`` stops at the first failing example.

    Raises:
        ValueError: unknown profile.
    """
    from hypothesis import HealthCheck, Phase, settings

    from pagedkv.testing.settings import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {profile!r}; choose one of {sorted(PROFILES)}")
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    values = {k: v for k, v in PROFILES[profile].items() if k not in ("database", "phases", "verbosity")}
    return settings(**values, deadline=None, database=None, print_blob=False, phases=phases,
                    report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_property(backend: Any, prop: Any, profile: str = "ci", device: str = "cpu", *,
                 shrink: bool = True) -> tuple[bool, int, str, str]:
    """Run one property against ``backend`` through :func:`pagedkv.testing.execute.run` under ``profile``
    (``shrink=False``: stop at the first failing example), inside the backend's declared space.

    Returns:
        ``(failed, examples_until_first_failure_or_total, shrunk_case_summary, error_first_line)``.
        A property that cannot be judged on the backend does not fail (the suite skips): the last
        item is then ``"skipped: <reason>"``.
    """
    from pagedkv.testing.execute import run

    outcome = run(prop, (backend,), device, hypothesis_settings(profile, shrink=shrink))
    if outcome.status == "skipped":
        return False, 0, "", f"skipped: {outcome.reason}"
    if outcome.failed:
        case = outcome.failures[0].case
        summary = brief(case) if case is not None else "state machine (the steps are printed above)"
        return True, outcome.first_failing_example or 1, summary, outcome.first_line
    return False, outcome.examples, "", ""


def run_mutant(name: str, profile: str = "ci", device: str = "cpu", *, only_targets: bool = False,
               regressions: bool = True, shrink: bool = True) -> Result:
    """Run the suite's properties (targets first) and the regression files against mutant ``name``,
    stopping at the first failure.

    Raises:
        KeyError: unknown mutant name.
    """
    from pagedkv.testing.casefiles.reading import load_case_file  # the checks every case file passes (trusted backends)
    from pagedkv.testing.casefiles.reading import shipped_regressions
    from pagedkv.testing.execute import run_record

    backend = ALL_MUTANTS[name]()
    props = properties()
    order = list(ALL_TARGETS.get(name, ()))
    if not only_targets:
        order += [p for p in props if p not in order]
    result = Result(name)
    t0 = time.perf_counter()
    for pname in order:
        result.ran.append(pname)
        failed, n, case, error = run_property(backend, props[pname], profile, device, shrink=shrink)
        result.examples += n
        if failed:
            result.killed, result.killed_by, result.case, result.error = True, pname, case, error
            break
    if not result.killed and regressions:
        for path in shipped_regressions():
            record = load_case_file(path, check_backend=False)  # runs the mutant, never the recorded backend
            result.examples += 1
            outcome = run_record(record, backend, device)
            if outcome.failed:
                result.killed, result.killed_by, result.case = True, f"regression {path.name}", brief(record["case"])
                result.error = outcome.first_line
                break
    result.seconds = time.perf_counter() - t0
    return result


def mutant_spec(name: str) -> str:
    """The ``--pagedkv-impl`` spec that loads shipped mutant ``name``."""
    return f"pagedkv.tools.mutants:{name}"


def run_mutant_via_pytest(name: str, profile: str = "ci", extra: list[str] | None = None) -> Result:
    """Run the conformance suite (``pytest --pyargs pagedkv.testing.suite``) against mutant ``name`` in a
    subprocess, ``-x``: killed when any test fails. The case file the suite saved is reported as the case."""
    import json
    import subprocess
    import tempfile

    result = Result(name, killed_by="pytest")
    with tempfile.TemporaryDirectory() as failures:
        env = {**os.environ, "PAGEDKV_PROFILE": profile, "PAGEDKV_FAILURE_DIR": failures}
        env.pop("PAGEDKV_IMPL", None)
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "pagedkv.testing.suite",
               f"--pagedkv-impl={mutant_spec(name)}", "-x", "-q", "-p", "no:cacheprovider", *(extra or [])]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=failures, env=env, capture_output=True, text=True)
        result.seconds = time.perf_counter() - t0
        result.killed = proc.returncode == 1
        if proc.returncode not in (0, 1, 5):
            result.error = f"pytest exited {proc.returncode}: {proc.stdout[-400:]}{proc.stderr[-400:]}"
        saved = sorted(Path(failures).glob("*.json"))
        if saved:
            record = json.loads(saved[0].read_text())
            result.killed_by = f"pytest {record.get('check')}"
            result.case, result.error = json.dumps(record["case"]), record.get("error", "")
    return result


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(results: list[Result], case_width: int = 90) -> str:
    """The results as a fixed-width text table."""
    header = f"{'mutant':<28} {'result':<9} {'killed by':<26} {'examples':>8} {'time':>7}  shrunk case"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r.mutant:<28} {'killed' if r.killed else 'SURVIVED':<9} {_short(r.killed_by, 26):<26} "
                     f"{r.examples:>8} {r.seconds:>6.1f}s  {_short(r.case, case_width)}")
    killed = sum(r.killed for r in results)
    lines.append(f"{killed}/{len(results)} mutants killed")
    return "\n".join(lines)
