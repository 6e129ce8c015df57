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

from pagedkv.testing.cache_mutants import CACHE_MUTANT_BACKENDS, CACHE_TARGETS
from pagedkv.testing.feature_mutants import FEATURE_MUTANTS, FEATURE_TARGETS
from pagedkv.testing.mutants import MUTANTS, TARGETS
from pagedkv.testing.registry import properties

#: Every shipped mutant: the faulty backends (plain and feature paths) and the faulty caches (as backends
#: with a ``cache_class``).
ALL_MUTANTS: dict[str, type] = {**MUTANTS, **FEATURE_MUTANTS, **CACHE_MUTANT_BACKENDS}
ALL_TARGETS: dict[str, tuple[str, ...]] = {**TARGETS, **FEATURE_TARGETS, **CACHE_TARGETS}


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

    from strategies.profiles import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"unknown Hypothesis profile {profile!r}; choose one of {sorted(PROFILES)}")
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    values = {k: v for k, v in PROFILES[profile].items() if k not in ("database", "phases", "verbosity")}
    return settings(**values, deadline=None, database=None, print_blob=False, phases=phases,
                    report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_property(backend: Any, prop: Any, profile: str = "ci", device: str = "cpu", *,
                 shrink: bool = True) -> tuple[bool, int, str, str]:
    """Run one property against ``backend`` with Hypothesis under ``profile`` (``shrink=False``: stop at
    the first failing example).

    Returns:
        ``(failed, examples_until_first_failure_or_total, shrunk_case_summary, error_first_line)``.
        A backend lacking an op the property needs does not fail (the suite skips): the last item
        is then ``"skipped: <reason>"``.
    """
    from hypothesis import given, settings

    from pagedkv.testing.compare import MissingOp

    from pagedkv.testing.registry import missing_ops_for

    from pagedkv.backends.capabilities import capabilities_of

    missing = missing_ops_for(backend, prop)
    if missing:
        return False, 0, "", f"skipped: no op {missing[0]!r}"
    caps = capabilities_of(backend)
    if prop.kind == "case" and prop.requires(caps):  # an undeclared feature: not covered, never passed
        return False, 0, "", f"skipped: {prop.requires(caps)}"
    if prop.kind == "machine":
        chosen = hypothesis_settings(profile, shrink=shrink)
        try:
            prop.check(backend, device, chosen)
        except MissingOp as exc:
            return False, 0, "", f"skipped: {exc}"
        except Exception as exc:
            msg = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            return True, 1, "state machine (the steps are printed above)", f"{type(exc).__name__}: {msg}"
        return False, chosen.max_examples, "", ""
    state = {"calls": 0, "first": 0, "last": None, "missing": ""}

    chosen = hypothesis_settings(profile, shrink=shrink)
    if prop.max_examples is not None and chosen.max_examples > prop.max_examples:
        chosen = settings(chosen, max_examples=prop.max_examples)

    from hypothesis import example

    @chosen
    @given(prop.strategy(caps) if prop.kind == "case" else prop.strategy())
    def body(case):
        state["calls"] += 1
        try:
            prop.run(backend, case, device)
        except MissingOp as exc:
            state["missing"] = str(exc)
            return
        except Exception:
            state["first"] = state["first"] or state["calls"]
            state["last"] = case
            raise

    for case in reversed(prop.examples()):
        if not getattr(case, "features", frozenset()) - caps.features:
            body = example(case)(body)
    try:
        body()
    except Exception as exc:  # the shrunk example's failure
        msg = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return True, state["first"], brief(state["last"]), f"{type(exc).__name__}: {msg}"
    return False, state["calls"], "", f"skipped: {state['missing']}" if state["missing"] else ""


def regression_files(root: Path | None = None) -> list[Path]:
    """The committed regression case files (``pagedkv/testing/regressions/*.json``, shipped as package data)."""
    root = root or Path(__file__).resolve().parent / "regressions"
    return sorted(root.glob("*.json"))


def run_mutant(name: str, profile: str = "ci", device: str = "cpu", *, only_targets: bool = False,
               regressions: bool = True, shrink: bool = True) -> Result:
    """Run the suite's properties (targets first) and the regression files against mutant ``name``,
    stopping at the first failure.

    Raises:
        KeyError: unknown mutant name.
    """
    from pagedkv.testing.casefile import load_case_file  # the checks every case file passes (trusted backends)
    from pagedkv.testing.casefile import run_record
    from pagedkv.testing.compare import MissingOp

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
        for path in regression_files():
            record = load_case_file(path, check_backend=False)  # runs the mutant, never the recorded backend
            result.examples += 1
            try:
                run_record(record, backend, device)
            except MissingOp:
                continue
            except Exception as exc:
                result.killed, result.killed_by, result.case = True, f"regression {path.name}", brief(record["case"])
                result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                break
    result.seconds = time.perf_counter() - t0
    return result


def mutant_spec(name: str) -> str:
    """The ``--pagedkv-impl`` spec that loads shipped mutant ``name``."""
    module = "pagedkv.testing.mutants" if name in MUTANTS else \
        "pagedkv.testing.feature_mutants" if name in FEATURE_MUTANTS else "pagedkv.testing.cache_mutants"
    return f"{module}:{name}"


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


def brief(case: Any) -> str:
    """A one-line summary of a :class:`~pagedkv.testing.cases.Case` or :class:`~pagedkv.testing.cases.CacheScenario`:
    geometry as ``nb/bs/kvh/d/g dtype``, then sequences (``table:len/q_len@start``) or ops, then the
    non-default fields. ``repr(case)`` remains the exact, replayable form."""
    from pagedkv.testing.cases import CacheScenario, Case

    if not isinstance(case, (Case, CacheScenario)):
        return repr(case)
    g = case.geometry
    text = (f"nb={g.num_blocks} bs={g.block_size} kvh={g.num_kv_heads} d={g.head_dim} "
            f"g={g.num_queries_per_kv} {g.dtype}")
    if isinstance(case, Case):
        seqs = " ".join(f"{list(s.block_table)}:{s.seq_len}/{s.q_len}@{s.start}" for s in case.seqs)
        defaults = Case(g, ())
        extras = [f"{f}={getattr(case, f)!r}" for f in ("values", "poison", "pad_value", "pad_columns", "table_dtype",
                                                          "layout", "scale", "seed", "window_left", "softcap", "alibi",
                                                          "sinks", "kv_cache_dtype", "k_scale", "v_scale")
                  if getattr(case, f) != getattr(defaults, f)]
        return f"{text} seqs {seqs} " + " ".join(extras)
    ops = "; ".join(" ".join(str(list(x)) if isinstance(x, tuple) else str(x) for x in op) for op in case.ops)
    return f"{text} ops {ops} prefix_caching={case.enable_prefix_caching} constant_hash={case.constant_hash}"


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
