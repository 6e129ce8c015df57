"""``python -m pagedkv peers``: the conformance suite against each peer, printed as a property x peer table.

Each available peer (:data:`pagedkv.tools.peers.PEERS`) runs the whole conformance suite
(``pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:NAME``: every registered
property, the findings outside declared preconditions, the regression case files and the limits) in its
own pytest process, which logs each test's outcome as it ends (this module is also its pytest plugin);
each run becomes one column. A test that spends ``--budget`` seconds without failing stops drawing
examples (``partial: N passed``: slow kernels are shown, not hidden). A cell is ``pass``, ``FAIL [n]``
(note ``n``: the error and the shrunk case), ``skipped [n]`` (note: the reason), ``finding [n]`` (a
declared precondition broken on purpose: non-gating, reported) or ``-`` (not run for that peer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedkv.cli.common import PROFILE_NAMES

#: Parametrized tests shown as one row (their ids are inputs, not properties).
GROUPED = {"test_every_fault_is_rejected_on_a_fixed_case": "every fault kind rejected on a fixed case",
           "test_regression_case_replays_clean": "regression case files replay clean"}
FINDING = "test_finding_outside_declared_preconditions"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``peers``."""
    parser = subparsers.add_parser(
        "peers", help="run the conformance suite against other projects' kernels and print a conformance table",
        description="Run the conformance suite against each peer (pagedkv.tools.peers: PyTorch, flash-attn, "
                    "vLLM, SGLang, transformers) usable here and print a property x peer table: pass, FAIL with "
                    "the shrunk case, skipped with the reason, or finding (outside a declared precondition, "
                    "non-gating). Peers not installed are listed with the reason. Exit status 1 when a peer fails "
                    "a gating test.")
    parser.add_argument("--peers", metavar="NAMES", help="comma-separated peer names (default: every peer)")
    parser.add_argument("--profile", default="ci", choices=PROFILE_NAMES,
                        help="Hypothesis profile (default: ci, derandomized)")
    parser.add_argument("--jobs", "-n", type=int, default=2, metavar="N",
                        help="pytest-xdist workers per peer (default: 2; 0 runs in one process)")
    parser.add_argument("--device", default=None, help="device for the suite's tensors (default: the suite's choice)")
    parser.add_argument("--timeout", type=float, default=900, metavar="S",
                        help="seconds one peer's suite may run before it is stopped and reported (default: 900)")
    parser.add_argument("--budget", type=float, default=20, metavar="S",
                        help="seconds one test may spend on examples before its remaining examples are skipped and "
                             "the row says 'partial: N passed' (a test that fails runs on; 0: no budget; default: 20, "
                             "for vLLM's Triton kernels in Triton's interpreter)")
    parser.add_argument("--json", metavar="PATH", help="also write every test's outcome and the timings as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table and its notes as Markdown")
    parser.add_argument("--reuse", metavar="JSON", action="append", default=[],
                        help="take the columns of the peers an earlier --json run holds from that file instead of "
                             "running them again (repeatable; a peer in no file runs; the profiles must match): a "
                             "slow peer re-run alone, with a longer --timeout, joins the table of the others")
    parser.set_defaults(func=run)
    return parser


def _peer_of(test_id: str, peer: str) -> str:
    """The parametrization of ``test_id`` without the peer's own name."""
    m = re.fullmatch(r"([^\[]+)(?:\[(.*)\])?", test_id)
    params = [p for p in (m.group(2) or "").split("-") if p and p != peer]
    return m.group(1), "-".join(params)


def _row(func: str, params: str) -> str:
    if func in GROUPED:
        return GROUPED[func]
    if func == FINDING:
        parts = params.split("-", 1)
        return f"finding: {parts[1]} ({parts[0]})" if len(parts) == 2 else "findings (no precondition declared)"
    name = func.removeprefix("test_")
    return f"{name} [{params}]" if params else name


def _case_from_reason(text: str) -> str:
    """The case of a ``replay: python -m pagedkv replay FILE`` line in ``text``, as a one-line summary."""
    found = re.findall(r"replay: python -m pagedkv replay ([^\s{}\"']+)", text)  # the message's, not the source's
    if not found:
        return ""
    path = found[-1]
    try:
        from pagedkv.testing.casefiles.reading import load_case_file
        from pagedkv.testing.cases.notation import brief

        return f"{brief(load_case_file(path, check_backend=False)['case'])} (python -m pagedkv replay {path})"
    except Exception as exc:  # a crashed or unreadable file: say so, keep the path
        return f"python -m pagedkv replay {path} ({type(exc).__name__})"


