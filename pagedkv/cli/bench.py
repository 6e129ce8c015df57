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
import contextlib
import csv
import itertools
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

PRESETS = {"8x128": (8, 128), "32x128": (32, 128), "8x64": (8, 64), "1x128": (1, 128)}
FULL_SEQ_LENS = (64, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (64, 512, 4096)
QUICK_BLOCK_SIZES = (1, 16, 256)
QUICK_ATTN_MAX_LEN = 512
BLOCK_SIZES = (1, 16, 64, 256)
GQA_GROUP = 4  # query heads per kv head in the attention rows
DATA_OPS = ("gather", "scatter", "write_kv")
OPS = DATA_OPS + ("attention",)
IMPLS = {
    "gather": ("loop", "elementwise", "indexed", "triton"),
    "scatter": ("loop", "indexed", "triton"),
    "write_kv": ("loop", "indexed", "triton"),
    "attention": ("indexed", "indexed+sdpa", "triton"),
}
BOUNDS = ("copy", "clone")
CSV_COLUMNS = ("op", "impl", "device", "dtype", "preset", "num_kv_heads", "head_dim", "block_size", "seq_len",
               "batch", "time_s", "iqr_s", "calls", "input_sets", "bytes", "gbps", "copy_s", "clone_s", "x_copy",
               "x_clone", "pct_copy_bw", "output_bytes", "peak_extra_bytes", "extra_beyond_output_bytes", "note")


@dataclass
class Row:
    """One measured point. Times in seconds, sizes in bytes, bandwidth in GB/s (10**9 bytes/s)."""

    op: str
    impl: str
    device: str
    dtype: str
    preset: str
    num_kv_heads: int
    head_dim: int
    block_size: int
    seq_len: int
    batch: int = 1
    time_s: float | None = None
    iqr_s: float | None = None
    calls: int = 0
    input_sets: int = 0
    bytes: int = 0
    gbps: float | None = None
    copy_s: float | None = None
    clone_s: float | None = None
    x_copy: float | None = None
    x_clone: float | None = None
    pct_copy_bw: float | None = None
    output_bytes: int = 0
    peak_extra_bytes: int | None = None
    extra_beyond_output_bytes: int | None = None
    note: str = ""


@dataclass
class Verdict:
    """One target of the limits table: ``measured`` compared with ``limit`` by ``sense`` (``<=``/``>=``)."""

    target: str
    measured: float | None
    limit: float
    sense: str
    passed: bool | None
    worst_at: str = ""
    points: int = 0


# ----------------------------------------------------------------------------------------------
# CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``argparse`` subparsers object (``set_defaults(func=run)``)."""
    p = subparsers.add_parser(
        "bench", help="time loop / element-wise / indexed / triton against a memory-copy bound",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"small sweep (seq lens {QUICK_SEQ_LENS}, block sizes {QUICK_BLOCK_SIZES}, attention up to "
                        f"{QUICK_ATTN_MAX_LEN} tokens, float32, 8x128, short timing): under a minute on 2 CPU cores")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")
    p.add_argument("--seq-lens", type=_int_list, default=None, help=f"comma list; default {FULL_SEQ_LENS}")
    p.add_argument("--block-sizes", type=_int_list, default=None, help=f"comma list; default {BLOCK_SIZES}")
    p.add_argument("--presets", type=_str_list, default=None,
                   help=f"num_kv_heads x head_dim presets from {sorted(PRESETS)} or any 'HxD'; default 8x128")
    p.add_argument("--dtypes", type=_str_list, default=None, help="float32,float16,bfloat16; default float32")
    p.add_argument("--ops", type=_str_list, default=list(OPS), help=f"subset of {OPS}")
    p.add_argument("--impls", type=_str_list, default=None,
                   help="subset of loop,elementwise,indexed,indexed+sdpa,triton (bounds are always timed); default all")
    p.add_argument("--attn-batches", type=_int_list, default=None,
                   help="decode batch sizes of the attention rows; default 1 (CPU) or 1,16 (CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (torch.set_num_threads; default 1)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds of timed calls per measurement (default 0.2, --quick 0.03)")
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
                   help="pool blocks per block the table uses (block ids are a random permutation of the pool; default 1.5)")
    p.add_argument("--triton-on-cpu", action="store_true",
                   help="time the triton backend on CPU too (interpreter; only at the smallest sequence length)")
    p.add_argument("--out-dir", default="bench/results", help="where <name>.json/.csv/.png go (default bench/results)")
    p.add_argument("--name", default=None, help="file stem; default '<device>-quick' or '<device>-full'")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.set_defaults(func=run)
    return p


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _preset(name: str) -> tuple[int, int]:
    if name in PRESETS:
        return PRESETS[name]
    heads, _, dim = name.lower().partition("x")
    try:
        return int(heads), int(dim)
    except ValueError:
        raise SystemExit(f"bench: unknown preset {name!r}; use one of {sorted(PRESETS)} or 'HxD'") from None


