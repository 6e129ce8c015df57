"""``python -m pagedkv replay FILE``: rerun one failing case from its case file, on any device.

A case file (written by the suite on failure, or committed under ``pagedkv/testing/regressions/``) names the
check, the backend spec and the case as plain data. Replay reruns exactly that check and, on
failure, prints the first mismatch (sequence, logical position, physical block, slot, expected and
actual values) and a map of the block tables with the bad block marked::

    block tables (block_size 4; * = first bad block, offset 1 = slot 13):
      seq 0 | [ 2 ] [ 3*] [-1 ]
      seq 1 | [ 0 ] [ 1 ]
      block 3: | . x . . |   (x = offset 1)

A case file is untrusted input (a CI artifact, an issue attachment): before anything runs it passes
:func:`pagedkv.testing.casefile.load_case_file` (size, encoding, schema, consistency, a memory
budget), and the backend it records is loaded only when it is a built-in name, a shipped mutant or a
shipped peer; any other spec runs only when you name it yourself with ``--impl`` (``--other`` for the
second backend of a pair).

Exit status: 0 when the check passes, 1 when it fails, 2 when the file is refused or the backend
cannot be loaded (one line naming the field, no traceback).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``replay``."""
    parser = subparsers.add_parser(
        "replay", help="rerun a failing case file and show where it fails",
        description="Rerun the check recorded in a case file (.pagedkv-failures/*.json or pagedkv/testing/regressions/*.json) "
                    "and, on failure, print the first mismatch and a map of the block tables with the bad slot "
                    "marked. Exit status: 0 passes, 1 fails, 2 cannot load.")
    parser.add_argument("file", metavar="FILE", help="case file (JSON) written by the suite or committed as a regression")
    parser.add_argument("--device", default="cpu", help="device to run on: cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--impl", metavar="SPEC", default=None,
                        help="backend to run instead of the one recorded: loop | indexed | triton | pkg.module[:attr]; "
                             "a recorded spec other than a built-in, a shipped mutant or a shipped peer runs only "
                             "when named here")
    parser.add_argument("--other", metavar="SPEC", default=None,
                        help="second backend of a pair property, instead of the recorded one (same rule as --impl)")
    parser.add_argument("--max-bytes", metavar="N", default=None, type=_byte_count,
                        help="memory budget of the case (e.g. 8G); a case whose pools and tensors need more is "
                             "refused before anything is allocated (default: a quarter of this machine's memory)")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only the verdict line")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Replay ``args.file``; see the module docstring for the output and exit status."""
    return replay(args.file, device=args.device, impl=args.impl, other=args.other, max_bytes=args.max_bytes,
                  quiet=args.quiet)


def _byte_count(text: str) -> int:
    from pagedkv.testing.casefile import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def replay(path: str | Path, *, device: str = "cpu", impl: str | None = None, quiet: bool = False,
           out: TextIO | None = None, other: str | None = None, max_bytes: int | None = None) -> int:
    """Rerun a case file's check and report to ``out`` (default stdout).

    Args:
        path: the case file.
        device: where the tensors live (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        impl: a backend spec replacing the recorded ``backend`` (run even when a file could not name it).
        quiet: only the verdict line.
        other: a backend spec replacing the recorded ``other`` (the second backend of a pair).
        max_bytes: memory budget of the case (``None``: a quarter of physical memory; see
            :mod:`pagedkv.testing.casefile`).

    Returns:
        0 (passes), 1 (fails) or 2 (the file is refused, or the backend cannot be loaded).
    """
    import os

    if not str(device).startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.casefile import load_case_file

    out = out or sys.stdout
    try:  # before any backend is imported or any tensor allocated
        record = load_case_file(path, max_bytes=max_bytes, impl=impl, other=other)
    except CaseFileError as exc:
        print(f"replay: refused case file {path}: {exc}", file=out)
        return 2
    from pagedkv.backends import load_backend
    from pagedkv.testing.checks import MissingOp, Mismatch, run_record

    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"replay: --device {device} asked for, but torch sees no CUDA device here "
                  f"(torch {torch.__version__}); replay on cpu instead", file=out)
            return 2
    spec = record["backend"]  # --impl, or a recorded spec a file may name
    try:
        backend = load_backend(spec)
    except Exception as exc:
        print(f"replay: cannot load backend {spec!r}: {exc}", file=out)
        return 2
    check = record["check"]
    what = check + (f"[{record['transform']}]" if record.get("transform") else "") + \
        (f" vs {record['other']}" if record.get("other") else "")
    if not quiet:
        title = f" ({record['id']}: {record['title']})" if record.get("id") else ""
        print(f"replay {path}{title}", file=out)
        print(f"  check:   {what}", file=out)
        print(f"  backend: {spec}   device: {device}", file=out)
        print(f"  case:    {record['case']!r}", file=out)
        if record.get("error"):
            print(f"  recorded failure: {record['error']}", file=out)
    snapshot: dict[int, list[int]] = {}
    try:
        if check == "sharing_isolated":  # keep the live tables at the failing step for the map
            _sharing_with_snapshot(backend, record["case"], device, snapshot)
        else:
            run_record(record, backend, device)
    except MissingOp as exc:
        print(f"SKIPPED: {exc}", file=out)
        return 0
    except Mismatch as exc:
        print(f"FAILS: {check} on {spec} ({device})", file=out)
        if not quiet:
            print(f"  {exc}", file=out)
            case = record["case"]
            _report_where(exc.where, getattr(case, "case", case), snapshot, out)  # an InvalidCall wraps a Case
        return 1
    except Exception as exc:  # an assertion of another kind, or a crash: a failure all the same
        print(f"FAILS: {check} on {spec} ({device}): {type(exc).__name__}: {exc}", file=out)
        if not quiet:
            traceback.print_exc(file=out)
        return 1
    print(f"PASSES: {check} on {spec} ({device})", file=out)
    return 0