def pytest_runtest_logreport(report) -> None:
    """pytest hook (this module is loaded with ``-p pagedkv.cli.peers`` in each peer's run): one JSON line
    per test phase in ``$PAGEDKV_PEERS_LOG``, written as it happens, so a run stopped at ``--timeout``
    keeps what it did."""
    path = os.environ.get("PAGEDKV_PEERS_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller logs every worker's reports
        return
    if report.skipped and hasattr(report, "wasxfail"):
        outcome, text = "finding", str(report.wasxfail)
    elif report.skipped:
        longrepr = report.longrepr
        outcome, text = "skipped", str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    elif report.failed:
        outcome, text = "FAIL", str(report.longrepr)
    else:
        outcome, text = "pass", ""
    with open(path, "a") as f:
        f.write(json.dumps(dict(nodeid=report.nodeid, when=report.when, outcome=outcome, text=text,
                                seconds=report.duration)) + "\n")


def _failure_line(text: str) -> str:
    """The first ``E`` line of a failure's traceback (the assertion), else its last line."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    first = next((line for line in lines if re.match(r"[\w.]*(Error|Mismatch|Exception)\b", line)), "") or \
        next((line for line in lines if line), "")
    return first or (text.strip().splitlines() or ["failed"])[-1]


def _budget_spent(reason: str) -> bool:
    """Whether a skip reason is the example budget's (``[PROPERTY: ]time budget [of S s] spent: N examples
    passed ...``)."""
    return re.match(r"([\w.-]+: )?time budget (of [\d.e+-]+ s )?spent", reason) is not None


def _outcomes(log: Path, peer: str) -> list[dict]:
    """Every test of one run's log: id, row, status (pass/FAIL/skipped/finding), detail, seconds."""
    tests: dict[str, dict] = {}
    rank = {"pass": 0, "skipped": 1, "partial": 1, "finding": 2, "FAIL": 3}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if r["when"] != "call" and r["outcome"] == "pass":
            continue
        name = r["nodeid"].split("::")[-1]
        t = tests.setdefault(name, dict(test=name, row=_row(*_peer_of(name, peer)), status="pass", detail="",
                                        seconds=0.0))
        t["seconds"] = round(t["seconds"] + r["seconds"], 2)
        if rank[r["outcome"]] <= rank[t["status"]]:
            continue
        if r["outcome"] == "FAIL":
            case = _case_from_reason(r["text"])
            t["status"], t["detail"] = "FAIL", _failure_line(r["text"]) + (f"; case: {case}" if case else "")
        elif r["outcome"] == "finding":
            case = _case_from_reason(r["text"])
            t["status"], t["detail"] = "finding", re.sub(r"; replay: .*", "", r["text"]) + (
                f"; case: {case}" if case else "")
        else:
            reason = re.sub(r"^Skipped: ", "", r["text"]).strip().splitlines()[0]
            t["status"], t["detail"] = ("partial" if _budget_spent(reason) else "skipped"), reason
    return list(tests.values())


