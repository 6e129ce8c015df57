"""``python -m pagedkv replay FILE``: rerun one failing case from its case file, on any device.

A case file (written by the suite on failure, or committed under
``pagedkv/testing/casefiles/regressions/``) names the check, the backend spec and the case as plain
data. Replay reruns exactly that check and, on failure, prints the first mismatch (sequence, logical
position, physical block, slot, expected and actual values) and a map of the block tables with the
bad block marked::

    block tables (block_size 4; * = first bad block, offset 1 = slot 13):
      seq 0 | [ 2 ] [ 3*] [-1 ]
      seq 1 | [ 0 ] [ 1 ]
      block 3: | . x . . |   (x = offset 1)

A case file is untrusted input (a CI artifact, an issue attachment): before anything runs it passes
:func:`pagedkv.testing.casefiles.reading.load_case_file` (size, encoding, schema, consistency, a memory
budget), and the backend it records is loaded only when it is a built-in name, a shipped mutant or a
shipped peer; any other spec runs only when you name it yourself with ``--impl`` (``--other`` for the
second backend of a pair).

Exit status: 0 when the check passes, 1 when it fails, 2 when the file is refused or the backend
cannot be loaded (one line naming the field, no traceback), 3 when the file records a failure of its
backend (``outcome`` ``failed`` or ``raised``, written by a failing run: it holds ``history``) that
does not happen again after the process's earlier calls the file records, rerun in order:
replay prints ``did not reproduce (depends on earlier calls / nondeterministic)``, never ``PASSES``.

The recorded backend is the one replayed whichever way it is named: from the file, or with ``--impl``
naming the spec the file records (the only way for a user's own kernel, and the command the gate prints).
A failure of it that does not come back is exit 3. After changing the kernel to fix the failure, say so:
``--confirm-fix`` judges the case on its own (no earlier calls rerun) and a pass is ``PASSES``, exit 0.
``--impl`` naming another backend judges that backend on the case, a pass a pass.

The earlier calls: the file's ``history`` holds the last cases the process judged on the backend, of
any property, oldest first, and ``calls_before`` / ``history_calls`` the op calls the process had made
to it before the failing case and how many of those the recorded cases made. A recorded failure is
replayed on the case alone first: most failures come back there (``FAILS``), at the cost of one case,
however long the history (a large-pool failure's history repeats cases of gigabyte pools). Only when the
case passes alone is it replayed again in a fresh process (``--with-history``), after the recorded
cases; when the history is incomplete (the process made more calls than its recorded cases), those are
first repeated until the backend has had as many calls (at most :data:`MAX_PADDING_CALLS`), so a failure
that depends on the call count comes back; the verdict line says when the file's history is incomplete.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any, TextIO

from pagedkv.backends.interpreter import choose_interpreter  # torch-free: replay imports nothing before the check
from pagedkv.cli.common import device_option
from pagedkv.cli.replay.child import isolated, replay_in_child, report_done, run_judged
from pagedkv.cli.replay.drift import add_options as add_drift_options
from pagedkv.cli.replay.block_map import block_table_map


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``replay``."""
    parser = subparsers.add_parser(
        "replay", parents=[device_option("cpu", "replayed tensors")],
        help="rerun a failing case file and show where it fails",
        description="Rerun the check recorded in a case file (.pagedkv-failures/*.json or "
                    "pagedkv/testing/casefiles/regressions/*.json) and, on failure, print the first mismatch and a "
                    "map of the block tables with the bad slot marked. The file is checked first (size, schema, "
                    "consistency, memory budget) and only a built-in, shipped-mutant or shipped-peer backend is "
                    "loaded on its word. Exit status: 0 passes, 1 fails, 2 refused or cannot load, 3 a recorded "
                    "failure did not reproduce (depends on earlier calls / nondeterministic).")
    parser.add_argument("file", metavar="FILE",
                        help="case file (JSON) written by the suite or committed as a regression")
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
    parser.add_argument("--trace", action="store_true",
                        help="a cache-manager program: print each step and every protocol call it made, with its "
                             "arguments and what the manager returned (the checks' queries, such as block_table "
                             "and counts, are not printed)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run the case in a child process, so a backend that crashes (a segmentation fault, "
                             "a device fault) is reported as the result (default: on for a case file whose run "
                             "crashed, outcome 'running' or 'crashed')")
    parser.add_argument("--confirm-fix", action="store_true",
                        help="the backend was changed to fix the recorded failure: judge the case alone (no earlier "
                             "calls rerun) and report a pass as PASSES, exit 0 (without it a recorded failure of the "
                             "recorded backend that does not come back is exit 3)")
    parser.add_argument("--with-history", action="store_true",
                        help="a recorded failure: rerun the earlier calls the file records before the case, in this "
                             "process (by default the case runs alone first, and only when it passes is it rerun "
                             "after them, in a fresh process)")
    add_drift_options(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Replay ``args.file``; see the module docstring for the output and exit status."""
    from pagedkv.testing.managers.casefile import is_program_file  # torch-free

    if is_program_file(args.file):  # a cache-manager program (pagedkv.testing.managers.programs)
        from pagedkv.testing.managers.programs import replay_file
        return replay_file(args.file, impl=args.impl, quiet=args.quiet, trace=args.trace)
    if isolated(args):
        return replay_in_child(args)
    return report_done(replay(args.file, device=args.device, impl=args.impl, other=args.other,
                              max_bytes=args.max_bytes, quiet=args.quiet, exact=args.exact,
                              max_drift_ulp=args.max_drift_ulp, confirm_fix=args.confirm_fix,
                              with_history=args.with_history))


def _byte_count(text: str) -> int:
    from pagedkv.testing.casefiles.schema import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def replay(path: str | Path, *, device: str = "cpu", impl: str | None = None, quiet: bool = False,
           out: TextIO | None = None, other: str | None = None, max_bytes: int | None = None,
           exact: bool = False, max_drift_ulp: int | None = None, confirm_fix: bool = False,
           with_history: bool = False) -> int:
    """Rerun a case file's check and report to ``out`` (default stdout).

    Args:
        path: the case file.
        device: where the tensors live (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        impl: a backend spec replacing the recorded ``backend`` (run even when a file could not name it).
        quiet: only the verdict line.
        other: a backend spec replacing the recorded ``other`` (the second backend of a pair).
        max_bytes: memory budget of the case (``None``: a quarter of physical memory; see
            :mod:`pagedkv.testing.casefiles.reading`).
        exact, max_drift_ulp: when ``other`` is a baseline (:mod:`pagedkv.cli.replay.drift`): the drift gate.
        confirm_fix: the backend was changed to fix the recorded failure: the case alone, a pass is 0.
        with_history: a recorded failure of the recorded backend: rerun the file's earlier calls before the
            case in this process (without it the case runs alone first and, when it passes, the history
            in a fresh process, :func:`_replay_with_history`).

    Returns:
        0 (passes), 1 (fails), 2 (the file is refused, or the backend cannot be loaded) or
        :data:`DID_NOT_REPRODUCE` (3: a recorded failure does not happen again).
    """
    choose_interpreter(on_cpu=not str(device).startswith("cuda"))  # before anything imports Triton
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.casefiles.reading import load_case_file

    out = out or sys.stdout
    try:  # before any backend is imported or any tensor allocated
        record = load_case_file(path, max_bytes=max_bytes, impl=impl, other=other)
    except CaseFileError as exc:
        print(f"replay: refused case file {path}: {exc}", file=out)
        return 2
    from pagedkv.backends import load_backend
    from pagedkv.testing.compare import MissingOp, Mismatch

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
    from pagedkv.cli.replay.drift import drift_against, split_other

    record, baseline = split_other(record)  # other as the baseline of a drift record, not a pair's partner
    check = record["check"]
    what = check + (f" vs {record['other']}" if record.get("other") else "") + \
        (f", drift against {baseline}" if baseline else "")
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
        if hasattr(record["case"], "ops"):  # a cache scenario: keep the live tables at the failing step for the map
            _sharing_with_snapshot(backend, record["case"], device, snapshot, record)
        else:
            recorded = _recorded_failure(record, impl) and not confirm_fix
            if impl is not None and not recorded and not confirm_fix and not quiet and "history" in record:
                print(f"  --impl {impl} is not the recorded backend {record.get('recorded_backend')!r}: judged "
                      f"as another backend on this case", file=out)
            if recorded and with_history:  # the calls that led to the failure, in order, on this fresh backend
                _run_history(record, backend, device, out, quiet)
            elif recorded and not quiet:
                print("  the case alone first (the earlier calls only if it passes)", file=out)
            _run_record(record, backend, device)
            if recorded and not with_history:  # passed alone: the history, in a fresh process
                return _replay_with_history(path, device, impl, max_bytes, quiet, out)
            if recorded:
                return _did_not_reproduce(record, device, out)
    except MissingOp as exc:
        print(f"SKIPPED: {exc}", file=out)
        return 0
    except Mismatch as exc:
        print(f"FAILS: {check} on {spec} ({device})", file=out)
        if not quiet:
            print(f"  {exc}", file=out)
            case = record["case"]
            _report_where(exc.where, getattr(case, "case", case), snapshot, out,  # an InvalidCall wraps a Case
                          backend=backend, device=device)
        return 1
    except Exception as exc:  # an assertion of another kind, or a crash: a failure all the same
        print(f"FAILS: {check} on {spec} ({device}): {type(exc).__name__}: {exc}", file=out)
        if not quiet:
            traceback.print_exc(file=out)
        return 1
    if baseline:  # one verdict line per run: the drift's (DRIFT FAILS, or PASSES once both halves hold)
        print(f"conformance holds: {check} on {spec} ({device}); now the drift against {baseline}", file=out)
        status = drift_against(backend, spec, record, baseline, device, out, exact=exact, max_ulp=max_drift_ulp)
        if status == 0:
            print(f"PASSES: {check} on {spec} ({device}), drift against {baseline} within the gate", file=out)
        return status
    print(f"PASSES: {check} on {spec} ({device})", file=out)
    return 0


#: Replay's exit status when a failure recorded by a run of the recorded backend does not happen again.
DID_NOT_REPRODUCE = 3


#: Most op calls replay makes repeating the recorded cases to bring an incomplete history up to the
#: process's count (a gate run makes a few thousand).
MAX_PADDING_CALLS = 20_000


def _same_spec(given: str | None, recorded: object) -> bool:
    """Whether ``--impl given`` names the recorded backend: the same spec, or the same shipped backend."""
    from pagedkv.testing.casefiles.reading import canonical_backend_spec

    if not isinstance(given, str) or not isinstance(recorded, str):
        return False
    if given.strip() == recorded.strip():
        return True
    canonical = canonical_backend_spec(given)
    return canonical is not None and canonical == canonical_backend_spec(recorded)


def _recorded_failure(record: dict, impl: str | None) -> bool:
    """Whether the file records a failure of the backend replay runs now: written by a failing run (it has
    a ``history``, possibly empty) and run on the recorded backend (no ``--impl``, or ``--impl`` naming the
    recorded spec)."""
    return "history" in record and record.get("outcome") in ("failed", "raised") and \
        (impl is None or _same_spec(impl, record.get("recorded_backend")))


def _run_earlier(record: dict, earlier: dict, backend: Any, device: str) -> None:
    """One earlier case on ``backend``; its own result does not count, nor a property this version lacks."""
    from pagedkv.errors import CaseFileError
    from pagedkv.testing.execute import run_record

    try:
        run_record({**record, "check": earlier["check"], "kind": earlier["kind"], "case": earlier["case"]}, backend,
                   device)
    except (KeyError, CaseFileError):  # a property renamed or of another kind since: its calls are not rerun
        pass


def _run_history(record: dict, backend: Any, device: str, out: TextIO, quiet: bool) -> None:
    """Rerun the process's earlier calls the file records on ``backend``, oldest first (their own results do
    not count): when the history is incomplete, the recorded cases repeated until the backend has had as
    many calls as the process had made before the recorded ones, then the recorded cases."""
    from pagedkv.testing import history as process_history

    history = record.get("history") or []
    missing = record.get("calls_before", 0) - record.get("history_calls", 0)
    if history and missing > 0 and record.get("history_calls", 0) > 0:
        if not quiet:
            print(f"  the run had made {record['calls_before']} op calls before this case, its {len(history)} "
                  f"recorded case(s) {record['history_calls']}: repeating them for the {missing} before", file=out)
        start = process_history.calls(backend)
        while process_history.calls(backend) - start < min(missing, MAX_PADDING_CALLS):
            for earlier in history:
                _run_earlier(record, earlier, backend, device)
                if process_history.calls(backend) - start >= min(missing, MAX_PADDING_CALLS):
                    break
    if history and not quiet:
        print(f"  rerunning the {len(history)} earlier case(s) the run judged before this one, in order", file=out)
    for earlier in history:
        _run_earlier(record, earlier, backend, device)


def _replay_with_history(path: str | Path, device: str, impl: str | None, max_bytes: int | None, quiet: bool,
                         out: TextIO) -> int:
    """The replay again in a fresh process, the file's earlier calls rerun before the case (the case alone
    passed here, on a backend those calls never reached); its output to ``out``, its exit status."""
    argv = [sys.executable, "-m", "pagedkv", "replay", str(path), "--device", str(device), "--no-isolate",
            "--with-history"]
    for option, value in (("--impl", impl), ("--max-bytes", max_bytes)):
        argv += [option, str(value)] if value is not None else []
    if not quiet:
        print("  passes alone: rerunning it after the earlier calls the file records, in a fresh process", file=out)
    proc, judged = run_judged(argv + ["--quiet"] * quiet, capture_output=True, text=True)
    out.write(proc.stdout + proc.stderr[-2000:] * (proc.returncode not in (0, 1, DID_NOT_REPRODUCE)))
    if proc.returncode >= 0 and not judged:
        print(f"CRASHED: the backend's process ended (exit status {proc.returncode}) before the case was judged, "
              f"after the earlier calls the file records (a fresh process)", file=out)
        return 1
    return proc.returncode if proc.returncode >= 0 else 1


def _did_not_reproduce(record: dict, device: str, out: TextIO) -> int:
    """Say that a recorded failure did not happen again; :data:`DID_NOT_REPRODUCE`."""
    history = record.get("history") or []
    after = f" after its {len(history)} earlier case(s)" if history else " (no earlier cases recorded)"
    made, before = record.get("history_calls"), record.get("calls_before")
    if before is not None and made is not None and made < before:
        after += (f"; the file's history is incomplete: the run had made {before} op calls before it, the "
                  f"recorded cases {made} (the rest were repeats of them, or none)")
    print(f"did not reproduce (depends on earlier calls / nondeterministic): {record['check']} on "
          f"{record['backend']} ({device}) passes now{after}; recorded failure: "
          f"{record.get('error') or '(none recorded)'}; after a fix of the kernel, --confirm-fix", file=out)
    return DID_NOT_REPRODUCE


def _run_record(record: dict, backend: Any, device: str) -> None:
    """Run the record through :func:`pagedkv.testing.execute.run_record`; raise what it found (the
    backend's own exception, or ``MissingOp`` when the property cannot be judged on it)."""
    from pagedkv.testing.compare import MissingOp
    from pagedkv.testing.execute import run_record

    outcome = run_record(record, backend, device)
    if outcome.status == "skipped":
        raise MissingOp(outcome.reason)
    if outcome.failed:
        raise outcome.failures[0].error


class _RecordingBackend:
    """``backend`` with a ``cache_class`` that remembers every cache it makes (the backend's own cache
    manager when it ships one), so the live tables can be read at the moment a check fails."""

    def __init__(self, backend: Any) -> None:
        from pagedkv.cache.paged_cache import PagedKVCache

        made = self.caches = []

        class Recording(getattr(backend, "cache_class", None) or PagedKVCache):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                made.append(self)

        self._backend = backend
        self.cache_class = Recording

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _sharing_with_snapshot(backend: Any, scenario, device: str, snapshot: dict, record: dict | None = None) -> None:
    """Run a cache scenario's check (``sharing_isolated`` unless ``record`` names another) and, when it
    fails, leave in ``snapshot`` the block table of every sequence live at that moment (in the first
    cache the check made) and add the expected and actual K/V of the first bad read to the mismatch."""
    from pagedkv.testing.compare import Mismatch

    recording = _RecordingBackend(backend)
    record = record or {"check": "every_live_sequence_reads_only_its_own_tokens", "kind": "CacheScenario",
                        "case": scenario, "backend": None}
    try:
        _run_record(record, recording, device)
    except Mismatch as exc:
        if recording.caches:
            _add_values(exc.where, backend, recording.caches[0], scenario)
        raise
    finally:
        if recording.caches:
            cache = recording.caches[0]
            snapshot.clear()
            snapshot.update({seq: list(cache.block_table(seq).tolist()) for seq in cache.sequences})


def _add_values(where: dict, backend: Any, cache, scenario) -> None:
    """Locate the first read that differs in ``cache`` as it is now: for every live sequence (the
    failing one first), layer and pool, the backend's gather of its written tokens against the K/V
    written for them. Puts the sequence, position, block, slot and the expected and actual K and V rows
    of that position into ``where`` (or says in ``where["values"]`` that every read is right)."""
    if "expected" in where or not callable(getattr(backend, "gather", None)):
        return
    try:
        from pagedkv.testing.properties.cache_model import expected_kv
    except ImportError:  # an older kit: no namespaced values to compare with
        return
    from pagedkv.testing.compare import bits
    from pagedkv.testing.space import as_declared_layout

    reader = as_declared_layout(backend)  # the pools reach its gather in the layout it declares, as in the run
    g, bs = scenario.geometry, scenario.geometry.block_size
    for seq in sorted(cache.sequences, key=lambda s: (s != where.get("seq"), s)):
        state = cache.sequences[seq]
        n = cache.num_written(seq) if hasattr(cache, "num_written") else len(state.token_ids)
        table = cache.block_table(seq)
        for layer in range(getattr(scenario, "num_layers", 1)):
            exp = expected_kv(g, state.token_ids[:n], 0, scenario.seed, layer=layer,
                              cache_key=getattr(state, "cache_key", None))
            got = [reader.gather(pool, table, n).cpu() for pool in (cache.k_cache(layer), cache.v_cache(layer))]
            bad = [(bits(a) != bits(e)).flatten(1).any(1) for a, e in zip(got, exp) if a.shape == e.shape]
            rows = (bad[0] | bad[1]).nonzero().flatten().tolist() if len(bad) == 2 and n else []
            if rows:
                p = where.get("position") if where.get("seq") == seq and where.get("position") in rows else rows[0]
                block = int(table[p // bs])
                where.update(seq=seq, position=p, block=block, slot=block * bs + p % bs,
                             expected={"K": exp[0][p].flatten()[:4].tolist(), "V": exp[1][p].flatten()[:4].tolist()},
                             actual={"K": got[0][p].flatten()[:4].tolist(), "V": got[1][p].flatten()[:4].tolist()})
                if layer:
                    where["layer"] = layer
                return
    where["values"] = ("every live sequence's written tokens still gather as written: the fault is in the "
                       "cache's bookkeeping (message above), not yet in a value read")


def _tables(case, snapshot: dict) -> dict[int, list[int]]:
    """``{seq: block table}`` for the map: the case's tables, or the cache's at the failing step."""
    from pagedkv.testing.cases.case import Case

    if isinstance(case, Case):
        return {i: list(s.block_table) for i, s in enumerate(case.seqs)}
    return dict(snapshot)


def _fmt(values) -> str:
    if values is None:
        return "?"
    if isinstance(values, dict):  # {"K": [...], "V": [...]}
        return "  ".join(f"{k} {_fmt(v)}" for k, v in values.items())
    if isinstance(values, (list, tuple)):
        return "[" + ", ".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in values) + ", ...]"
    return str(values)


def _first_differences(backend: Any, case, device: str, out: TextIO, limit: int = 3) -> dict:
    """Print where the backend's own outputs on ``case`` first differ from the definition: each
    sequence's gather (bit for bit) and the attention output (fp64 reference, tolerance policy), with
    expected and actual values. The backend runs as the suite calls it, its pools in its declared layout
    (:func:`pagedkv.testing.cases.ops.run_ops`). Returns ``{"seq", "position"}`` of the first bad
    gathered row, if any."""
    from pagedkv.testing.cases.case import reference_gather
    from pagedkv.testing.cases.ops import run_ops
    from pagedkv.testing.compare import attention_tolerance, bits
    from pagedkv.testing.properties.definitions import reference_output

    found, printed = {}, 0
    if callable(getattr(backend, "gather", None)):
        gathered = run_ops(backend, case, device, ("gather",), declared=True)
        k_cache, _ = case.caches("cpu")
        for i, s in enumerate(case.seqs):
            got = gathered[f"gather[{i}]"]
            want = reference_gather(k_cache, case.used_table(i), s.seq_len)
            if got.shape != want.shape:
                print(f"  gather of sequence {i}: shape {tuple(got.shape)}, expected {tuple(want.shape)}", file=out)
                continue
            bad = (bits(got) != bits(want)).flatten(1).any(1).nonzero().flatten().tolist()
            for p in bad[:limit - printed]:
                print(f"  gather of sequence {i}, position {p}: expected {_fmt(want[p].flatten()[:4].tolist())}  "
                      f"actual {_fmt(got[p].flatten()[:4].tolist())}", file=out)
                printed += 1
                found = found or {"seq": i, "position": p}
    if callable(getattr(backend, "paged_attention", None)) and printed < limit:
        got = run_ops(backend, case, device, ("paged_attention",), declared=True)["paged_attention"]
        want, max_logit, max_v = reference_output(case)
        if got.shape == want.shape:
            rtol, atol = attention_tolerance(got.dtype, max_logit, max_v)
            err = (got.double() - want).abs()
            bad = (~(err <= atol + rtol * want.abs())).any(-1).nonzero().tolist()  # NaN counts as bad
            for row, head in bad[:limit - printed]:
                i, pos = case.row_position(row)
                print(f"  attention of sequence {i}, query row {row} (position {pos}), head {head}: expected "
                      f"{_fmt(want[row, head, :4].tolist())}  actual {_fmt(got[row, head, :4].tolist())}", file=out)
                printed += 1
    if not printed:
        print("  the backend's gather and attention on this case equal the definition: the mismatch is between "
              "the two results the check compares (message above)", file=out)
    return found


def _report_where(where: dict, case, snapshot: dict, out: TextIO, *, backend: Any = None, device: str = "cpu") -> None:
    """Print the located mismatch (with expected and actual values) and the block-table map."""
    from pagedkv.testing.cases.case import Case

    bs = case.geometry.block_size
    if "expected" not in where and backend is not None and isinstance(case, Case):
        print("first differences from the definition (expected = by definition, actual = the backend's):", file=out)
        try:
            located = _first_differences(backend, case, device, out)
        except Exception as exc:  # the backend crashes on the plain call too
            print(f"  (the backend's outputs could not be computed: {type(exc).__name__}: {exc})", file=out)
            located = {}
        where = {**located, **where}
    elif "values" in where:
        print(f"  ({where['values']})", file=out)
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
            print(f"  physical block:   {block}" + (f"   (layer {where['layer']})" if "layer" in where else ""),
                  file=out)
        if slot is not None:
            print(f"  slot:             {slot}   (= {block if block is not None else slot // bs} * {bs} + {offset})",
                  file=out)
        if "expected" in where or "actual" in where:
            print(f"  expected:         {_fmt(where.get('expected'))}", file=out)
            print(f"  actual:           {_fmt(where.get('actual'))}", file=out)
    attention = "query_head" in where  # located by the attention check: the query's slot, not a bad one
    read = _tail_reads(backend, case, device) if attention and backend is not None and isinstance(case, Case) else {}
    if read:
        print("unused slots read: " + "; ".join(f"block {b} offsets {o[0]}..{o[-1]}" for b, o in read.items())
              + " (refilling them changes the output)", file=out)
    print(block_table_map(_tables(case, snapshot), bs, seq=seq, position=pos, block=block, offset=offset,
                          read=read, query=attention), file=out)


def _tail_reads(backend: Any, case, device: str) -> dict[int, list[int]]:
    """:func:`pagedkv.cli.replay.reads.unused_slots_read`, or ``{}`` when the backend crashes on it."""
    from pagedkv.cli.replay.reads import unused_slots_read

    try:
        return unused_slots_read(backend, case, device)
    except Exception:  # noqa: BLE001 - the failure is reported above; the map just has no read marks
        return {}
