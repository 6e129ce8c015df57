"""``python -m pagedkv mutants``: run the registered properties against every shipped faulty backend."""

from __future__ import annotations

import argparse

import torch

from pagedkv.cli.common import device_option, profile_option
from pagedkv.tools.mutants.kill_table import (ALL_MUTANTS as MUTANTS, Result, _short, format_table, run_mutant,
                                    run_mutant_via_pytest)


def _worker(args: tuple) -> Result:
    name, profile, device, only_targets, via_pytest, shrink = args
    torch.set_num_threads(1)
    if via_pytest:
        return run_mutant_via_pytest(name, profile)
    return run_mutant(name, profile, device, only_targets=only_targets, shrink=shrink)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mutants``."""
    parser = subparsers.add_parser(
        "mutants", parents=[profile_option("ci"), device_option("cpu")],
        help="run the property suite against faulty backends and report which it kills",
        description="Run the property suite against each shipped faulty backend (pagedkv.tools.mutants.backends, "
                    "pagedkv.tools.mutants.caches) and print, per "
                    "mutant: killed or survived, the property that killed it, examples until the first failure, "
                    "time and the shrunk case. Exit status 1 when a mutant survives.")
    parser.add_argument("--only", action="append", metavar="NAME", choices=sorted(MUTANTS),
                        help="run only this mutant (repeatable); choices: %(choices)s")
    parser.add_argument("--jobs", "-j", type=int, default=1, metavar="N", help="mutants run in parallel (processes)")
    parser.add_argument("--targets-only", action="store_true",
                        help="run only the properties each mutant targets (faster, less thorough)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first failing example instead of shrinking it (faster)")
    parser.add_argument("--via-pytest", action="store_true",
                        help="run the pytest suite in a subprocess per mutant instead of the properties in-process")
    parser.add_argument("--list", action="store_true", help="list the mutants and the faults they model, then exit")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``python -m pagedkv mutants``: 0 when every mutant run is killed, 1 otherwise."""
    if args.list:
        for name, cls in MUTANTS.items():
            print(f"{name}: {' '.join(cls.__doc__.split())}")
        return 0
    names = args.only or list(MUTANTS)
    work = [(n, args.profile, args.device, args.targets_only, args.via_pytest, not args.no_shrink) for n in names]
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_worker, work))
    else:
        results = [_worker(w) for w in work]
    print(format_table(results))
    for r in results:
        if r.killed and r.error:
            print(f"  {r.mutant}: {_short(r.error, 160)}")
    return 0 if all(r.killed for r in results) else 1
