"""What a run of the suite says: the header, a failure's short text, and the judged / skipped summary.

Each suite test records its :class:`~pagedkv.testing.verdict.Verdict` on its pytest item
(``user_properties``, so the records cross xdist workers); the terminal summary, the no-false-green
rule and the JSON verdict read them back and add them up with :func:`pagedkv.testing.verdict.count`,
the one policy: passed and failed are judged, findings are counted apart, skips by their
:class:`~pagedkv.testing.verdict.SkipReason`.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

_KEY = "pagedkv"


class TestRun:
    """One suite test's handle: its case file, and :meth:`record` of what it judged."""

    __test__ = False  # not a test class

    def __init__(self, node: Any, spec: str | None):
        from pagedkv.testing.casefiles.writing import case_file_path

        self.node, self.spec = node, spec
        self.case_file = case_file_path(node.nodeid)

    def record(self, prop: str, backend: Any, verdict: Any) -> None:
        """Record ``verdict`` (:class:`~pagedkv.testing.verdict.Verdict`) of ``prop`` on ``backend``: its
        status, kind, message, skip reason, failures or findings (case files, replay commands) and the
        declared non-promise."""
        from pagedkv.backends import backend_name

        entry = {"prop": prop, "backend": backend_name(backend), "status": verdict.status,
                 "reason": verdict.message, "kind": verdict.kind}
        if verdict.skip is not None:
            entry["skip"] = verdict.skip.value
        if verdict.failures:
            entry["failures"] = [failure_record(f) for f in verdict.failures]
        if verdict.non_promise:
            entry["non_promise"] = verdict.non_promise
        if getattr(verdict, "measured", None):
            entry["measured"] = verdict.measured
        if getattr(verdict, "declarations", None):
            entry["declarations"] = verdict.declarations
        self.node.user_properties.append((_KEY, json.dumps(entry)))


def failure_record(failure: Any) -> dict:
    """One failure for the JSON verdict: its message, case file, replay command and whether it reproduced
    (``reproduced``: what the failure carries; :func:`check_reproduced` replays the rest)."""
    return {"message": failure.first_line, "case_file": str(failure.case_file) if failure.case_file else None,
            "replay": failure.replay or None, "reproduced": getattr(failure, "reproduced", None)}


def header_lines(spec: str | None, backends: list, device: str | None, profile: str) -> list[str]:
    """The report header: implementation, device, profile, versions, declared space, crashed case files."""
    import hypothesis
    import torch

    import pagedkv
    from pagedkv.testing.casefiles.writing import crashed_case_files
    from pagedkv.testing.space import capabilities_under_test, pick_device

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = pick_device(device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    interp = " (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    lines = [
        f"pagedkv {pagedkv.__version__}: implementation under test: "
        f"{spec or ', '.join(pagedkv.available_backends()) + ' (built-in)'}",
        f"pagedkv device: {device} [{name}]; Hypothesis profile: {profile}",
        f"versions: torch {torch.__version__}, triton {triton_version}{interp}, hypothesis {hypothesis.__version__}",
    ]
    if spec:
        for backend in backends:
            lines.append(f"pagedkv declared space: {capabilities_under_test(backend).summary()}")
            lines += [f"pagedkv drawn from: {note}" for note in drawn_space(backend)]
    left = crashed_case_files()
    if left:
        lines.append(f"pagedkv: {len(left)} case file(s) left by a run that crashed mid-case (replay them): "
                     + ", ".join(str(p) for p in left[:3]))
    return lines


def drawn_space(backend: Any) -> list[str]:
    """Where this run draws less than the candidate declares, one line each: a dtype Triton's interpreter
    leaves out, the interpreter's example cap, the compile budget's palette (``specialize_on``)."""
    from hypothesis import settings

    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.space import capabilities_under_test, example_cap
    from pagedkv.testing.strategies.geometry import run_palette

    declared, judged = capabilities_of(backend), capabilities_under_test(backend)
    notes = [f"{dtype} declared, not drawn: Triton's interpreter multiplies its bit patterns"
             for dtype in sorted(declared.dtypes - judged.dtypes)]
    cap = example_cap((backend,), settings().max_examples)
    if cap is not None:
        notes.append(f"at most {cap} examples a property (Triton's interpreter runs the kernels)")
    palette = run_palette(capabilities_under_test(backend, for_drawing=True))
    if palette is not None:
        notes.append(f"the compile budget (specialize_on {sorted(palette.names)}): {palette.describe()}")
    return notes


