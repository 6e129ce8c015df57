"""Replaying a case in a child process: a backend that crashes (a segmentation fault, a device fault)
is then reported as the result instead of taking replay down with it. On by default for a case file
whose run never finished (``"outcome": "running"`` or ``"crashed"``)."""

from __future__ import annotations

import argparse
import sys

from pagedkv.errors import CaseFileError
from pagedkv.testing.casefiles.reading import parse_case_bytes, read_case_bytes


def isolated(args: argparse.Namespace) -> bool:
    """``--isolate``, else whether the file records a run that never finished (it crashed)."""
    if args.isolate is not None:
        return args.isolate
    try:  # read as any untrusted file is (size, encoding, nesting, duplicate keys)
        record = parse_case_bytes(read_case_bytes(args.file))
    except CaseFileError:
        return False  # the in-process replay refuses the file with its reason
    return isinstance(record, dict) and record.get("outcome") in ("running", "crashed")


def replay_in_child(args: argparse.Namespace) -> int:
    """The same replay in a child process; a child killed by a signal is the verdict ``CRASHED`` (exit 1)."""
    import signal
    import subprocess

    argv = ["replay", str(args.file), "--device", str(args.device), "--no-isolate"]
    for option, value in (("--impl", args.impl), ("--other", args.other), ("--max-bytes", args.max_bytes),
                          ("--max-drift-ulp", args.max_drift_ulp)):
        argv += [option, str(value)] if value is not None else []
    argv += ["--quiet"] * bool(args.quiet) + ["--exact"] * bool(args.exact) + \
        ["--confirm-fix"] * bool(getattr(args, "confirm_fix", False)) + \
        ["--with-history"] * bool(getattr(args, "with_history", False))
    proc = subprocess.run([sys.executable, "-m", "pagedkv", *argv])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        print(f"CRASHED: the backend's process died of {name} while running the case in {args.file} "
              f"(replayed in a child process)")
        return 1
    return proc.returncode
