"""Replaying a case in a child process: a backend that crashes (a segmentation fault, a device fault)
is then reported as the result instead of taking replay down with it. On by default for a case file
whose run never finished (``"outcome": "running"`` or ``"crashed"``). The child writes its exit status to a
file the parent names (:data:`DONE_ENV`) once the case is judged: a child that ends without it (killed by a
signal, or a backend calling ``os._exit(0)``) is ``CRASHED``, never a pass."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedkv.errors import CaseFileError
from pagedkv.testing.casefiles.reading import parse_case_bytes, read_case_bytes

#: The environment variable naming the file a child replay writes its exit status to when it has judged the case.
DONE_ENV = "PAGEDKV_REPLAY_DONE_FILE"


def report_done(status: int) -> int:
    """In a child replay (:data:`DONE_ENV` set): write ``status`` to the parent's file. Returns ``status``."""
    path = os.environ.get(DONE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(str(status))
    return status


def isolated(args: argparse.Namespace) -> bool:
    """``--isolate``, else whether the file records a run that never finished (it crashed)."""
    if args.isolate is not None:
        return args.isolate
    try:  # read as any untrusted file is (size, encoding, nesting, duplicate keys)
        record = parse_case_bytes(read_case_bytes(args.file))
    except CaseFileError:
        return False  # the in-process replay refuses the file with its reason
    return isinstance(record, dict) and record.get("outcome") in ("running", "crashed")


def run_judged(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, bool]:
    """``subprocess.run(argv, **kwargs)`` of a replay command, and whether its exit status can be trusted: it
    judged its case (wrote its exit status to the :data:`DONE_ENV` file), or its status is neither 0 (passes)
    nor 3 (did not reproduce). A child that ended before judging (a backend calling ``os._exit(0)``) is not
    taken for a pass."""
    with tempfile.TemporaryDirectory() as tmp:
        done = Path(tmp) / "status"
        proc = subprocess.run(argv, env={**os.environ, DONE_ENV: str(done)}, **kwargs)
        reported = done.exists() and done.read_text().strip() == str(proc.returncode)
        return proc, reported or proc.returncode not in (0, 3)


def replay_in_child(args: argparse.Namespace) -> int:
    """The same replay in a child process; a child killed by a signal is the verdict ``CRASHED`` (exit 1)."""
    import signal

    argv = ["replay", str(args.file), "--device", str(args.device), "--no-isolate"]
    for option, value in (("--impl", args.impl), ("--other", args.other), ("--max-bytes", args.max_bytes),
                          ("--max-drift-ulp", args.max_drift_ulp)):
        argv += [option, str(value)] if value is not None else []
    argv += ["--quiet"] * bool(args.quiet) + ["--exact"] * bool(args.exact) + \
        ["--confirm-fix"] * bool(getattr(args, "confirm_fix", False)) + \
        ["--with-history"] * bool(getattr(args, "with_history", False))
    proc, judged = run_judged([sys.executable, "-m", "pagedkv", *argv])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        print(f"CRASHED: the backend's process died of {name} while running the case in {args.file} "
              f"(replayed in a child process)")
        return 1
    if not judged:
        print(f"CRASHED: the backend's process ended (exit status {proc.returncode}) before the case was judged, "
              f"while running the case in {args.file} (replayed in a child process)")
        return 1
    return proc.returncode
