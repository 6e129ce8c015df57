"""``python -m pagedkv bench``: time the backends' data paths against a memory-copy bound.

For every point of a sweep (sequence length x block size x ``num_kv_heads x head_dim`` preset x
dtype) the benchmark times, in one run and on one device:

- ``gather``: the ``loop`` backend, the tutorial's element-wise formulation
  (:func:`pagedkv.backends.indexed.gather_kv_from_blocks_v2`, impl ``elementwise``), the ``indexed``
  backend and the ``triton`` backend;
- ``scatter`` and ``write_kv`` (a prefill's ``slot_mapping`` over a random block table): the same
  backends;
- ``paged_attention`` for decode (one query token per sequence, GQA group 4): gather-then-dense
  (``indexed``), gather-then-SDPA (``indexed+sdpa``) and the fused kernel (``triton``);
- the bounds, next to them: ``copy`` (``dst.copy_(src)`` of the same payload into an existing
  tensor) and ``clone`` (``src.clone()``: the same copy into a freshly allocated tensor, which is
  what ``gather``'s contract asks for).

Timing: ``torch.utils.benchmark`` (``blocked_autorange``, median of blocks) on CPU; CUDA events
around each call with the L2 cache flushed before it (``triton.testing.do_bench``-style), small
shapes captured in a CUDA graph, median of the calls. Every op is warmed up on each of several
input sets, and the timed calls rotate through the sets, so that on CPU the working set of the
rotation is larger than the last-level cache (no cache-resident replays). Data ops are called with
``validate=False`` (the hot path after the caller validated; validation is host-side bookkeeping
that does not scale with the bytes moved), except ``elementwise``, which always validates.

Per row: median seconds, bytes moved (read + write for data ops; K and V read once for decode
attention), GB/s, time relative to the copy bound (``x_copy``, ``x_clone``), bandwidth as a
percentage of the copy's (``pct_copy_bw``; the copy counts read + write), and the peak extra memory
of one call next to the output size. Results go to ``<out-dir>/<name>.json`` and ``.csv``, a plot to
``<name>.png``, and a "limits" verdict table (each target, the measured ratio, pass/fail) to stdout
and into the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pagedkv.cli.bench.report import (_round, environment, failed, format_limits, format_table, limits, plot,
                                      write_csv)
from pagedkv.cli.bench.sweep import (BLOCK_SIZES, CSV_COLUMNS, FULL_SEQ_LENS, IMPLS, OPS, PRESETS, QUICK_ATTN_MAX_LEN,
                                     QUICK_BLOCK_SIZES, QUICK_SEQ_LENS, Plan, sweep)
from pagedkv.cli.bench.timing import retain_freed_memory

#: every built-in impl name ``--impls`` accepts (anything else must load as a candidate spec)
BUILTIN_IMPLS = tuple(dict.fromkeys(impl for impls in IMPLS.values() for impl in impls))

#: ``--quick`` measured on the 2-core machine of docs/benchmarks.md: 22.6 s wall (19.9 s CPU) at load average 2
QUICK_SECONDS = 25


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object (``set_defaults(func=run)``)."""
    p = subparsers.add_parser(
        "bench", help="time loop / element-wise / indexed / triton against a memory-copy bound",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"small sweep (seq lens {QUICK_SEQ_LENS}, block sizes {QUICK_BLOCK_SIZES}, attention up to "
                        f"{QUICK_ATTN_MAX_LEN} tokens, float32, 8x128, short timing): about {QUICK_SECONDS} s on 2 CPU "
                        "cores, longer when other jobs share them")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--seq-lens", type=_int_list, default=None, help=f"comma list; default {FULL_SEQ_LENS}")
    p.add_argument("--block-sizes", type=_int_list, default=None, help=f"comma list; default {BLOCK_SIZES}")
    p.add_argument("--presets", type=_str_list, default=None,
                   help=f"num_kv_heads x head_dim presets from {sorted(PRESETS)} or any 'HxD'; default 8x128")
    p.add_argument("--dtypes", type=_str_list, default=None, help="float32,float16,bfloat16; default float32")
    p.add_argument("--ops", type=_str_list, default=list(OPS), help=f"subset of {OPS}")
    p.add_argument("--impls", type=_str_list, default=None,
                   help=f"comma list of {','.join(BUILTIN_IMPLS)} and candidate backends given as specs loaded like "
                        "--pagedkv-impl (pkg.module, pkg.module:attr, path/to/file.py[:attr]); a candidate is "
                        "timed on every op it provides; bounds are always timed; default: every built-in")
    p.add_argument("--attn-batches", type=_int_list, default=None,
                   help="decode batch sizes of the attention rows; default 1 (CPU) or 1,16 (CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (torch.set_num_threads; default 1)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds of timed calls per measurement (default 0.3, --quick 0.02)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per point (every impl and bound once a round); the fastest round's "
                        "median is kept for each (default 3, --quick 2)")
    p.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                   help="CPU clock: 'thread' = CPU time of the calling thread (immune to time the OS gives other "
                        "processes), 'wall' = perf_counter; auto = thread with 1 torch thread, else wall")
    p.add_argument("--malloc", choices=("retain", "system"), default="retain",
                   help="CPU only. 'retain': glibc mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2**31-1) at start, so "
                        "freed outputs stay mapped and are reused (what a caching allocator - CUDA's, or "
                        "jemalloc/tcmalloc - does); 'system': glibc defaults, where blocks >= 32 MiB are unmapped "
                        "on free and every new output pays first-touch page faults")
    p.add_argument("--pool-factor", type=float, default=1.5,
                   help="pool blocks per block the table uses (block ids are a random permutation of the pool; "
                        "default 1.5)")
    p.add_argument("--pool-memory", choices=("cache", "torch"), default="cache",
                   help="how the pools (and the copy bound's source) are allocated: 'cache' as PagedKVCache "
                        "allocates them (transparent huge pages on a Linux CPU, pagedkv.cache.hugepages), 'torch' by "
                        "torch.empty, as a caller's own pools (4 KiB pages unless THP_MEM_ALLOC_ENABLE=1); "
                        "default cache")
    p.add_argument("--triton-on-cpu", action="store_true",
                   help="time the triton backend on CPU too (interpreter; only at the smallest sequence length)")
    p.add_argument("--out-dir", default=None,
                   help="where <name>.json/.csv/.png go (default: bench/results in pagedkv's own checkout, "
                        "else .pagedkv-bench in the working directory, never your repository's own files)")
    p.add_argument("--name", default=None, help="file stem; default '<device>-quick' or '<device>-full'")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stdout or stderr is not a terminal)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a target of the limits table fails (informational targets never do)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--validation-cost", action="store_true",
                   help="also time each built-in op at validate='full', 'metadata' and 'none' (one point per op: "
                        "the first seq len, block size, preset and dtype; decode batch 4 for paged_attention)")
    p.add_argument("--compile-report", action="store_true",
                   help="instead of timing: compile every Triton kernel ahead of time for --arch (no GPU needed) and "
                        "print registers, spills, shared memory and occupancy per configuration; exit 1 on a spill, "
                        "a failure or shared memory over the limit")
    p.add_argument("--arch", type=_int_list, default=[80, 90], help="--compile-report targets (default 80,90)")
    p.add_argument("--full", action="store_true", help="--compile-report over the whole matrix (slow)")
    p.add_argument("--json", default=None, help="--compile-report: also write the rows as JSON to this path")
    p.set_defaults(func=run, _parser=p)
    return p


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _usage_error(args: argparse.Namespace, message: str) -> int:
    parser = getattr(args, "_parser", None)
    if parser is not None:
        parser.error(message)  # exits 2
    print(f"bench: error: {message}", file=sys.stderr)
    return 2


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """``(built-in impls, candidate specs, error)``: unknown names and specs that do not load are errors."""
    from pagedkv.backends import load_backend
    from pagedkv.cache.config import dtype_from_name

    for op in args.ops:
        if op not in OPS:
            return [], [], f"--ops: unknown op {op!r}; choose from {', '.join(OPS)}"
    for name in args.presets or []:
        if name not in PRESETS and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", name.lower()):
            return [], [], f"--presets: unknown preset {name!r}; use one of {sorted(PRESETS)} or 'HxD'"
    for name in args.dtypes or []:
        try:
            dtype_from_name(name)
        except Exception as exc:
            return [], [], f"--dtypes: {exc}"
    builtin, specs = [], []
    for name in args.impls or BUILTIN_IMPLS:
        if name in BUILTIN_IMPLS:
            builtin.append(name)
            continue
        try:
            backend = load_backend(name)
        except Exception as exc:  # BackendError, or an import that raised
            return [], [], (f"--impls: {name!r} is not a built-in impl ({', '.join(BUILTIN_IMPLS)}) and does not load "
                            f"as a candidate spec: {exc}")
        if not any(callable(getattr(backend, op, None)) for op in ("gather", "scatter", "write_kv",
                                                                  "paged_attention")):
            return [], [], f"--impls: candidate {name!r} provides none of the ops the bench times"
        specs.append(name)
    if not builtin and not specs:
        return [], [], "--impls: nothing to time"
    return builtin, specs, ""


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_parser`).

    Returns:
        0; 1 with ``--check`` when a limit fails; 2 (through ``parser.error``) on a usage error.
    """
    if getattr(args, "compile_report", False):
        from bench.compile_report import main as compile_report

        return compile_report(tuple(args.arch), "full" if args.full else "default", args.json)
    impls, specs, error = _check_args(args)
    if error:
        return _usage_error(args, error)
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # checked before any timing
        print("note: matplotlib is not installed (pip install \"pagedkv[bench]\"): no plot is drawn")
        args.no_plot = True
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    malloc = "cuda caching allocator"
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
        malloc = "glibc defaults"
        if args.malloc == "retain":
            malloc = ("glibc mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=2**31-1): freed memory reused"
                      if retain_freed_memory() else "glibc defaults (mallopt unavailable)")
    quick = args.quick
    plan = Plan(device=device,
                seq_lens=args.seq_lens or list(QUICK_SEQ_LENS if quick else FULL_SEQ_LENS),
                block_sizes=args.block_sizes or list(QUICK_BLOCK_SIZES if quick else BLOCK_SIZES),
                presets=args.presets or ["8x128"], dtypes=args.dtypes or ["float32"], ops=args.ops, impls=impls,
                attn_batches=args.attn_batches or ([1, 16] if device.type == "cuda" else [1]),
                min_time=args.min_time if args.min_time is not None else (0.02 if quick else 0.3),
                attn_max_len=(QUICK_ATTN_MAX_LEN if quick and args.seq_lens is None
                              else max(args.seq_lens or FULL_SEQ_LENS)),
                rounds=max(1, args.rounds or (2 if quick else 3)),
                clock=(("thread" if args.threads == 1 else "wall") if args.clock == "auto" else args.clock)
                if device.type == "cpu" else "cuda-events",
                pool_factor=args.pool_factor, triton_on_cpu=args.triton_on_cpu, seed=args.seed, candidates=specs,
                pool_memory=args.pool_memory)
    progress = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
    rows, mem_method = sweep(plan, progress=progress)
    verdicts = limits(rows, device)
    env = environment(device, args.threads, mem_method)
    env.update(malloc=malloc, clock=plan.clock, rounds=plan.rounds)
    print(format_table(rows))
    print()
    for name, reason in plan.skipped.items():
        print(f"note: {name}: {reason}")
    print(f"device {device}, torch threads {env['threads']}, clock {plan.clock}, {plan.rounds} rounds, "
          f"load average {env['loadavg']},\nallocator: {malloc}; pools: {plan.pool_memory}; memory: {mem_method}")
    print()
    print("limits")
    print(format_limits(verdicts))
    out_dir = Path(args.out_dir or _default_out_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{device.type}-{'quick' if quick else 'full'}"
    doc = {"environment": env, "plan": {k: (str(v) if k == "device" else v) for k, v in asdict(plan).items()},
           "limits": [asdict(v) for v in verdicts], "columns": list(CSV_COLUMNS),
           "rows": [[_round(getattr(r, c)) for c in CSV_COLUMNS] for r in rows]}
    if args.validation_cost:
        doc["validation_cost"] = _validation_cost(plan)
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, default=str, separators=(",", ":")) + "\n")
    write_csv(rows, out_dir / f"{stem}.csv")
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.csv"]
    if not args.no_plot:
        plot(rows, out_dir / f"{stem}.png",
             f"time / copy bound, {device} ({env.get('cpu') or env.get('gpu', '')}, {env['threads'] or ''} thread(s))")
        written.append(out_dir / f"{stem}.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    bad = failed(verdicts)
    if args.check:
        print(f"check: {len(bad)} limit(s) failed: " + "; ".join(v.target for v in bad) if bad else
              "check: every limit passes")
        return 1 if bad else 0
    return 0


def _default_out_dir() -> str:
    """``bench/results`` in pagedkv's own checkout (its committed results), else ``.pagedkv-bench``."""
    pyproject = Path("pyproject.toml")
    own = pyproject.is_file() and 'name = "pagedkv"' in pyproject.read_text(errors="replace")
    return "bench/results" if own else ".pagedkv-bench"


def _validation_cost(plan: Plan) -> list[dict]:
    """Print and return :func:`pagedkv.cli.bench.validation.validation_cost` for the plan's built-in impls."""
    from pagedkv.backends import get_backend
    from pagedkv.cli.bench.sweep import _dtype, _preset
    from pagedkv.cli.bench.validation import format_validation_cost, validation_cost

    names = [n for n in ("loop", "indexed", "triton") if n in plan.impls
             and (n != "triton" or plan.device.type == "cuda" or plan.triton_on_cpu)]
    backends = {}
    for n in names:
        try:
            backends[n] = get_backend(n)
        except ImportError:
            continue
    heads, dim = _preset(plan.presets[0])
    point = dict(seq_len=plan.seq_lens[0], block_size=plan.block_sizes[0], heads=heads, dim=dim,
                 dtype=_dtype(plan.dtypes[0]))
    rows = validation_cost(backends, plan.device, min_time=max(plan.min_time, 0.05), rounds=plan.rounds,
                           seed=plan.seed, **point)
    print()
    print(format_validation_cost(rows, f", {plan.device}, seq_len {point['seq_len']}, block_size "
                                       f"{point['block_size']}, {plan.presets[0]}, {plan.dtypes[0]}"))
    return rows