# ----------------------------------------------------------------------------------------------
# Timing


def _llc_bytes() -> int:
    """Last-level cache size of CPU 0 from sysfs (32 MiB when unknown)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 * 1024 ** 2


class Timer:
    """Median time of ``fn(inputs)`` rotated over input sets, on CPU or CUDA."""

    def __init__(self, device: torch.device, min_time: float, clock: str = "wall"):
        self.device = device
        self.min_time = min_time
        self.clock = clock
        self._flush = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 1024 ** 2
            self._flush = torch.empty(max(2 * l2, 256 * 1024 ** 2) // 4, dtype=torch.int32, device=device)

    def time(self, fn: Callable[[Any], Any], sets: list[Any], graph: bool = False,
             warmup: bool = True) -> tuple[float, float, int]:
        """``(median_s, iqr_s, calls)`` of ``fn(sets[i])``, ``i`` rotating; warm-up on every set first."""
        if warmup:
            for inputs in sets:
                fn(inputs)
        if self.device.type == "cuda":
            return self._time_cuda(fn, sets, graph)
        from torch.utils import benchmark

        counter = itertools.count()
        n = len(sets)

        def step() -> None:
            fn(sets[next(counter) % n])

        timer = time.thread_time if self.clock == "thread" else time.perf_counter
        m = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads(), timer=timer
                            ).blocked_autorange(min_run_time=self.min_time)
        return float(m.median), float(m.iqr), int(m.number_per_run * len(m.raw_times))

    @staticmethod
    def _syncs(call) -> bool:
        """True when ``call()`` synchronises with the host (then it cannot be captured in a CUDA graph)."""
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            return False
        except RuntimeError:
            return True
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    def _time_cuda(self, fn, sets, graph: bool) -> tuple[float, float, int]:
        torch.cuda.synchronize(self.device)
        calls = [lambda inputs=inputs: fn(inputs) for inputs in sets]
        if graph and not self._syncs(calls[0]):  # small shapes: replay a captured graph per set
            graphs = []
            try:
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for call in calls:  # warm-up on the side stream before capture
                        call()
                torch.cuda.current_stream(self.device).wait_stream(stream)
                for call in calls:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        call()
                    graphs.append(g)
                calls = [g.replay for g in graphs]
            except Exception:  # an op that syncs with the host cannot be captured: time it eagerly
                torch.cuda.synchronize(self.device)
        # estimate one call, then size the number of timed calls to min_time
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        torch.cuda.synchronize(self.device)
        est = max(start.elapsed_time(end) / 1e3 / len(calls), 1e-6)
        reps = int(min(max(self.min_time / est, 10), 1000))
        times = []
        for i in range(reps):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[i % len(calls)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
        return q(0.5), q(0.75) - q(0.25), reps


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's native start/stop log lines) for the block."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int | None, str]:
    """Peak bytes allocated on ``device`` during one ``fn()`` call beyond what was allocated before.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the running sum
    of the CPU allocator's allocation/free events recorded by ``torch.profiler`` with
    ``profile_memory=True`` (``tracemalloc`` does not see torch allocations). Returns
    ``(bytes or None, method)``.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        return peak, "torch.cuda.max_memory_allocated (caching allocator)"
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    try:
        from torch._C._profiler import _EventType

        events = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith("cpu"):
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
        method = "torch.profiler(profile_memory=True): CPU allocator alloc/free events, running sum"
    except Exception:  # private API moved: fall back to per-op self memory (net per op, coarser)
        events = [(e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage]
        method = "torch.profiler(profile_memory=True): per-op self CPU memory, running sum (op granularity)"
    total = peak = 0
    for _, size in sorted(events):
        total += size
        peak = max(peak, total)
    return peak, method


# ----------------------------------------------------------------------------------------------
# Inputs


def _dtype(name: str) -> torch.dtype:
    from pagedkv.config import dtype_from_name

    return dtype_from_name(name)


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def _make_set(op: str, seq_len: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
              device: torch.device, batch: int, pool_factor: float, gen: torch.Generator) -> dict:
    """One input set for ``op``: pools whose used blocks are a random permutation of a larger pool."""
    blocks = -(-seq_len // block_size)
    if op == "attention":
        num_blocks = int(math.ceil(batch * blocks * pool_factor)) + 1
        perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks].view(batch, blocks)
        k = _randn((num_blocks, block_size, heads, dim), dtype, device, gen)
        v = _randn((num_blocks, block_size, heads, dim), dtype, device, gen)
        return dict(query=_randn((batch, heads * GQA_GROUP, dim), dtype, device, gen), k_cache=k, v_cache=v,
                    block_tables=perm.to(torch.int32).to(device),
                    seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
                    query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device))
    num_blocks = int(math.ceil(blocks * pool_factor)) + 1
    table = torch.randperm(num_blocks, generator=gen)[:blocks]
    cache = _randn((num_blocks, block_size, heads, dim), dtype, device, gen)
    if op == "gather":
        return dict(cache=cache, table=table.to(torch.int32).to(device), seq_len=seq_len)
    if op == "scatter":
        return dict(cache=cache, table=table.to(torch.int32).to(device),
                    values=_randn((seq_len, heads, dim), dtype, device, gen))
    positions = torch.arange(seq_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    return dict(k_cache=cache, v_cache=_randn(cache.shape, dtype, device, gen),
                key=_randn((seq_len, heads, dim), dtype, device, gen),
                value=_randn((seq_len, heads, dim), dtype, device, gen), slot_mapping=slots.to(device))


def _payload_elems(op: str, seq_len: int, heads: int, dim: int, batch: int) -> int:
    """Elements the op moves once (the copy bound copies exactly these)."""
    per_seq = seq_len * heads * dim
    return {"gather": per_seq, "scatter": per_seq, "write_kv": 2 * per_seq, "attention": 2 * batch * per_seq}[op]


def _sdpa_attention(backend):
    """Decode attention as gather-then-SDPA: the backend's gather, then ``scaled_dot_product_attention``."""
    import torch.nn.functional as F

    def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
        out = torch.empty_like(query)
        group = query.shape[1] // k_cache.shape[2]
        for b, seq_len in enumerate(seq_lens.tolist()):
            k = backend.gather(k_cache, block_tables[b], seq_len, validate=False)
            v = backend.gather(v_cache, block_tables[b], seq_len, validate=False)
            q = query[b : b + 1].transpose(0, 1).unsqueeze(0)  # [1, Hq, 1, D]
            kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            try:  # decode: the single query row sees the whole context, no mask
                out[b] = F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True)[0, :, 0]
            except TypeError:  # torch without enable_gqa: expand the kv heads
                kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
                out[b] = F.scaled_dot_product_attention(q, kt, vt)[0, :, 0]
        return out

    return paged_attention