def run_suite(peer: str, profile: str, jobs: int, device: str | None, timeout: float, budget: float = 0) -> dict:
    """One peer's suite in a pytest subprocess: ``{peer, seconds, exit, tests: [...], error}``."""
    from pagedkv.testing.casefiles.writing import failure_dir

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        log.touch()
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "-p", "pagedkv.cli.peers",
               "--pagedkv-impl", f"pagedkv.tools.peers:{peer}", "--hypothesis-profile", profile,
               "-p", "no:cacheprovider", "-q"]
        if jobs > 0:
            cmd += ["-n", str(jobs)]
        if device:
            cmd += ["--pagedkv-device", device]
        env = {**os.environ, "PAGEDKV_PEERS_LOG": str(log), "PAGEDKV_TEST_BUDGET_S": str(budget or ""),
               "PAGEDKV_FAILURE_DIR": os.path.join(failure_dir(), "peers", peer)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            code, tail = proc.returncode, proc.stdout[-2000:] + proc.stderr[-1000:]
        except subprocess.TimeoutExpired:
            code, tail = None, ""
        seconds = time.perf_counter() - t0
        tests = _outcomes(log, peer)
    error = "" if tests else f"no test ran (exit {code}): {tail.strip()[-600:]}"
    if code is None:
        error = (f"the suite ran past --timeout {timeout:.0f} s and was stopped: {len(tests)} tests reported, "
                 f"the rest did not run (shown as -)")
    return dict(peer=peer, seconds=round(seconds, 1), exit=code, tests=tests, error=error,
                capabilities=_declared(peer))


def _declared(peer: str) -> str:
    """The peer's declared space in one line (``""`` when it declares none)."""
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.tools.peers import PEERS

    backend = PEERS[peer]()
    caps = getattr(backend, "capabilities", None)
    return capabilities_of(backend).summary() if caps is not None else "nothing declared (everything)"


def _cell(tests: list[dict], notes: dict[str, int]) -> str:
    def note(text: str) -> int:
        return notes.setdefault(text, len(notes) + 1)

    if not tests:
        return "-"
    if len(tests) == 1:
        t = tests[0]
        if t["status"] == "partial":
            passed = re.search(r"(\d+) examples passed", t["detail"])
            generic = re.sub(r"\d+ examples passed, ", "", t["detail"])
            return f"partial: {passed.group(1) if passed else '?'} passed [{note(generic)}]"
        return t["status"] if t["status"] == "pass" else f"{t['status']} [{note(t['detail'])}]"
    counts: dict[str, list] = {}
    for t in tests:
        counts.setdefault(t["status"], []).append(t)
    parts = []
    for status in ("pass", "partial", "FAIL", "finding", "skipped"):
        group = counts.get(status, [])
        if not group:
            continue
        if status == "pass":
            parts.append(f"pass {len(group)}")
        else:
            refs = sorted({note(f"{t['test']}: {t['detail']}" if status == "FAIL" else
                                re.sub(r"^[\w.-]+: |\d+ examples passed, ", "", t["detail"])) for t in group})
            parts.append(f"{status} {len(group)} [{', '.join(map(str, refs))}]")
    return ", ".join(parts)


def format_table(results: list[dict], unavailable: dict[str, str]) -> str:
    """The Markdown table (rows in suite order, one column per peer run) and its numbered notes."""
    rows: list[str] = []
    for r in results:
        for t in r["tests"]:
            if t["row"] not in rows:
                rows.append(t["row"])
    notes: dict[str, int] = {}
    peers = [r["peer"] for r in results]
    lines = ["| property | " + " | ".join(peers) + " |", "|---|" + "---|" * len(peers)]
    for row in rows:
        cells = [_cell([t for t in r["tests"] if t["row"] == row], notes) for r in results]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines.append("| **suite time (s)** | " + " | ".join(f"{r['seconds']:.0f}" for r in results) + " |")
    totals = []
    for r in results:
        c = {s: sum(t["status"] == s for t in r["tests"]) for s in ("pass", "partial", "FAIL", "skipped", "finding")}
        totals.append(f"{c['pass']} pass, {c['partial']} partial, {c['FAIL']} FAIL, {c['skipped']} skipped, "
                      f"{c['finding']} finding")
    lines.append("| **tests** | " + " | ".join(totals) + " |")
    out = ["\n".join(lines), ""]
    if notes:
        out.append("Notes:\n")
        out += [f"{n}. {text.replace('|', '/')}" for text, n in sorted(notes.items(), key=lambda kv: kv[1])]
    spaces = [f"- {r['peer']}: {r['capabilities']}" for r in results if r.get("capabilities")]
    if spaces:
        out.append("\nDeclared spaces (`capabilities`):\n")
        out += spaces
    for r in results:
        if r["error"]:
            out.append(f"\n{r['peer']}: {r['error']}")
    if unavailable:
        out.append("\nNot run here:\n")
        out += [f"- {name}: {reason}" for name, reason in unavailable.items()]
    return "\n".join(out) + "\n"


def reused_results(paths: list[str], profile: str) -> dict[str, dict]:
    """``{peer: result}`` from earlier ``--json`` files (a later file's column wins).

    Raises:
        OSError: a file cannot be read. ValueError: not JSON, or written under another profile.
        KeyError: no ``results`` list in it.
    """
    out: dict[str, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("profile") != profile:
            raise ValueError(f"{path} was run under profile {data.get('profile')!r}, this table under {profile!r}")
        for result in data["results"]:
            for t in result["tests"]:  # files written before the budget's message named its seconds
                if t["status"] == "skipped" and _budget_spent(t["detail"]):
                    t["status"] = "partial"
            out[result["peer"]] = result
    return out


def run(args: argparse.Namespace) -> int:
    """``python -m pagedkv peers``: 0 when no peer run fails a gating test, 1 otherwise, 2 on a bad name."""
    from pagedkv.tools.peers import PEERS, available

    names = [n.strip() for n in args.peers.split(",") if n.strip()] if args.peers else list(PEERS)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        print(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}", file=sys.stderr)
        return 2
    try:
        reused = reused_results(args.reuse, args.profile)
    except (OSError, ValueError, KeyError) as exc:
        print(f"--reuse: {exc}", file=sys.stderr)
        return 2
    reasons = available()
    unavailable = {n: reasons[n] for n in names if reasons[n] and n not in reused}
    results = []
    for name in names:
        if name in reused:
            results.append(reused[name])
            continue
        if name in unavailable:
            continue
        print(f"{name}: running the conformance suite (profile {args.profile}) ...", file=sys.stderr, flush=True)
        results.append(run_suite(name, args.profile, args.jobs, args.device, args.timeout, args.budget))
        print(f"{name}: {results[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
    table = format_table(results, unavailable)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(profile=args.profile, results=results, unavailable=unavailable),
                                              indent=1) + "\n")
    failed = any(r["error"] or any(t["status"] == "FAIL" for t in r["tests"]) for r in results)
    return 1 if failed else 0
