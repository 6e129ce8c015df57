"""``python -m pagedkv mutate``: generated mutants of kernel source, killed in k of N seeded runs.

Examples::

    python -m pagedkv mutate --impl indexed --source pagedkv/backends/indexed.py --max-mutants 30 \\
        --seeds 5 --workers 2 --json mutate.json --markdown mutate.md
    python -m pagedkv mutate --impl my_pkg.backend --source my_pkg/kernels.py --equivalent kernels-0042="..."
    python -m pagedkv mutate --shipped --seeds 8          # the shipped faulty backends
    python -m pagedkv mutate --variants my_pkg.bugs:A,my_pkg.bugs:B

Engine and operators: :mod:`pagedkv.tools.mutants.generate`; runs: :mod:`pagedkv.tools.mutants.kill_rates`;
tables: :mod:`pagedkv.tools.mutants.kill_rate_tables`; how to read them: ``docs/mutation.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from pagedkv.cli.common import device_option, profile_option


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mutate``."""
    p = subparsers.add_parser(
        "mutate", parents=[profile_option("dev"), device_option("cpu")],
        help="kill rates of generated mutants of kernel source (and of shipped or given faulty backends)",
        description="Generate mutants of --source files (comparison boundaries, +-1, dropped mask terms and "
                    "guards, index and stride swaps, integer width, accumulator dtype, constants), run the "
                    "registered properties against each in a child process with N random seeds, with and without "
                    "the explicit examples, and report killed-in-k-of-N per mutant and the source lines no property "
                    "pins down. Exit status 1 when a non-equivalent mutant survives.")
    p.add_argument("--impl", default="indexed", metavar="SPEC",
                   help="the implementation the sources belong to (a backend spec; default: indexed)")
    p.add_argument("--source", nargs="+", default=[], metavar="FILE", help="source files to mutate")
    p.add_argument("--shipped", nargs="*", metavar="NAME",
                   help="also run the shipped faulty backends (all, or these names)")
    p.add_argument("--variants", action="append", default=[], metavar="SPEC,SPEC",
                   help="also run these faulty backends (backend specs, comma separated; repeatable)")
    p.add_argument("--seeds", type=int, default=5, metavar="N", help="independent seeded runs per mode (default 5)")
    p.add_argument("--seed-base", type=int, default=0, help="the first seed (seeds are BASE .. BASE + N - 1)")
    p.add_argument("--no-explicit-examples", action="store_true",
                   help="only the generated-examples runs (default: both, explicit examples first in one of them)")
    p.add_argument("--workers", "-j", type=int, default=1, metavar="K", help="child processes at a time")
    p.add_argument("--budget-s", type=float, default=120.0, metavar="S",
                   help="seconds per mutant for all its runs (default 120); a hang is stopped after S + 90")
    p.add_argument("--properties", nargs="+", metavar="NAME", help="only these properties (names or globs), in order")
    p.add_argument("--max-mutants", type=int, metavar="M",
                   help="a sample of M generated mutants (every operator kind represented), split over the sources")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the --max-mutants sample")
    p.add_argument("--operators", nargs="+", metavar="OP", help="only these operator kinds")
    p.add_argument("--functions", nargs="+", metavar="NAME", help="only mutate inside these functions")
    p.add_argument("--only", nargs="+", metavar="ID", help="only these mutant ids")
    p.add_argument("--equivalent", action="append", default=[], metavar="ID=WHY",
                   help="mark a mutant equivalent, with the argument (repeatable)")
    p.add_argument("--equivalent-file", metavar="FILE", help="a JSON object {mutant id: why it is equivalent}")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the run of the unmutated implementation (a property failing there is left out)")
    p.add_argument("--case-dir", default=".pagedkv-failures/mutate", metavar="DIR", help="where case files go")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the report as markdown")
    p.add_argument("--title", default="", help="the markdown report's title")
    p.add_argument("--list", action="store_true", help="list the mutants (id, operator, diff) and exit")
    p.add_argument("--from-json", metavar="FILE",
                   help="run nothing: re-render an earlier --json report with these --equivalent marks "
                        "(to --json / --markdown, or the markdown to stdout)")
    p.set_defaults(func=run)
    return p


def _equivalents(args) -> dict[str, str]:
    marks = {}
    if args.equivalent_file:
        marks.update(json.loads(Path(args.equivalent_file).read_text()))
    for item in args.equivalent:
        key, sep, why = item.partition("=")
        if not sep or not why.strip():
            raise SystemExit(f"--equivalent {item!r}: expected ID=WHY (the argument why it is equivalent)")
        marks[key.strip()] = why.strip()
    return marks


def _mutants(args) -> list:
    import importlib.util

    from pagedkv.tools.mutants.generate import generate, module_name_for, sample

    per_file = []
    for path in args.source:
        if not Path(path).is_file():
            raise SystemExit(f"--source {path}: no such file")
        module = module_name_for(path)
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not Path(spec.origin).samefile(path):
            found = spec.origin if spec else "nothing"
            raise SystemExit(f"--source {path}: `import {module}` loads {found} here, not this file "
                             f"(run from the repository root, or install the package it belongs to)")
        per_file.append(generate(path, module=module, operators=tuple(args.operators or ()) or None,
                                 functions=tuple(args.functions or ())))
    if args.only:
        per_file = [[m for m in ms if m.id in args.only] for ms in per_file]
    if args.max_mutants is not None and per_file:
        share, extra = divmod(args.max_mutants, len(per_file))
        per_file = [sample(ms, share + (i < extra), args.sample_seed) for i, ms in enumerate(per_file)]
    return [m for ms in per_file for m in ms]