def failure_text(sentence: str, outcome: Any, backend: Any = None) -> str:
    """A failing property in a few lines: its sentence, the pools' layout where ``backend`` declares one other
    than NHD (a case's ``layout`` field names how K and V share storage, not this), then per distinct failure
    the located mismatch, the case in the one-line notation and as Python, and the replay command."""
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.cases.notation import brief

    lines = [f"property: {sentence}"]
    declared = capabilities_of(backend).layout_other_than_nhd if backend is not None else None
    if declared:
        lines.append(f"pools: {declared}, the layout the candidate declares (each case's layout= says how K and V "
                     f"share storage; positions are compared logically)")
    many = len(outcome.failures) > 1
    for i, failure in enumerate(outcome.failures, 1):
        if many:
            lines.append(f"-- failure {i} of {len(outcome.failures)} --")
        message = str(failure.error).strip()
        if not isinstance(failure.error, AssertionError):
            message = f"{type(failure.error).__name__}: {message}"
        lines += [line for line in message.splitlines()[:8]]
        if failure.case is not None:
            short, exact = brief(failure.case), repr(failure.case)
            lines += [f"case: {short}"] + ([f"      {exact}"] if exact != short else [])
        if failure.replay:
            lines.append(f"replay: {failure.replay}")
    return "\n".join(lines)


def _counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun: "1 property", "3 properties"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def _records(stats: dict) -> list[dict]:
    seen = []
    for reports in stats.values():
        for report in reports:
            if getattr(report, "when", "call") not in ("call", "setup"):
                continue
            for key, value in getattr(report, "user_properties", ()):
                if key == _KEY:
                    seen.append(json.loads(value))
    return seen


def tally(stats: dict) -> dict[str, dict]:
    """Per backend: :func:`pagedkv.testing.verdict.count` of its recorded verdicts."""
    from pagedkv.testing.verdict import count

    by_backend: dict[str, list] = defaultdict(list)
    for r in _records(stats):
        by_backend[r["backend"]].append(r)
    return {name: count(records) for name, records in by_backend.items()}


def what_was_judged(stats: dict, name: str) -> str:
    """``"kernels"``, ``"a cache manager"``, ``"kernels and a cache manager"`` or ``"nothing"``: what of backend
    ``name`` ran (a backend may provide kernels, a manager, or both)."""
    ran = {r["kind"] == "manager" for r in _records(stats)
           if r["backend"] == name and r["status"] != "skipped" and r["kind"] in ("property", "manager")}
    return {frozenset({False}): "kernels", frozenset({True}): "a cache manager",
            frozenset({False, True}): "kernels and a cache manager"}.get(frozenset(ran), "nothing")


def is_conformance_test(item: Any) -> bool:
    """Whether a pytest item is one of the suite's tests (a module of :mod:`pagedkv.testing.suite`)."""
    from pathlib import Path

    import pagedkv.testing.suite as suite

    path = getattr(item, "path", None)
    return path is not None and Path(path).resolve().parent == Path(suite.__file__).resolve().parent


def deselected_conformance_tests(stats: dict) -> list[str]:
    """Node ids of the suite's tests the run deselected (``-k``, ``-m``, ``--deselect``, an ``addopts`` line):
    not judged and outside every count, so the verdict names them (``deselected``). ``stats["pagedkv_deselected"]``
    (what the plugin gathered, from every xdist worker) where given, else the terminal reporter's own list."""
    if "pagedkv_deselected" in stats:
        return sorted(set(stats["pagedkv_deselected"]))
    return sorted(item.nodeid for item in stats.get("deselected", []) if is_conformance_test(item))


