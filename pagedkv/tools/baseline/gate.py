"""The baseline gate in pytest: every drawn case also runs on the code the refactor replaces.

Options (group ``pagedkv``; loaded by :mod:`pagedkv.testing.plugin`):

- ``--pagedkv-baseline SPEC`` (or ``$PAGEDKV_BASELINE``): the baseline, any form of
  :func:`pagedkv.tools.baseline.load_baseline` (``git:HEAD~1``, ``git:v0.2.0:triton``,
  ``path:../old/site-packages:my_engine.kv:backend``, ``wheel:dist/x.whl``, ``indexed``); the backend
  spec defaults to the candidate's;
- ``--pagedkv-baseline-exact``: the candidate declares itself bit-exact with the baseline; any attention
  drift fails;
- ``--pagedkv-max-drift-ulp N``: attention drift past ``N`` ulp fails.

After a property's conformance check passes on a drawn case (the verdict is unchanged), the check
fixture calls :func:`after_check`: the case runs again on the candidate and on the baseline, each on
fresh tensors (:func:`pagedkv.tools.baseline.drift.measure`, over the ops the property uses; all four for pair
and invariance properties), and the drift is logged. Data movement must be bit-identical (a divergence
fails), attention fails only past the options above. Cases of the kinds ``scenario``, ``invalid`` and
``machine`` are not compared, nor examples outside the baseline's declared space (counted as skipped).
A failure writes a case file (``other`` = the baseline spec) under ``<failure dir>/drift/`` named like the
test's own (which a later passing example of the same test removes) and prints the replay command.

At the end, the worst case per property is kept as ``<failure dir>/drift/<property>.json`` and the
terminal summary prints the drift table (max ulp, max relative difference, examples compared), also
when everything passes. pytest-xdist workers each write their log to ``drift/_log-<worker>.json``; the
controller merges them.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

_LOG = pytest.StashKey[object]()
_LABEL = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedkv", "pagedkv conformance suite")
    group.addoption("--pagedkv-baseline", default=None, metavar="SPEC",
                    help="code the candidate replaces, run on every drawn case to measure drift: git:REV[:SPEC], "
                         "path:DIR[:SPEC], wheel:FILE.whl[:SPEC] or a backend spec (default: $PAGEDKV_BASELINE; "
                         "SPEC defaults to the candidate's)")
    group.addoption("--pagedkv-baseline-exact", action="store_true", default=False,
                    help="the candidate is bit-exact with the baseline: any attention drift fails")
    group.addoption("--pagedkv-max-drift-ulp", type=int, default=None, metavar="N",
                    help="fail when attention drifts more than N ulp (output dtype) from the baseline")


def baseline_spec(config: pytest.Config) -> str | None:
    """``--pagedkv-baseline``, else ``$PAGEDKV_BASELINE``, else ``None``."""
    return config.getoption("pagedkv_baseline", None) or os.environ.get("PAGEDKV_BASELINE") or None


def drift_dir() -> Path:
    """``<failure dir>/drift``: the worst case per property and the per-process logs."""
    from pagedkv.testing.casefiles.writing import failure_dir

    return failure_dir() / "drift"


def _gate(config: pytest.Config) -> dict:
    return {"exact": config.getoption("pagedkv_baseline_exact", False),
            "max_ulp": config.getoption("pagedkv_max_drift_ulp", None)}


def _gate_words(config: pytest.Config) -> str:
    gate = _gate(config)
    return ("bit-exact declared" if gate["exact"] else
            f"fails past {gate['max_ulp']} ulp" if gate["max_ulp"] is not None else "drift reported, not gated")


def pytest_configure(config: pytest.Config) -> None:
    from pagedkv.testing.plugin import impl_spec, is_active

    spec = baseline_spec(config)
    if not spec or not is_active(config):
        return
    from pagedkv.errors import BackendError
    from pagedkv.tools.baseline import resolve
    from pagedkv.tools.baseline.drift import DriftLog

    try:  # a bad spec or an unknown revision is a usage error now; git trees are extracted once, here
        _, tree, backend, label = resolve(spec, impl_spec(config) or "indexed")
    except BackendError as exc:
        raise pytest.UsageError(f"--pagedkv-baseline / PAGEDKV_BASELINE: {exc}") from exc
    config.stash[_LABEL] = label + (f" (tree {tree})" if tree else "")
    config.stash[_LOG] = DriftLog()
    if not hasattr(config, "workerinput"):
        for old in drift_dir().glob("*.json"):  # the logs, worst cases and failures of an earlier run
            old.unlink(missing_ok=True)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if config.stash.get(_LOG, None) is None:
        return None
    return [f"pagedkv baseline: {baseline_spec(config)} = {config.stash[_LABEL]}; {_gate_words(config)}"]


def replay_command(path: Path, spec: str, other: str, config: pytest.Config) -> str:
    """The replay command of a drift case file, with the gate's options."""
    gate = _gate(config)
    extra = " --exact" if gate["exact"] else f" --max-drift-ulp {gate['max_ulp']}" if gate["max_ulp"] is not None \
        else ""
    return f"python -m pagedkv replay {path} --impl {shlex.quote(spec)} --other {shlex.quote(other)}{extra}"