def _rerender(args, kill_tables) -> int:
    """``--from-json``: an earlier report with this run's equivalence arguments applied; 0 / 1 as a run."""
    path = Path(args.from_json)
    if not path.is_file():
        raise SystemExit(f"--from-json {path}: no such file")
    report = json.loads(path.read_text())
    if not isinstance(report, dict) or not {"config", "mutants"} <= report.keys():
        raise SystemExit(f"--from-json {path}: not a report written by --json (no 'config' / 'mutants')")
    rows = kill_tables.remark(report["mutants"], _equivalents(args))
    if args.json:
        kill_tables.write_json(args.json, report["config"], rows)
    text = kill_tables.markdown(report["config"], rows, args.title)
    if args.markdown:
        Path(args.markdown).write_text(text)
    elif not args.json:
        print(text)
    c = kill_tables.counts(rows)
    return 1 if c["survived"] or c["error"] else 0


def run(args: argparse.Namespace) -> int:
    """``python -m pagedkv mutate``: 0 when every non-equivalent mutant is killed, 1 otherwise."""
    from pagedkv.backends import load_backend
    from pagedkv.tools.mutants import kill_rate_tables as kill_tables
    from pagedkv.tools.mutants.kill_rates import Job, runnable_properties, run_jobs, source_job

    if args.from_json:
        return _rerender(args, kill_tables)
    mutants = _mutants(args)
    if args.list:
        for m in mutants:
            print(f"{m.id:28} {m.operator:10} {m.function:28} {m.diff}")
        return 0
    marks = _equivalents(args)
    backend = load_backend(args.impl)
    names, left_out = runnable_properties(backend, args.properties)
    modes = [False] if args.no_explicit_examples else [False, True]  # generated first: the budget may end a job
    seeds = list(range(args.seed_base, args.seed_base + args.seeds))
    Path(args.case_dir).mkdir(parents=True, exist_ok=True)
    common = dict(impl=args.impl, properties=names, seeds=seeds, modes=modes, profile=args.profile,
                  device=args.device, budget_s=args.budget_s, case_dir=str(Path(args.case_dir).resolve()))
    t0 = time.monotonic()
    done = {"n": 0}

    finished: dict = {}

    def progress(job, result):
        done["n"] += 1
        row = kill_tables.summarize(job.__dict__, result, marks)
        if job.kind != "baseline" and args.json:  # the rows so far, should the run be stopped
            finished[job.id] = row
            kill_tables.write_json(f"{args.json}.partial", {"impl": args.impl}, list(finished.values()))
        print(f"[{done['n']}/{total}] {job.id:28} {row['status']:10} explicit {kill_tables._rate(row, 'explicit'):5} "
              f"generated {kill_tables._rate(row, 'generated'):5} {result.get('wall_s')}s "
              f"{row['first_property'] or row['note']}"[:200], flush=True)

    with tempfile.TemporaryDirectory(prefix="pagedkv-mutate-") as workdir:
        baseline = None
        if not args.no_baseline:
            total = 1
            job = Job("baseline", "baseline", **{**common, "seeds": seeds[:1],
                                                 "budget_s": max(args.budget_s, 600.0)})
            (raw,) = run_jobs([job], workdir, 1, progress=progress)
            baseline = kill_tables.summarize(job.__dict__, raw)
            failing = {r["property"] for r in baseline["runs"] if r["killed"]}
            for name in failing:
                left_out[name] = "fails on the unmutated implementation"
            common["properties"] = [n for n in names if n not in failing]
            if baseline["status"] not in ("killed", "survived"):
                print(f"baseline: {baseline['status']}: {baseline['note']}", file=sys.stderr)
                return 2
        jobs = [source_job(m, workdir, **common) for m in mutants]
        from pagedkv.tools.mutants.kill_table import ALL_MUTANTS, mutant_spec

        if args.shipped is not None:
            for name in args.shipped or list(ALL_MUTANTS):
                jobs.append(Job(name, "shipped", **{**common, "impl": mutant_spec(name)}))
        for spec in (s.strip() for group in args.variants for s in group.split(",") if s.strip()):
            jobs.append(Job(spec, "variant", **{**common, "impl": spec}))
        total, done["n"] = len(jobs), 0
        raws = run_jobs(jobs, workdir, args.workers, progress=progress)
    rows = [kill_tables.summarize(j.__dict__, r, marks) for j, r in zip(jobs, raws)]
    config = {"impl": args.impl, "sources": " ".join(args.source) or "-", "profile": args.profile,
              "seeds": f"{seeds[0]}..{seeds[-1]}" if seeds else "-", "modes": "explicit+generated" if len(modes) == 2
              else "generated", "workers": args.workers, "budget_s": args.budget_s, "device": args.device,
              "sample": f"{args.max_mutants} (seed {args.sample_seed})" if args.max_mutants is not None else "all",
              "wall_s": round(time.monotonic() - t0, 1),
              "baseline_s": baseline["wall_s"] if baseline else None,
              "properties": common["properties"], "left_out": left_out}
    if args.json:
        kill_tables.write_json(args.json, config, rows)
        Path(f"{args.json}.partial").unlink(missing_ok=True)
    text = kill_tables.markdown(config, rows, args.title)
    if args.markdown:
        Path(args.markdown).write_text(text)
    c = kill_tables.counts(rows)
    print(f"{c['generated']} mutants: {c['killed']} killed ({c['crashed']} crash, {c['timeout']} timeout), "
          f"{c['survived']} survived, {c['equivalent']} equivalent, {c['error']} errors; {config['wall_s']} s")
    return 1 if c["survived"] or c["error"] else 0