def summary_lines(stats: dict, backends: list, spec: str | None) -> list[str]:
    """The terminal summary: per backend, judged / skipped by reason / findings, regressions, declared space;
    the conformance tests deselected, where any were."""
    from pagedkv.backends import backend_name
    from pagedkv.backends.capabilities import FEATURE_NAMES
    from pagedkv.testing.managers import declarations
    from pagedkv.testing.non_promises import REFERENCE
    from pagedkv.testing.space import capabilities_under_test

    counts = tally(stats)
    lines = []
    deselected = deselected_conformance_tests(stats)
    if deselected:
        lines.append(f"pagedkv: {len(deselected)} conformance tests deselected (-k / -m / --deselect / addopts): not "
                     f"judged and in no count below (the JSON verdict lists them)")
    for backend in backends:
        name = backend_name(backend)
        if name not in counts:
            continue
        t, reg = counts[name]["properties"], counts[name]["regressions"]
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(t["skipped_by_reason"].items(),
                                                                     key=lambda kv: -kv[1])) or "none"
        share = f" ({t['judged_fraction']:.0%})" if t["judged_fraction"] is not None else ""
        lines.append(f"pagedkv {name}: judged {what_was_judged(stats, name)}")
        judged = _counted(t["judged"], "property", "properties")
        lines.append(f"pagedkv {name}: {judged} judged ({t['failed']} failing) of {t['applicable']} its ops "
                     f"allow{share}; {_counted(t['findings'], 'finding')}; skipped: {skipped}")
        for r in _records(stats):
            if r["backend"] == name and r.get("non_promise") and r["status"] == "finding":
                files = ", ".join(f["case_file"] for f in r.get("failures", ()) if f.get("case_file")) or "no case file"
                promise = r["non_promise"]
                lines.append(f"pagedkv {name}: finding on {r['prop']} (declared non-promise: {promise['reason']}; "
                             f"{promise['bound']}): {files}")
        declared = declarations.merge(r["declarations"] for r in _records(stats)
                                      if r["backend"] == name and r.get("declarations"))
        if declared is not None:  # every layout's search as one line
            lines.append(f"pagedkv {name}: {declarations.describe(declared)}")
        if reg["judged"] or reg["findings"] or reg["skipped"]:
            not_run = ", ".join(f"{n} {r}" for r, n in reg["skipped_by_reason"].items()) or "none"
            lines.append(f"pagedkv {name}: regression cases run {reg['judged'] + reg['findings']} ({reg['failed']} "
                         f"failing, {_counted(reg['findings'], 'finding')}); not run: {not_run}")
        caps = capabilities_under_test(backend)
        missing = ", ".join(sorted(FEATURE_NAMES - caps.features)) or "none"
        lines.append(f"pagedkv {name}: declared space {caps.summary()}; optional features declared (checked): "
                     f"{', '.join(sorted(caps.features)) or 'none'}; not declared (not covered): {missing}")
        bound = caps.non_promise(REFERENCE)
        if bound is not None:
            lines.append(f"pagedkv {name}: fp64 reference judged at the declared tolerance {bound.describe()} "
                         f"({bound.reason})")
    return lines


def judged_problem(stats: dict, spec: str | None, minimum: float, command: str) -> str | None:
    """Why the run must fail although no test failed, or ``None``: a candidate named and no conformance
    property run, or a judged share under ``minimum`` (:data:`pagedkv.testing.verdict.DEFAULT_MIN_JUDGED`
    unless lowered)."""
    counts = tally(stats)
    if spec and not any(t["properties"]["judged"] + t["properties"]["findings"] for t in counts.values()):
        return (f"PAGEDKV_IMPL / --pagedkv-impl names {spec!r}, but no pagedkv conformance property was "
                f"judged (were its tests collected?); run the suite with: {command.format(spec=spec)}")
    for name, c in counts.items():
        t = c["properties"]
        if minimum and t["applicable"] and t["judged"] / t["applicable"] < minimum:
            return (f"{name}: {t['judged']} of {t['applicable']} applicable properties judged "
                    f"({t['judged'] / t['applicable']:.0%}), under the required share {minimum:.3g} "
                    f"(--pagedkv-min-judged / ini pagedkv_min_judged lowers it explicitly)")
    return None


def crash_section(report: Any) -> str | None:
    """For a test whose xdist worker died mid-case: the case file it left and its replay command."""
    if not (report.failed and "crashed while running" in str(report.longrepr)[:2000]):
        return None
    from pagedkv.testing.casefiles.writing import case_file_path

    path = case_file_path(report.nodeid)
    if path.exists():
        return f"crashed while running the case in {path}\nreplay: python -m pagedkv replay {path}"
    return None


#: The ``schema`` field of the JSON verdict; bumped when a field changes meaning or goes away.
VERDICT_SCHEMA = "pagedkv-verdict/2"


def declared_space(caps: Any) -> dict:
    """A backend's declared :class:`~pagedkv.backends.capabilities.Capabilities` as plain JSON data."""
    from pagedkv.layouts import describe as describe_layout

    return {"summary": caps.summary(), "block_sizes": caps.block_sizes.describe(),
            "head_dims": caps.head_dims.describe(), "gqa_groups": caps.gqa_groups.describe(),
            "num_kv_heads": caps.num_kv_heads.describe(), "dtypes": sorted(caps.dtypes),
            "max_pool_bytes": caps.max_pool_bytes, "layout": describe_layout(caps.layout),
            "page_table": caps.page_table, "strided_pools": caps.strided_pools,
            "strided_metadata": caps.strided_metadata, "repeated_blocks": caps.repeated_blocks,
            "split_k": caps.split_k, "head_dims_v": caps.head_dims_v.describe() if caps.head_dims_v else None,
            "shared_kv_storage": caps.shared_kv_storage, "lse": caps.lse, "lse_base": caps.lse_base,
            "nondeterminism_ulp": caps.nondeterminism_ulp,
            "specialize_on": sorted(caps.specialize_on) if caps.specialize_on is not None else None,
            "features": sorted(caps.features), "preconditions": sorted(caps.preconditions),
            "non_promises": {name: bound.as_dict() for name, bound in caps.non_promises}}


