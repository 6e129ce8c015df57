"""``python -m pagedkv fuzz``: fuzz every registered property of a candidate across N processes for a
time budget, sharing one Hypothesis example database (see :mod:`pagedkv.tools.fuzz.workers`).

    python -m pagedkv fuzz --impl my_engine.kv:backend --workers 8 --minutes 60 --database redis://fuzz:6379/0

Exit status: 0 when nothing failed, 1 when a property failed (each failure is a case file with its
replay command) or a worker crashed, 2 on a bad argument, candidate or database.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pagedkv.cli.common import device_option

from pagedkv.tools.fuzz.workers import Failure, Quiet


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``fuzz``."""
    parser = subparsers.add_parser(
        "fuzz", parents=[device_option(None, "tensors; on CUDA worker i takes GPU i % device_count")],
        help="fuzz every registered property of a candidate for a time budget over a shared example database",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the registered properties against a candidate in N worker processes until the budget\n"
                    "ends: each property in turn, in batches of random examples, replaying first what the example\n"
                    "database holds for it. Every failure is shrunk, saved to the database (so every machine\n"
                    "sharing it replays it) and written as a JSON case file with its replay command.\n"
                    "Exit status: 0 nothing failed, 1 a property failed or a worker crashed, 2 bad arguments.",
        epilog="databases (--database, or $PAGEDKV_DATABASE):\n"
               "  PATH                       a local directory (default .hypothesis/examples, shared with pytest)\n"
               "  redis://HOST:PORT/DB       a Redis server shared by a fleet (pip install \"pagedkv[fuzz]\")\n"
               "  github://OWNER/REPO[/ART]  a workflow's hypothesis-example-db artifact, read-only ($GITHUB_TOKEN)\n"
               "  ro:URL                     any of these, read-only\n"
               "  multi:URL,URL              several at once, e.g. multi:.hypothesis/examples,ro:redis://fleet:6379/0\n"
               "  none                       no database\n"
               "progress: a status line every --interval seconds (elapsed / budget, workers, examples and rate,\n"
               "properties fuzzed, failing); each failure as found ('found by search at example N', or\n"
               "'replayed from the database' when a saved example failed first); a table per property at the end.\n"
               "See docs/scale.md.")
    parser.add_argument("--impl", metavar="SPEC", default=os.environ.get("PAGEDKV_IMPL") or None,
                        help="implementation under test: loop | indexed | triton | pkg.module[:attr] | file.py[:attr] "
                             "(default: $PAGEDKV_IMPL)")
    parser.add_argument("--workers", "-n", type=_positive_int, default=1, metavar="N",
                        help="worker processes (default: 1); on CUDA, worker i uses GPU i %% device_count")
    parser.add_argument("--minutes", type=_positive_float, default=5.0, metavar="M",
                        help="time budget in minutes, fractions allowed (default: 5); a batch running when it "
                             "ends is finished")
    parser.add_argument("--database", metavar="URL", default=os.environ.get("PAGEDKV_DATABASE") or None,
                        help="example database (default: $PAGEDKV_DATABASE, else .hypothesis/examples); see below")
    parser.add_argument("--properties", nargs="+", metavar="NAME", default=(),
                        help="fuzz only these registered properties (default: all; --list names them)")
    parser.add_argument("--batch", type=_positive_int, default=None, metavar="K",
                        help="examples per batch, one Hypothesis run with a fresh seed (default: 100; a tenth, "
                             "5 to 25, for a backend Triton interprets)")
    parser.add_argument("--failure-dir", type=Path, default=None, metavar="DIR",
                        help="where case files go (default: $PAGEDKV_FAILURE_DIR, else .pagedkv-failures)")
    parser.add_argument("--interval", type=_positive_float, default=10.0, metavar="S",
                        help="seconds between progress lines (default: 10)")
    parser.add_argument("--list", action="store_true", help="list the registered properties and exit")
    parser.set_defaults(func=run)
    return parser