def after_check(config: pytest.Config, prop, args: tuple, spec: str, path: Path) -> None:
    """Compare the candidate with the baseline on the case a property just passed (see the module
    docstring); a no-op without ``--pagedkv-baseline``.

    Args:
        prop: the registered property (a plain check function is not compared).
        args: the check's arguments: ``(backend, case, device)`` or ``(first, candidate, case, device)``.
        spec: the candidate's spec (``--pagedkv-impl`` or its name). path: the test's case file (a
            failure is written to the file of that name under :func:`drift_dir`).

    Raises:
        AssertionError: a divergence, or drift past the gate (the case file is written first); the
            baseline cannot be loaded or raises where the candidate returned.
    """
    log = config.stash.get(_LOG, None)
    if log is None or not hasattr(prop, "ops"):
        return
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.tools.baseline import load_baseline
    from pagedkv.testing.casefiles.writing import save_failure
    from pagedkv.testing.cases import Case
    from pagedkv.tools.baseline.drift import judge, measure
    from pagedkv.testing.plugin import impl_spec

    case, device = args[-2], args[-1]
    if not isinstance(case, Case):
        return
    candidate = args[1] if getattr(prop, "pair", False) else args[0]
    other = baseline_spec(config)
    key = prop.name if impl_spec(config) else f"{prop.name}[{spec}]"
    try:
        baseline = load_baseline(other, spec)
    except Exception as exc:
        pytest.fail(f"--pagedkv-baseline {other}: {exc}", pytrace=False)
    caps = capabilities_of(baseline)
    if case.features - caps.features or caps.rejects(case.geometry):
        log.skip(key)
        return
    path = drift_dir() / path.name  # not the test's own file: a later passing example removes that one
    fields = dict(other=other, path=path)
    try:
        drift = measure(candidate, baseline, case, device, prop.ops)
    except Exception as exc:
        why = f"the baseline diverges: running the case raised {type(exc).__name__}: {exc}"
        save_failure(prop.name, spec, case, outcome="raised", error=why, **fields)
        raise AssertionError(f"{why}\nreplay: {replay_command(path, spec, other, config)}") from exc
    log.add(key, drift, case, check=prop.name, backend=spec)
    why = judge(drift, **_gate(config))
    if why:
        save_failure(prop.name, spec, case, outcome="failed", error=why, **fields)
        raise AssertionError(f"against baseline {other}: {why}\nreplay: {replay_command(path, spec, other, config)}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each process writes its drift log; the baseline workers stop."""
    config = session.config
    log = config.stash.get(_LOG, None)
    if log is None:
        return
    from pagedkv.tools.baseline import close_all

    close_all()
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    folder = drift_dir()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"_log-{worker}.json").write_text(log.to_json())


def merged_log():
    """The drift logs every process of this run wrote, merged."""
    from pagedkv.tools.baseline.drift import DriftLog

    log = DriftLog()
    for path in sorted(drift_dir().glob("_log-*.json")):
        log.merge(DriftLog.from_json(path.read_text()))
    return log


def write_worst_cases(log, other: str) -> dict[str, Path]:
    """The worst case of every property as a case file ``drift/<key>.json`` (``other`` = the baseline spec,
    ``error`` = the drift it shows); ``{key: path}``."""
    import re

    from pagedkv.tools.baseline.drift import Drift

    paths = {}
    for key, p in log.props.items():
        if p.case is None:
            continue
        path = drift_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_")[:150] + ".json")
        record = {"version": 1, "check": p.check, "backend": p.backend, "other": other,
                  "kind": "Case", "case": p.case,
                  "error": f"worst drift of {p.examples} examples against {other}: {Drift(**p.worst).describe()}"[:500]}
        path.write_text(json.dumps(record, indent=1))
        paths[key] = path
    return paths


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """The drift table, per property: max ulp, max relative difference, examples compared, where."""
    if config.stash.get(_LOG, None) is None or hasattr(config, "workerinput"):
        return
    log = merged_log()
    other = baseline_spec(config)
    terminalreporter.section(f"pagedkv drift against baseline {other}")
    terminalreporter.write_line(f"baseline: {config.stash[_LABEL]}; {_gate_words(config)}")
    if not log.props:
        terminalreporter.write_line("no example was compared (no conformance property on a Case passed)")
        return
    paths = write_worst_cases(log, other)
    for line in log.table():
        terminalreporter.write_line(line)
    if paths:
        terminalreporter.write_line(f"worst case per property: {drift_dir()}/<property>.json; replay one with "
                                    f"python -m pagedkv replay FILE --impl SPEC --other {shlex.quote(other)}")