def declared_spaces(backends: list) -> dict[str, dict]:
    """Each backend's :func:`declared_space`, by name, as this process reads its capabilities now."""
    from pagedkv.backends import backend_name
    from pagedkv.testing.space import capabilities_under_test

    return {backend_name(b): declared_space(capabilities_under_test(b)) for b in backends}


def declaration_mismatches(first: dict[str, dict], reads: list[tuple[str, dict]]) -> list[str]:
    """Where a candidate's declared space differs between the read the header printed (``first``) and a later
    read (``reads``: ``(who, declared_spaces(...))``, a pytest-xdist worker's or the run's end): one line each, naming
    the process, the candidate and the fields. The cases are drawn from each process's own read, so a
    declaration that differs across processes or over time makes the verdict describe a space that was not the
    one searched."""
    lines = []
    for who, spaces in reads:
        for name, space in spaces.items():
            declared = first.get(name)
            if declared is None:
                continue
            fields = [f for f in sorted(set(declared) | set(space)) if declared.get(f) != space.get(f)]
            if len(fields) > 1 and "summary" in fields:  # the summary repeats the fields: named alone, or not
                fields.remove("summary")
            if fields:
                lines.append(f"{who}: candidate {name} declared {', '.join(f'{f}={space.get(f)!r}' for f in fields)} "
                             f"where the run's header read {', '.join(f'{f}={declared.get(f)!r}' for f in fields)}")
    return lines


def failed_tests(stats: dict) -> list[dict]:
    """Every test that failed or errored, in any phase: ``{"nodeid", "when", "message"}`` (the report's first
    line). It includes failures that record no property verdict, such as a crashed xdist worker, a fixed case of
    ``test_limits`` or a test's own assertion."""
    out = []
    for key in ("failed", "error"):
        for report in stats.get(key, ()):
            nodeid = getattr(report, "nodeid", "")
            if not nodeid:
                continue
            text = str(getattr(report, "longreprtext", "") or getattr(report, "longrepr", "") or "").strip()
            line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")), "")
            out.append({"nodeid": nodeid, "when": getattr(report, "when", "call"),
                        "message": (line or (text.splitlines()[-1] if text else ""))[:500]})
    return out


def verdict(stats: dict, backends: list, spec: str | None, *, profile: str = "", exit_status: int = 0,
            declaration_mismatch: list[str] = ()) -> dict:
    """The run's verdict as JSON data (schema :data:`VERDICT_SCHEMA`; every field in ``docs/gating.md``).

    Per candidate: its declared space; the properties passed, judged (passed and failed), failed (each
    failure's message, case file, replay command and ``reproduced``), findings (within a declared
    non-promise's bound, or outside a declared precondition, with the declaration), skipped (by property,
    with the reason and its :class:`~pagedkv.testing.verdict.SkipReason`); the counts of
    :func:`pagedkv.testing.verdict.count`, which the terminal summary prints; and the regression cases."""
    from pagedkv.backends import backend_name
    from pagedkv.testing.space import capabilities_under_test
    from pagedkv.testing.managers.declarations import merge as merge_declarations
    from pagedkv.testing.verdict import count

    records = _records(stats)
    out = {"schema": VERDICT_SCHEMA, "implementation": spec, "profile": profile, "exit_status": exit_status,
           "passed": exit_status == 0 and not declaration_mismatch, "deselected": deselected_conformance_tests(stats),
           "failed_tests": failed_tests(stats), "declaration_mismatch": list(declaration_mismatch), "candidates": []}
    for backend in backends:
        name = backend_name(backend)
        mine = [r for r in records if r["backend"] == name]
        props = [r for r in mine if r["kind"] in ("property", "manager", "precondition")]
        regs = [r for r in mine if r["kind"] == "regression"]
        counts = count(mine)

        def entry(r: dict) -> dict:
            return {"property": r["prop"], "kind": r["kind"], "message": r["reason"],
                    "failures": r.get("failures", []), "measured": r.get("measured", {})}

        def by_status(rows: list, status: str) -> list:
            return [{**entry(r), "non_promise": r.get("non_promise")} if status == "finding" else entry(r)
                    for r in rows if r["status"] == status]

        out["candidates"].append({
            "name": name,
            "declared_space": declared_space(capabilities_under_test(backend)),
            "drawn_space": drawn_space(backend),
            "passed": sorted({r["prop"] for r in props if r["status"] == "passed" and r["kind"] != "precondition"}),
            "judged": sorted({r["prop"] for r in props if r["status"] in ("passed", "failed")
                              and r["kind"] != "precondition"}),
            "measured": {r["prop"]: r["measured"] for r in props if r.get("measured") and r["kind"] != "precondition"},
            "failed": by_status(props, "failed"),
            "findings": by_status(props, "finding"),
            "skipped": [{"property": r["prop"], "reason": r["reason"], "skip": r.get("skip")}
                        for r in props if r["status"] == "skipped"],
            "skipped_by_reason": counts["properties"]["skipped_by_reason"],
            "counts": counts["properties"],
            "regressions": {**counts["regressions"], "failed_cases": by_status(regs, "failed"),
                            "finding_cases": by_status(regs, "finding")},
            "manager_declarations": merge_declarations(r["declarations"] for r in props if r.get("declarations")),
        })
    return out