def _sharing_with_snapshot(backend: Any, scenario, device: str, snapshot: dict) -> None:
    """:func:`pagedkv.testing.checks.sharing_isolated`, recording every live block table before each check."""
    from pagedkv.testing.checks import check_live_sequences, require, run_scenario

    require(backend, "gather")

    def after(cache, shadow):
        snapshot.clear()
        snapshot.update({seq: list(cache.block_table(seq).tolist()) for seq in shadow})
        check_live_sequences(backend, cache, shadow, scenario)

    run_scenario(backend, scenario, device, after)


def _tables(case, snapshot: dict) -> dict[int, list[int]]:
    """``{seq: block table}`` for the map: the case's tables, or the cache's at the failing step."""
    from pagedkv.testing.cases import Case

    if isinstance(case, Case):
        return {i: list(s.block_table) for i, s in enumerate(case.seqs)}
    return dict(snapshot)


def _fmt(values) -> str:
    if values is None:
        return "?"
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values) + ", ...]"
    return str(values)


def _report_where(where: dict, case, snapshot: dict, out: TextIO) -> None:
    """Print the located mismatch and the block-table map."""
    bs = case.geometry.block_size
    if not where:
        print("  (the mismatch is not located at one slot: compare the outputs above)", file=out)
    seq, pos, block, slot = (where.get(k) for k in ("seq", "position", "block", "slot"))
    if slot is None and block is not None and pos is not None:
        slot = block * bs + pos % bs
    offset = slot % bs if slot is not None else (pos % bs if pos is not None else None)
    if where:
        print("first mismatch:", file=out)
        print(f"  sequence:         {seq if seq is not None else '- (a slot no sequence reads)'}", file=out)
        if pos is not None:
            print(f"  logical position: {pos}   (entry {pos // bs} of its block table, offset {pos % bs})", file=out)
        if block is not None:
            print(f"  physical block:   {block}", file=out)
        if slot is not None:
            print(f"  slot:             {slot}   (= {block if block is not None else slot // bs} * {bs} + {offset})",
                  file=out)
        if "expected" in where or "actual" in where:
            print(f"  expected:         {_fmt(where.get('expected'))}", file=out)
            print(f"  actual:           {_fmt(where.get('actual'))}", file=out)
    print(block_table_map(_tables(case, snapshot), bs, seq=seq, position=pos, block=block, offset=offset), file=out)


def block_table_map(tables: dict[int, list[int]], block_size: int, *, seq: int | None = None,
                    position: int | None = None, block: int | None = None, offset: int | None = None,
                    max_entries: int = 24) -> str:
    """An ASCII map of block tables, one row per sequence, with the bad entry marked.

    The entry holding ``position`` of sequence ``seq`` gets ``*``; other entries naming the same
    physical ``block`` (sharing) get ``=``. A last line draws the bad block's slots with ``x`` at
    ``offset``. Rows longer than ``max_entries`` are cut around the bad entry.

    Args:
        tables: ``{seq: [block ids]}`` (``-1`` padding included as given).
        block_size: slots per block.

    Returns:
        The map as text (no trailing newline).
    """
    if not tables:
        return "block tables: (none live)"
    width = max(len(str(b)) for t in tables.values() for b in (t or [0]))
    bad_entry = position // block_size if position is not None else None
    if block is None and seq in tables and bad_entry is not None and bad_entry < len(tables[seq]):
        block = tables[seq][bad_entry]
    where = f"offset {offset} = slot {block * block_size + offset}" if block is not None and offset is not None else ""
    lines = [f"block tables (block_size {block_size}; * = first bad block{', ' + where if where else ''}"
             f"{'; = same block elsewhere' if block is not None else ''}):"]
    label = max(len(str(s)) for s in tables)
    for s, table in tables.items():
        cells = []
        for j, b in enumerate(table):
            mark = "*" if (s == seq and j == bad_entry) or (seq is None and b == block) else \
                "=" if block is not None and b == block else " "
            cells.append(f"[{b:>{width}}{mark}]")
        lo = 0
        if len(cells) > max_entries:
            focus = bad_entry if s == seq and bad_entry is not None else 0
            lo = max(0, min(focus - max_entries // 2, len(cells) - max_entries))
            cells = (["..."] if lo else []) + cells[lo:lo + max_entries] + \
                (["..."] if lo + max_entries < len(table) else [])
        lines.append(f"  seq {s:>{label}} | " + " ".join(cells))
    if block is not None and offset is not None:
        slots = " ".join("x" if i == offset else "." for i in range(block_size)) if block_size <= 64 else \
            f"... x at {offset} ..."
        lines.append(f"  block {block}: | {slots} |   (x = offset {offset})")
        if not any(block in t for t in tables.values()):
            lines.append(f"  block {block} is in no sequence's table: a write touched a slot it does not own")
    return "\n".join(lines)