def _op_fn(op: str, impl: str, backends: dict) -> Callable[[dict], Any]:
    """``fn(inputs)`` calling ``impl``'s ``op`` on one input set."""
    if op == "gather":
        if impl == "elementwise":
            from pagedkv.backends.indexed import gather_kv_from_blocks_v2 as v2

            return lambda s: v2(s["cache"], s["table"], s["seq_len"])
        g = backends[impl].gather
        return lambda s: g(s["cache"], s["table"], s["seq_len"], validate=False)
    if op == "scatter":
        f = backends[impl].scatter
        return lambda s: f(s["cache"], s["table"], s["values"], 0, validate=False)
    if op == "write_kv":
        f = backends[impl].write_kv
        return lambda s: f(s["k_cache"], s["v_cache"], s["key"], s["value"], s["slot_mapping"], validate=False)
    if impl == "indexed+sdpa":
        f = _sdpa_attention(backends["indexed"])
        return lambda s: f(s["query"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"],
                           s["query_start_loc"])
    f = backends[impl].paged_attention
    return lambda s: f(s["query"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"],
                       s["query_start_loc"], validate=False)


# ----------------------------------------------------------------------------------------------
# The sweep


@dataclass
class Plan:
    device: torch.device
    seq_lens: list[int]
    block_sizes: list[int]
    presets: list[str]
    dtypes: list[str]
    ops: list[str]
    impls: list[str]
    attn_batches: list[int]
    min_time: float
    attn_max_len: int
    rounds: int
    clock: str
    pool_factor: float
    triton_on_cpu: bool
    seed: int
    skipped: dict = field(default_factory=dict)  # impl -> reason


def _load_backends(plan: Plan) -> dict:
    from pagedkv import get_backend

    backends = {}
    for name in ("loop", "indexed", "triton"):
        if name not in plan.impls and not (name == "indexed" and {"elementwise", "indexed+sdpa"} & set(plan.impls)):
            continue
        if name == "triton" and plan.device.type == "cpu" and not plan.triton_on_cpu:
            plan.skipped["triton"] = ("not timed on CPU: Triton runs in its interpreter there (orders of magnitude "
                                      "slower than compiled code); pass --triton-on-cpu to time the smallest size")
            continue
        try:
            backends[name] = get_backend(name)
        except Exception as exc:  # BackendUnavailableError, or a backend that fails to import
            plan.skipped[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return backends


def _sets_for(op, seq_len, block_size, heads, dim, dtype, plan, batch, gen, llc) -> list[dict]:
    elem = torch.finfo(dtype).bits // 8
    set_bytes = _payload_elems(op, seq_len, heads, dim, batch) * elem * (1 + plan.pool_factor)
    if plan.device.type == "cuda":
        n = 2  # the L2 is flushed before every timed call
    else:
        n = int(min(32, max(2, math.ceil(2 * llc / set_bytes))))
        n = max(2, min(n, int(2 * 1024 ** 3 // set_bytes)))
    return [_make_set(op, seq_len, block_size, heads, dim, dtype, plan.device, batch, plan.pool_factor, gen)
            for _ in range(n)]


def _bound_sets(elems: int, dtype: torch.dtype, plan: Plan, llc: int, gen) -> list[dict]:
    elem = torch.finfo(dtype).bits // 8
    n = 2 if plan.device.type == "cuda" else int(min(32, max(2, math.ceil(2 * llc / (2 * elems * elem)))))
    return [dict(src=_randn((elems,), dtype, plan.device, gen), dst=torch.empty(elems, dtype=dtype, device=plan.device))
            for _ in range(n)]


def sweep(plan: Plan, progress: bool = True) -> tuple[list[Row], str]:
    """Run the plan; returns the rows and the memory-measurement method used."""
    backends = _load_backends(plan)
    timer = Timer(plan.device, plan.min_time / plan.rounds, plan.clock)
    llc = _llc_bytes()
    mem_method = ""
    rows: list[Row] = []
    groups = []
    for preset, dtype_name, op, bs, seq_len in itertools.product(plan.presets, plan.dtypes, plan.ops,
                                                                  plan.block_sizes, plan.seq_lens):
        if op == "attention" and seq_len > plan.attn_max_len:
            continue
        for batch in (plan.attn_batches if op == "attention" else [1]):
            groups.append((preset, dtype_name, op, bs, seq_len, batch))
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(groups), desc="bench", unit="point", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    gen = torch.Generator().manual_seed(plan.seed)
    small_graph_bytes = 16 * 1024 ** 2
    for preset, dtype_name, op, bs, seq_len, batch in groups:
        heads, dim = _preset(preset)
        dtype = _dtype(dtype_name)
        elem = torch.finfo(dtype).bits // 8
        if bar is not None:
            bar.set_postfix_str(f"{op} {preset} {dtype_name} bs={bs} L={seq_len}" + (f" B={batch}" if op == "attention" else ""))
        elems = _payload_elems(op, seq_len, heads, dim, batch)
        payload = elems * elem
        graph = plan.device.type == "cuda" and payload < small_graph_bytes
        base = dict(device=str(plan.device), dtype=dtype_name, preset=preset, num_kv_heads=heads, head_dim=dim,
                    block_size=bs, seq_len=seq_len, batch=batch)
        # bounds: a contiguous copy of the same payload, timed in the same interleaved rounds as the ops
        bsets = _bound_sets(elems, dtype, plan, llc, gen)
        sets = _sets_for(op, seq_len, bs, heads, dim, dtype, plan, batch, gen, llc)
        entries = [(Row(op=op, impl="copy", input_sets=len(bsets), **base), lambda s: s["dst"].copy_(s["src"]), bsets, graph),
                   (Row(op=op, impl="clone", input_sets=len(bsets), **base), lambda s: s["src"].clone(), bsets, graph)]
        for impl in IMPLS[op]:
            needs = "indexed" if impl in ("elementwise", "indexed+sdpa") else impl
            if impl not in plan.impls or needs not in backends:
                continue
            if impl == "triton" and plan.device.type == "cpu" and seq_len != min(plan.seq_lens):
                continue
            entries.append((Row(op=op, impl=impl, input_sets=len(sets), **base), _op_fn(op, impl, backends), sets,
                            graph and impl not in ("loop", "elementwise")))
        best: dict[int, tuple[float, float, int]] = {}
        for round_ in range(plan.rounds):
            for i, (row, fn, inputs, use_graph) in enumerate(entries):
                if row.note:
                    continue
                try:
                    t = timer.time(fn, inputs, use_graph, warmup=round_ == 0)
                except Exception as exc:  # a backend that cannot run this point: record why, keep going
                    row.note = f"failed: {type(exc).__name__}: {exc}"[:300]
                    continue
                if i not in best or t[0] < best[i][0]:
                    best[i] = t
        measured = []
        for i, (row, fn, inputs, _) in enumerate(entries):
            if i in best:
                row.time_s, row.iqr_s, row.calls = best[i]
            if row.impl not in BOUNDS and not row.note:
                try:
                    row.peak_extra_bytes, mem_method = peak_extra_bytes(lambda: fn(inputs[0]), plan.device)
                except Exception as exc:
                    row.note = f"memory: {type(exc).__name__}: {exc}"[:300]
            measured.append(row)
        copy_s, clone_s = measured[0].time_s, measured[1].time_s
        out_bytes = {"gather": payload, "attention": batch * heads * GQA_GROUP * dim * elem}.get(op, 0)
        moved = {"attention": payload}.get(op, 2 * payload)  # decode reads K and V once
        for row in measured:
            row.copy_s, row.clone_s = copy_s, clone_s
            row.bytes = 2 * payload if row.impl in BOUNDS else moved
            row.output_bytes = payload if row.impl == "clone" else (0 if row.impl == "copy" else out_bytes)
            if row.time_s and copy_s and clone_s:
                row.gbps = row.bytes / row.time_s / 1e9
                row.x_copy = row.time_s / copy_s
                row.x_clone = row.time_s / clone_s
                row.pct_copy_bw = 100.0 * row.gbps / (2 * payload / copy_s / 1e9)
            if row.peak_extra_bytes is not None:
                row.extra_beyond_output_bytes = row.peak_extra_bytes - row.output_bytes
        rows.extend(measured)
        del sets, bsets
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows, mem_method


# ----------------------------------------------------------------------------------------------
# Limits


def _worst(rows: list[Row], key: Callable[[Row], float | None], pick=max) -> tuple[float | None, str, int]:
    vals = [(key(r), r) for r in rows]
    vals = [(v, r) for v, r in vals if v is not None]
    if not vals:
        return None, "", 0
    v, r = pick(vals, key=lambda t: t[0])
    where = f"{r.preset} {r.dtype} bs={r.block_size} L={r.seq_len}" + (f" B={r.batch}" if r.op == "attention" else "")
    return v, where, len(vals)


def _verdict(target, rows, key, limit, sense) -> Verdict:
    v, where, n = _worst(rows, key, max if sense == "<=" else min)
    passed = None if v is None else (v <= limit if sense == "<=" else v >= limit)
    return Verdict(target, v, limit, sense, passed, where, n)


def limits(rows: list[Row], device: torch.device) -> list[Verdict]:
    """The project's performance targets for ``device``, evaluated on ``rows`` (worst point each)."""
    sel = lambda op, impl, **kw: [r for r in rows if r.op == op and r.impl == impl and r.time_s  # noqa: E731
                                  and all(f(getattr(r, k)) for k, f in kw.items())]
    out = []
    if device.type == "cpu":
        out.append(_verdict("gather (indexed) / copy bound, L >= 512, every block size",
                            sel("gather", "indexed", seq_len=lambda L: L >= 512), lambda r: r.x_copy, 1.25, "<="))
        out.append(_verdict("gather (indexed) / clone (copy into a new tensor), L >= 512 [informational]",
                            sel("gather", "indexed", seq_len=lambda L: L >= 512), lambda r: r.x_clone, 1.25, "<="))
        loop_t = {(r.preset, r.dtype, r.block_size, r.seq_len): r.time_s for r in sel("gather", "loop")}
        out.append(_verdict("gather (indexed) / gather (loop), whole sweep",
                            [r for r in sel("gather", "indexed") if (r.preset, r.dtype, r.block_size, r.seq_len) in loop_t],
                            lambda r: r.time_s / loop_t[(r.preset, r.dtype, r.block_size, r.seq_len)], 1.0, "<="))
        for op in ("scatter", "write_kv"):
            out.append(_verdict(f"{op} (indexed) / copy bound, L >= 4096", sel(op, "indexed", seq_len=lambda L: L >= 4096),
                                lambda r: r.x_copy, 2.0, "<="))
            loop_t = {(r.preset, r.dtype, r.block_size, r.seq_len): r.time_s for r in sel(op, "loop")}
            out.append(_verdict(f"{op} (indexed) / {op} (loop), whole sweep [informational]",
                                [r for r in sel(op, "indexed") if (r.preset, r.dtype, r.block_size, r.seq_len) in loop_t],
                                lambda r: r.time_s / loop_t[(r.preset, r.dtype, r.block_size, r.seq_len)], 1.0, "<="))
    else:
        out.append(_verdict("gather (indexed) % copy bandwidth, bs >= 16, L >= 4096",
                            sel("gather", "indexed", block_size=lambda b: b >= 16, seq_len=lambda L: L >= 4096),
                            lambda r: r.pct_copy_bw, 90.0, ">="))
        out.append(_verdict("gather (indexed) % copy bandwidth, bs = 1, L >= 4096",
                            sel("gather", "indexed", block_size=lambda b: b == 1, seq_len=lambda L: L >= 4096),
                            lambda r: r.pct_copy_bw, 80.0, ">="))
        for impl in ("indexed", "triton"):
            out.append(_verdict(f"write_kv ({impl}) % copy bandwidth, L >= 4096",
                                sel("write_kv", impl, seq_len=lambda L: L >= 4096), lambda r: r.pct_copy_bw, 50.0, ">="))
        for tokens, pct in ((64 * 1024, 80.0), (256 * 1024, 90.0)):
            out.append(_verdict(f"fused decode attention (triton) % copy bandwidth, batch x context >= {tokens // 1024}k",
                                sel("attention", "triton", seq_len=lambda L: True), lambda r: r.pct_copy_bw
                                if r.batch * r.seq_len >= tokens else None, pct, ">="))
        sdpa = {(r.preset, r.dtype, r.block_size, r.seq_len, r.batch): r.time_s for r in sel("attention", "indexed+sdpa")}
        out.append(_verdict("fused decode (triton) / gather-then-SDPA time, batch x context >= 16k",
                            [r for r in sel("attention", "triton") if r.batch * r.seq_len >= 16 * 1024
                             and (r.preset, r.dtype, r.block_size, r.seq_len, r.batch) in sdpa],
                            lambda r: r.time_s / sdpa[(r.preset, r.dtype, r.block_size, r.seq_len, r.batch)], 1.0, "<="))
    out.append(_verdict("indexed: extra memory beyond the output / output size (no full-size temporary)",
                        [r for r in rows if r.impl == "indexed" and r.op in DATA_OPS and r.peak_extra_bytes is not None
                         and r.seq_len * r.num_kv_heads * r.head_dim >= 64 * 1024],
                        lambda r: r.extra_beyond_output_bytes / (r.seq_len * r.num_kv_heads * r.head_dim
                                                                  * torch.finfo(_dtype(r.dtype)).bits // 8),
                        0.5, "<="))
    return out


# ----------------------------------------------------------------------------------------------
# Reporting


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _mib(v) -> str:
    return "-" if v is None else f"{v / 1024 ** 2:.2f}"


def format_table(rows: list[Row]) -> str:
    """Fixed-width text table of the rows."""
    head = ("op", "impl", "dtype", "HxD", "bs", "L", "B", "time_us", "GB/s", "x_copy", "x_clone", "%copy_bw",
            "out_MiB", "peak_MiB")
    lines = [head]
    for r in rows:
        lines.append((r.op, r.impl, r.dtype, r.preset, str(r.block_size), str(r.seq_len), str(r.batch),
                      _fmt(r.time_s * 1e6 if r.time_s else None, ".1f"), _fmt(r.gbps, ".1f"), _fmt(r.x_copy),
                      _fmt(r.x_clone), _fmt(r.pct_copy_bw, ".0f"), _mib(r.output_bytes), _mib(r.peak_extra_bytes))
                     + ((r.note,) if r.note else ()))
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     + ("  " + line[-1] if len(line) > len(head) else "") for line in lines)


def format_limits(verdicts: list[Verdict]) -> str:
    """The limits verdict table (target, measured worst point, limit, PASS/FAIL)."""
    lines = [("target", "measured", "limit", "verdict", "worst at", "points")]
    for v in verdicts:
        lines.append((v.target, _fmt(v.measured, ".3f"), f"{v.sense} {v.limit:g}",
                      {True: "PASS", False: "FAIL", None: "n/a"}[v.passed], v.worst_at, str(v.points)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _round(v):
    return float(f"{v:.4g}") if isinstance(v, float) else v


def load_rows(path: str | Path) -> list[Row]:
    """The rows of a results JSON written by ``run`` (columns + row lists)."""
    doc = json.loads(Path(path).read_text())
    return [Row(**dict(zip(doc["columns"], values))) for values in doc["rows"]]


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            w.writerow({k: (f"{d[k]:.4g}" if isinstance(d[k], float) else d[k]) for k in CSV_COLUMNS})


def plot(rows: list[Row], path: Path, title: str) -> None:
    """PNG: time relative to the copy bound vs sequence length, one panel per (op, block size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    first = next((r for r in rows if r.time_s), None)
    if first is None:
        return
    rows = [r for r in rows if r.preset == first.preset and r.dtype == first.dtype and r.time_s and r.batch ==
            min(x.batch for x in rows if x.op == r.op)]
    ops = [op for op in OPS if any(r.op == op for r in rows)]
    sizes = sorted({r.block_size for r in rows})
    fig, axes = plt.subplots(len(ops), len(sizes), figsize=(3.2 * len(sizes), 2.6 * len(ops)), squeeze=False,
                             sharex=True)
    styles = {"loop": "C0o-", "elementwise": "C1s-", "indexed": "C2^-", "triton": "C3D-", "indexed+sdpa": "C4v-",
              "clone": "k:", "copy": "k-"}
    for i, op in enumerate(ops):
        for j, bs in enumerate(sizes):
            ax = axes[i][j]
            for impl in ("copy", "clone") + IMPLS[op]:
                pts = sorted((r.seq_len, r.x_copy) for r in rows if r.op == op and r.block_size == bs and r.impl == impl)
                if pts:
                    ax.plot(*zip(*pts), styles.get(impl, "-"), label=impl, markersize=3, linewidth=1)
            for lim in {"gather": (1.25,), "scatter": (2.0,), "write_kv": (2.0,)}.get(op, ()):
                ax.axhline(lim, color="r", linewidth=0.6, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{op}, block_size={bs}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
            if j == 0:
                ax.set_ylabel("time / copy", fontsize=8)
            if i == len(ops) - 1:
                ax.set_xlabel("sequence length (tokens)", fontsize=8)
        axes[i][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=64)
    plt.close(fig)


def retain_freed_memory() -> bool:
    """Ask glibc to serve every allocation from the heap and never trim it (see ``--malloc``).

    Returns True when both ``mallopt`` calls succeeded (False on a non-glibc libc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(device: torch.device, threads: int, mem_method: str) -> dict:
    """Versions, device and settings recorded with the results."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": str(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
           "requested_threads": threads, "cpu_count": os.cpu_count(), "llc_bytes": _llc_bytes(),
           "memory_method": mem_method, "loadavg": _loadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        env["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_parser`); returns the exit status (0)."""
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
    impls = args.impls or ["loop", "elementwise", "indexed", "indexed+sdpa", "triton"]
    plan = Plan(device=device,
                seq_lens=args.seq_lens or list(QUICK_SEQ_LENS if quick else FULL_SEQ_LENS),
                block_sizes=args.block_sizes or list(QUICK_BLOCK_SIZES if quick else BLOCK_SIZES),
                presets=args.presets or ["8x128"], dtypes=args.dtypes or ["float32"], ops=args.ops, impls=impls,
                attn_batches=args.attn_batches or ([1, 16] if device.type == "cuda" else [1]),
                min_time=args.min_time if args.min_time is not None else (0.02 if quick else 0.3),
                attn_max_len=QUICK_ATTN_MAX_LEN if quick and args.seq_lens is None else max(args.seq_lens or FULL_SEQ_LENS),
                rounds=max(1, args.rounds or (2 if quick else 3)),
                clock=(("thread" if args.threads == 1 else "wall") if args.clock == "auto" else args.clock)
                if device.type == "cpu" else "cuda-events",
                pool_factor=args.pool_factor, triton_on_cpu=args.triton_on_cpu, seed=args.seed)
    for op in plan.ops:
        if op not in OPS:
            raise SystemExit(f"bench: unknown op {op!r}; choose from {OPS}")
    rows, mem_method = sweep(plan, progress=not args.no_progress)
    verdicts = limits(rows, device)
    env = environment(device, args.threads, mem_method)
    env.update(malloc=malloc, clock=plan.clock, rounds=plan.rounds)
    print(format_table(rows))
    print()
    for name, reason in plan.skipped.items():
        print(f"note: {name}: {reason}")
    print(f"device {device}, torch threads {env['threads']}, clock {plan.clock}, {plan.rounds} rounds, "
          f"load average {env['loadavg']},\nallocator: {malloc}; memory: {mem_method}")
    print()
    print("limits")
    print(format_limits(verdicts))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{device.type}-{'quick' if quick else 'full'}"
    doc = {"environment": env, "plan": {k: (str(v) if k == "device" else v) for k, v in asdict(plan).items()},
           "limits": [asdict(v) for v in verdicts], "columns": list(CSV_COLUMNS),
           "rows": [[_round(getattr(r, c)) for c in CSV_COLUMNS] for r in rows]}
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, default=str, separators=(",", ":")) + "\n")
    write_csv(rows, out_dir / f"{stem}.csv")
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.csv"]
    if not args.no_plot:
        plot(rows, out_dir / f"{stem}.png",
             f"time / copy bound, {device} ({env.get('cpu') or env.get('gpu', '')}, {env['threads'] or ''} thread(s))")
        written.append(out_dir / f"{stem}.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