#: At most this many case files are replayed for ``reproduced`` (each is a fresh process); the rest say ``None``.
MAX_REPLAYS = 20
#: Seconds one replay may take before its failure counts as not checked (``None``).
REPLAY_TIMEOUT_S = 300


#: ``reproduced`` by a replay's exit status: 1 failed again; 0 passes and 3 did not reproduce: ``False``;
#: anything else (2: the file or backend was refused) and a timeout: ``None``, not checked.
REPRODUCED_BY_STATUS = {1: True, 0: False, 3: False}


def replay_status(command: str, timeout_s: float = REPLAY_TIMEOUT_S) -> int | None:
    """The exit status of a failure's replay command (``python -m pagedkv replay FILE ...``) run in a fresh
    process of this interpreter: 1 the failure reproduced, 3 it did not (depends on earlier calls or is
    nondeterministic), 0 the case passes, 2 the file or backend was refused; ``None`` past ``timeout_s``
    or when ``command`` is not a replay command."""
    import shlex
    import subprocess
    import sys

    words = shlex.split(command)
    if words[:4] != ["python", "-m", "pagedkv", "replay"]:
        return None
    try:
        done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return done.returncode


def check_reproduced(data: dict, limit: int = MAX_REPLAYS) -> None:
    """Fill each failure's ``reproduced`` in a :func:`verdict` (in place) by replaying its case file in a
    fresh process (:func:`replay_status`): ``True`` when replay fails again, ``False`` when it passes or
    does not reproduce (exit 0 or 3; ``replay_status`` gives the exit status), ``None`` when not checked
    (no case file, over ``limit``, a timeout, or the replay refused the file or could not load the backend)."""
    done = 0
    for candidate in data["candidates"]:
        regs = candidate["regressions"]
        for entry in candidate["failed"] + candidate["findings"] + regs["failed_cases"] + regs["finding_cases"]:
            for failure in entry["failures"]:
                if failure.get("reproduced") is not None or not failure.get("replay") or done >= limit:
                    continue
                done += 1
                status = replay_status(failure["replay"])
                failure["replay_status"] = status
                failure["reproduced"] = REPRODUCED_BY_STATUS.get(status)


def write_unfinished(path: Any, spec: str | None, profile: str = "", usage_error: str | None = None) -> None:
    """Write the verdict of a run that has not ended to ``path``: ``passed`` false, ``exit_status`` null,
    no candidates. :func:`write_verdict` replaces it at the end; a process that ends before (a kernel calling
    ``os._exit(0)``, a crash, a kill) leaves it, so a CI job reading ``passed`` never sees a green it did not
    earn, whatever the exit status was. ``usage_error``: the run ended before any test, refused (exit status 4,
    pytest's usage error), for this reason (a candidate that does not load)."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"schema": VERDICT_SCHEMA, "implementation": spec, "profile": profile, "exit_status": None,
              "passed": False, "candidates": []}
    if usage_error is None:
        record["unfinished"] = "the run has not ended (or its process ended without a summary)"
    else:
        record.update(exit_status=4, usage_error=usage_error)  # pytest's ExitCode.USAGE_ERROR
    path.write_text(json.dumps(record, indent=2) + "\n")


def write_verdict(path: Any, stats: dict, backends: list, spec: str | None, **kw) -> None:
    """Write :func:`verdict` as indented JSON to ``path`` (its directory created), each failure's
    ``reproduced`` checked by replaying its case file (:func:`check_reproduced`)."""
    from pathlib import Path

    data = verdict(stats, backends, spec, **kw)
    check_reproduced(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
