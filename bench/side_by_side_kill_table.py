"""One table from two runs on the same mutants: ``python -m pagedkv mutate --json`` (pagedkv's properties)
and ``bench/engine_tests_vs_mutants.py --json`` (the engine's own tests).

    python bench/side_by_side_kill_table.py MUTATE.json ENGINE.json --arguments ARGS.json --json OUT.json \
        --markdown OUT.md --title TITLE [--more-mutate MUTATE2.json] [--more-engine ENGINE2.json] [--sample TEXT]

``ARGS.json`` maps a mutant id to the argument for a survivor (why it is equivalent under the adapter's
configuration, or what no check reaches); a survivor without one is listed as unargued. ``--more-mutate`` and
``--more-engine`` add the rows of further runs on other mutants of the same sources (a sample run in parts;
the first run's settings head the table); ``--sample`` says how the mutants were chosen (``--only`` alone
records ``all``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(mutate: dict, engine: dict, arguments: dict) -> list[dict]:
    theirs = {r["id"]: r for r in engine["rows"]}
    out = []
    for m in mutate["mutants"]:
        runs = [r for r in m["runs"] if not r["explicit"]]
        t = theirs.get(m["id"])
        if not runs and m["status"] == "killed":  # before any run: the candidate does not load with the mutant
            runs = [{"killed": True, "seconds": 0.0, "error": m["note"]}]
        out.append({
            "id": m["id"], "function": m["function"], "diff": m["diff"],
            "machine_killed": sum(r["killed"] for r in runs), "machine_runs": len(runs),
            "machine_seconds": round(sum(r["seconds"] for r in runs), 2), "machine_wall_s": m["wall_s"],
            "machine_error": next((r["error"] for r in runs if r["killed"]), ""),
            "tests_killed": None if t is None else t["killed"], "tests_seconds": None if t is None else t["seconds"],
            "tests_failure": "" if t is None else t["first_failure"],
            "argument": arguments.get(m["id"], ""),
        })
    return out


def totals(table: list[dict]) -> dict:
    ran = [r for r in table if r["tests_killed"] is not None]
    machine = {r["id"] for r in table if r["machine_killed"]}
    tests = {r["id"] for r in ran if r["tests_killed"]}
    return {"mutants": len(table), "tests_ran_on": len(ran), "machine_killed": len(machine),
            "tests_killed": len(tests), "both": len(machine & tests), "machine_only": len(machine - tests),
            "tests_only": len(tests - machine),
            "neither": len([r for r in ran if r["id"] not in machine and r["id"] not in tests]),
            "machine_all_runs": len([r for r in table
                                     if r["machine_runs"] and r["machine_killed"] == r["machine_runs"]])}


def markdown(table: list[dict], t: dict, title: str, mutate: dict, engine: dict, gate: str = "state machine",
             tests: str = "`tests/v1/core`") -> str:
    cfg = mutate["config"]
    lines = [f"# {title}", "",
             f"Sources: `{cfg['sources']}`; sample: {cfg['sample']}; {gate}: profile `{cfg['profile']}` "
             f"({cfg['seeds']} seeds, generated examples), budget {cfg['budget_s']} s a mutant, "
             f"{cfg['workers']} worker. vLLM's tests: {len(engine['passing_tests'])} tests of a CPU-runnable copy of "
             f"{tests} that pass on the unmutated wheel ({len(engine['left_out_tests'])} that fail or error "
             f"there left out).", "",
             f"**Totals:** {t['mutants']} mutants; the {gate} kills {t['machine_killed']} "
             f"({t['machine_all_runs']} in every seed); vLLM's tests kill {t['tests_killed']} of the "
             f"{t['tests_ran_on']} they ran on; both {t['both']}, pagedkv's only {t['machine_only']}, "
             f"their tests only {t['tests_only']}, neither {t['neither']}.", "",
             "| mutant | function | change | pagedkv kills | pagedkv s (runs) | wall s | their tests | their s | "
             "argument (survivors) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        tests = "-" if r["tests_killed"] is None else ("killed" if r["tests_killed"] else "survived")
        their_s = "-" if r["tests_seconds"] is None else f"{r['tests_seconds']:.1f}"
        diff = r["diff"].replace("|", "\\|")
        lines.append(f"| {r['id']} | `{r['function']}` | `{diff}` | {r['machine_killed']}/{r['machine_runs']} | "
                     f"{r['machine_seconds']:.1f} | {r['machine_wall_s']:.0f} | {tests} | {their_s} | "
                     f"{r['argument']} |")
    return "\n".join(lines) + "\n"


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text())


def merged(first: dict, more: list[dict], key: str) -> dict:
    """``first`` with the ``key`` rows of every run in ``more`` appended (later runs on other mutants)."""
    return {**first, key: [row for run in (first, *more) for row in run[key]]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutate_json")
    parser.add_argument("engine_json")
    parser.add_argument("--arguments", help="JSON: mutant id -> argument for a survivor")
    parser.add_argument("--json", required=True)
    parser.add_argument("--markdown", required=True)
    parser.add_argument("--title", default="Mutants: pagedkv's state machine beside the engine's own tests")
    parser.add_argument("--gate", default="state machine", help="what ran on pagedkv's side, for the text")
    parser.add_argument("--tests-name", default="`tests/v1/core`", help="the engine's tests, for the text")
    parser.add_argument("--more-mutate", action="append", default=[], metavar="MUTATE_JSON",
                        help="another mutate run on other mutants of the same sources (repeatable)")
    parser.add_argument("--more-engine", action="append", default=[], metavar="ENGINE_JSON",
                        help="another engine-tests run on other mutants of the same sources (repeatable)")
    parser.add_argument("--sample", help="how the mutants were chosen, for the header (default: the run's own)")
    parser.add_argument("--notes", type=Path, help="markdown appended below the table (how the runs were made)")
    args = parser.parse_args(argv)
    mutate = merged(_load(args.mutate_json), [_load(m) for m in args.more_mutate], "mutants")
    engine = merged(_load(args.engine_json), [_load(e) for e in args.more_engine], "rows")
    if args.sample:
        mutate["config"] = {**mutate["config"], "sample": args.sample}
    arguments = json.loads(Path(args.arguments).read_text()) if args.arguments else {}
    table = rows(mutate, engine, arguments)
    t = totals(table)
    Path(args.json).write_text(json.dumps({"config": mutate["config"], "engine_tests": {
        k: engine[k] for k in ("tests", "passing_tests", "left_out_tests")}, "totals": t, "mutants": table}, indent=1))
    notes = "\n" + args.notes.read_text() if args.notes else ""
    Path(args.markdown).write_text(markdown(table, t, args.title, mutate, engine, args.gate, args.tests_name) + notes)
    print(json.dumps(t))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
