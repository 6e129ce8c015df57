"""What ``python -m pagedkv bench`` times: the sweep plan, its inputs, the calls, and the rows.

For every point (sequence length x block size x preset x dtype x op) the sweep builds input sets
whose block tables are random permutations of a larger pool, times every implementation and the
two copy bounds in interleaved rounds (:mod:`pagedkv.cli.bench.timing`), and fills one :class:`Row`
each, with the ratios to the bounds.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch

from pagedkv.cli.bench.timing import Timer, llc_bytes, peak_extra_bytes


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
    # triton: fused decode, split-K chosen from the SM count on CUDA; triton-nosplit: the same with one split
    "attention": ("indexed", "indexed+sdpa", "triton", "triton-nosplit"),
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


def _preset(name: str) -> tuple[int, int]:
    if name in PRESETS:
        return PRESETS[name]
    heads, _, dim = name.lower().partition("x")
    try:
        return int(heads), int(dim)
    except ValueError:
        raise SystemExit(f"bench: unknown preset {name!r}; use one of {sorted(PRESETS)} or 'HxD'") from None


def _dtype(name: str) -> torch.dtype:
    from pagedkv.cache.config import dtype_from_name

    return dtype_from_name(name)


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def _pool_randn(shape, dtype, device, gen, pool_memory: str) -> torch.Tensor:
    """Random pool contents in memory allocated as ``pool_memory`` says: ``cache`` as
    :class:`pagedkv.PagedKVCache` allocates its pools (:func:`pagedkv.cache.hugepages.zeros`), ``torch``
    by ``torch.empty`` (a caller's own pool)."""
    if pool_memory == "torch":
        return _randn(shape, dtype, device, gen)
    from pagedkv.cache import hugepages

    return hugepages.zeros(shape, dtype, device).copy_(_randn(shape, dtype, device, gen))


def _make_set(op: str, seq_len: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
              device: torch.device, batch: int, pool_factor: float, gen: torch.Generator,
              pool_memory: str = "cache") -> dict:
    """One input set for ``op``: pools whose used blocks are a random permutation of a larger pool."""
    pool = lambda shape: _pool_randn(shape, dtype, device, gen, pool_memory)
    blocks = -(-seq_len // block_size)
    if op == "attention":
        num_blocks = int(math.ceil(batch * blocks * pool_factor)) + 1
        perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks].view(batch, blocks)
        k = pool((num_blocks, block_size, heads, dim))
        v = pool((num_blocks, block_size, heads, dim))
        return dict(query=_randn((batch, heads * GQA_GROUP, dim), dtype, device, gen), k_cache=k, v_cache=v,
                    block_tables=perm.to(torch.int32).to(device),
                    seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
                    query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device))
    num_blocks = int(math.ceil(blocks * pool_factor)) + 1
    table = torch.randperm(num_blocks, generator=gen)[:blocks]
    cache = pool((num_blocks, block_size, heads, dim))
    if op == "gather":
        return dict(cache=cache, table=table.to(torch.int32).to(device), seq_len=seq_len)
    if op == "scatter":
        return dict(cache=cache, table=table.to(torch.int32).to(device),
                    values=_randn((seq_len, heads, dim), dtype, device, gen))
    positions = torch.arange(seq_len)
    slots = table[positions // block_size] * block_size + positions % block_size
    return dict(k_cache=cache, v_cache=pool(cache.shape),
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


def _no_validate(fn: Callable) -> dict:
    """``{"validate": False}`` when ``fn`` takes a ``validate`` keyword (the built-ins; a candidate may not)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {"validate": False} if "validate" in params else {}


#: the contract op each bench op calls
CONTRACT_OP = {"gather": "gather", "scatter": "scatter", "write_kv": "write_kv", "attention": "paged_attention"}


def _op_fn(op: str, impl: str, backends: dict) -> Callable[[dict], Any]:
    """``fn(inputs)`` calling ``impl``'s ``op`` on one input set, with the contract's positional arguments."""
    if op == "gather" and impl == "elementwise":
        from pagedkv.backends.indexed import gather_kv_from_blocks_v2 as v2

        return lambda s: v2(s["cache"], s["table"], s["seq_len"])
    if op == "attention" and impl == "indexed+sdpa":
        f = _sdpa_attention(backends["indexed"])
        return lambda s: f(s["query"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"],
                           s["query_start_loc"])
    if op == "attention" and impl == "triton-nosplit":
        from pagedkv.backends.triton.launch_grid import splits

        f = backends["triton"].paged_attention

        def unsplit(s):
            with splits(1):
                return f(s["query"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"],
                         s["query_start_loc"], None, **_no_validate(f))
        return unsplit
    f = getattr(backends[impl], CONTRACT_OP[op])
    kw = _no_validate(f)
    if op == "gather":
        return lambda s: f(s["cache"], s["table"], s["seq_len"], **kw)
    if op == "scatter":
        return lambda s: f(s["cache"], s["table"], s["values"], 0, **kw)
    if op == "write_kv":
        return lambda s: f(s["k_cache"], s["v_cache"], s["key"], s["value"], s["slot_mapping"], **kw)
    return lambda s: f(s["query"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"],
                       s["query_start_loc"], None, **kw)


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
    candidates: list[str] = field(default_factory=list)  # backend specs (pagedkv.load_backend), timed as impl = spec
    skipped: dict = field(default_factory=dict)  # impl -> reason
    pool_memory: str = "cache"  # cache: allocated as PagedKVCache allocates (huge pages); torch: torch.empty


def _load_backends(plan: Plan) -> dict:
    from pagedkv import get_backend

    backends = {}
    for name in ("loop", "indexed", "triton"):
        if name not in plan.impls and not (name == "indexed" and {"elementwise", "indexed+sdpa"} & set(plan.impls)) \
                and not (name == "triton" and "triton-nosplit" in plan.impls):
            continue
        if name == "triton" and plan.device.type == "cpu" and "attention" in plan.ops:
            plan.skipped["split-K decode (triton vs triton-nosplit)"] = (
                "no split-K rows on CPU: the split count comes from the GPU's SM count (bench on CUDA with "
                "--seq-lens up to 131072 --attn-batches 1,4 for them)")
        if name == "triton" and plan.device.type == "cpu" and not plan.triton_on_cpu:
            plan.skipped["triton"] = ("not timed on CPU: Triton runs in its interpreter there (orders of magnitude "
                                      "slower than compiled code); pass --triton-on-cpu to time the smallest size")
            continue
        try:
            backends[name] = get_backend(name)
        except Exception as exc:  # BackendUnavailableError, or a backend that fails to import
            plan.skipped[name] = f"unavailable: {type(exc).__name__}: {exc}"
    for spec in plan.candidates:  # loaded as the suite loads --pagedkv-impl (the CLI checked it loads)
        from pagedkv.backends import load_backend

        backends[spec] = load_backend(spec)
        lacks = [op for op in plan.ops if not callable(getattr(backends[spec], CONTRACT_OP[op], None))]
        if lacks:
            plan.skipped[spec] = f"candidate provides no {', '.join(CONTRACT_OP[op] for op in lacks)}: not timed there"
    return backends


def _sets_for(op, seq_len, block_size, heads, dim, dtype, plan, batch, gen, llc) -> list[dict]:
    elem = torch.finfo(dtype).bits // 8
    set_bytes = _payload_elems(op, seq_len, heads, dim, batch) * elem * (1 + plan.pool_factor)
    if plan.device.type == "cuda":
        n = 2  # the L2 is flushed before every timed call
    else:
        n = int(min(32, max(2, math.ceil(2 * llc / set_bytes))))
        n = max(2, min(n, int(2 * 1024 ** 3 // set_bytes)))
    return [_make_set(op, seq_len, block_size, heads, dim, dtype, plan.device, batch, plan.pool_factor, gen,
                      plan.pool_memory)
            for _ in range(n)]


def _bound_sets(elems: int, dtype: torch.dtype, plan: Plan, llc: int, gen) -> list[dict]:
    elem = torch.finfo(dtype).bits // 8
    n = 2 if plan.device.type == "cuda" else int(min(32, max(2, math.ceil(2 * llc / (2 * elems * elem)))))
    # the copy reads the same kind of memory as the ops' pools, and writes where their outputs go
    return [dict(src=_pool_randn((elems,), dtype, plan.device, gen, plan.pool_memory),
                 dst=torch.empty(elems, dtype=dtype, device=plan.device))
            for _ in range(n)]


def sweep(plan: Plan, progress: bool = True) -> tuple[list[Row], str]:
    """Run the plan; returns the rows and the memory-measurement method used."""
    backends = _load_backends(plan)
    timer = Timer(plan.device, plan.min_time / plan.rounds, plan.clock)
    llc = llc_bytes()
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
            bar.set_postfix_str(f"{op} {preset} {dtype_name} bs={bs} L={seq_len}"
                                + (f" B={batch}" if op == "attention" else ""))
        elems = _payload_elems(op, seq_len, heads, dim, batch)
        payload = elems * elem
        graph = plan.device.type == "cuda" and payload < small_graph_bytes
        base = dict(device=str(plan.device), dtype=dtype_name, preset=preset, num_kv_heads=heads, head_dim=dim,
                    block_size=bs, seq_len=seq_len, batch=batch)
        # bounds: a contiguous copy of the same payload, timed in the same interleaved rounds as the ops
        bsets = _bound_sets(elems, dtype, plan, llc, gen)
        sets = _sets_for(op, seq_len, bs, heads, dim, dtype, plan, batch, gen, llc)
        entries = [(Row(op=op, impl="copy", input_sets=len(bsets), **base), lambda s: s["dst"].copy_(s["src"]), bsets,
                    graph),
                   (Row(op=op, impl="clone", input_sets=len(bsets), **base), lambda s: s["src"].clone(), bsets, graph)]
        for impl in IMPLS[op] + tuple(plan.candidates):
            needs = {"elementwise": "indexed", "indexed+sdpa": "indexed", "triton-nosplit": "triton"}.get(impl, impl)
            if (impl not in plan.impls and impl not in plan.candidates) or needs not in backends:
                continue
            if impl in plan.candidates and not callable(getattr(backends[impl], CONTRACT_OP[op], None)):
                continue
            if impl in plan.candidates and _outside_declared(backends[impl], bs, heads, dim, dtype_name):
                plan.skipped[f"{impl} at {dtype_name} {preset} bs={bs}"] = _outside_declared(
                    backends[impl], bs, heads, dim, dtype_name)  # timed only inside its declared space
                continue
            if impl == "triton-nosplit" and plan.device.type == "cpu":
                continue
            if impl == "triton" and plan.device.type == "cpu" and seq_len != min(plan.seq_lens):
                continue
            entries.append((Row(op=op, impl=impl, input_sets=len(sets), **base), _op_fn(op, impl, backends), sets,
                            graph and impl not in ("loop", "elementwise")))
        best: dict[int, tuple[float, float, int]] = {}
        for round_ in range(plan.rounds):
            order = list(range(len(entries)))
            if round_:  # a new order each round: no implementation always runs after the same one
                random.Random(plan.seed * 1000 + round_).shuffle(order)
            for i in order:
                row, fn, inputs, use_graph = entries[i]
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
                    row.peak_extra_bytes, mem_method = peak_extra_bytes(lambda fn=fn, inputs=inputs: fn(inputs[0]),
                                                                        plan.device)
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


def _outside_declared(backend, block_size: int, heads: int, dim: int, dtype: str) -> str | None:
    """Why a candidate's declared space (its ``capabilities``) excludes this sweep point, or ``None``."""
    from pagedkv.backends.capabilities import capabilities_of

    caps = capabilities_of(backend)
    for what, sizes, n in (("block_size", caps.block_sizes, block_size), ("head_dim", caps.head_dims, dim),
                           ("num_kv_heads", caps.num_kv_heads, heads)):
        if not sizes.allows(n):
            return f"{what} {n} is outside its declared {sizes.describe()}: not timed"
    return None if dtype in caps.dtypes else f"dtype {dtype} is not declared: not timed"