class Progress(Quiet):
    """Prints the run to stdout: news lines, a status line every ``--interval`` seconds, each failure
    as it is found, and the per-property table at the end."""

    def line(self, text: str) -> None:
        """Print ``text``."""
        print(text, file=sys.stdout, flush=True)

    def status(self) -> None:
        """One line: elapsed / budget, workers running, examples (rate), properties fuzzed, failing."""
        r, elapsed = self.report, time.time() - self.start
        stats = r.stats.values()
        fuzzed, live = sum(1 for s in stats if s.batches or s.examples), sum(1 for s in stats if not s.skipped)
        self.line(f"fuzz [{_clock(elapsed)} / {_clock(self.config.seconds)}] workers {r.alive}/{self.config.workers}"
                  f" | examples {r.examples:,} ({r.examples / max(elapsed, 1e-9):.1f}/s) | properties fuzzed "
                  f"{fuzzed}/{live} | failing {len(r.failures)}")

    def failure(self, f: Failure) -> None:
        """A failure: how it was found, its first line, the case file and the replay command."""
        how = (f"replayed from the database (example {f.first}; {f.saved} saved)" if f.replayed
               else f"found by search at example {f.first}" if f.first else "(a state machine: no case file)")
        self.line(f"FAIL {f.prop} [worker {f.worker}] {how}\n  {f.outcome}: {f.error}\n"
                  + (f"  case file: {f.case_file}\n" if f.case_file else "") + f"  replay:    {f.replay}")

    def summary(self) -> None:
        """The per-property table (examples, batches, result) and the verdict line."""
        r = self.report
        width = max([len(n) for n in r.stats] + [8])
        self.line(f"\n{'property':<{width}} {'examples':>9} {'batches':>8}  result")
        for name, s in r.stats.items():
            result = ("skipped: " + s.skipped if s.skipped else
                      ("FAILED (state machine)" if not s.failure.first else
                       f"FAILED ({'replayed' if s.failure.replayed else 'found'} at example {s.failure.first}) "
                       f"{s.failure.case_file}") if s.failure else "ok" if s.batches else "not reached")
            self.line(f"{name:<{width}} {s.examples:>9,} {s.batches:>8}  {result}")
        for e in r.errors:
            self.line(f"ERROR {e}")
        failing = len(r.failures)
        verdict = "ok" if r.ok else f"{failing} failing propert{'y' if failing == 1 else 'ies'}" + \
            (f", {len(r.errors)} error(s)" if r.errors else "")
        self.line(f"fuzz: {r.impl}: {verdict}; {r.examples:,} examples in {r.seconds:.1f} s by "
                  f"{self.config.workers} worker(s); database: {r.database}")


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m:d}:{s:02d}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    """``python -m pagedkv fuzz``: see the module docstring for the exit status."""
    from pagedkv.testing.casefiles.writing import failure_dir
    from pagedkv.tools.fuzz.workers import DEFAULT_BATCH, FuzzConfig, fuzz

    if args.list:
        from pagedkv.testing.registry import properties

        for name, prop in properties().items():
            print(f"{name}: {prop.sentence}")
        return 0
    if not args.impl:
        print("pagedkv fuzz: name the implementation under test with --impl SPEC (or $PAGEDKV_IMPL)", file=sys.stderr)
        return 2
    import pagedkv
    from pagedkv.testing.databases import DatabaseError

    config = FuzzConfig(
        impl=args.impl, workers=args.workers, seconds=args.minutes * 60, database=args.database,
        properties=tuple(args.properties), device=args.device or os.environ.get("PAGEDKV_DEVICE") or None,
        batch=args.batch or DEFAULT_BATCH, interval=args.interval,
        failure_dir=args.failure_dir or failure_dir())
    try:
        report = fuzz(config, Progress)
    except (pagedkv.BackendError, DatabaseError, ValueError) as exc:
        print(f"pagedkv fuzz: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pagedkv fuzz: interrupted", file=sys.stderr)
        return 130
    return 0 if report.ok else 1
