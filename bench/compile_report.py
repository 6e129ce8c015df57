"""Ahead-of-time compile report of the Triton kernels for sm_80 and sm_90, no GPU needed.

For each configuration the dispatcher can choose (dtype, head dim, GQA group, block size, decode or
prefill, features, split-K decode, the copy kernels), the real launcher runs on tiny CPU tensors with
every kernel replaced by a recorder, so the report compiles exactly what a launch would: the same
constexprs, ``num_warps`` / ``num_stages`` and Triton's own argument specialisation (an int equal to 1
becomes a constant, multiples of 16 and 16-byte-aligned pointers get the divisibility hint). Each
recorded launch is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
and always compiled afresh (``knobs.compilation.always_compile``), so Triton's own run of the ``ptxas``
shipped in its wheel (with ``-v``) writes its log, which gives registers, spill stores / loads and
stack (``knobs.nvidia.dump_ptxas_log``: Triton prints it); Triton's metadata gives the shared memory.
Occupancy is estimated from registers, shared memory and warps with each architecture's per-SM limits.

Compilation runs in worker processes started with ``TRITON_INTERPRET=0`` (the kernels must be
``JITFunction`` objects, not the interpreter's), so the report works in a process that runs the
kernels in the interpreter.

``python -m bench.compile_report [--json PATH] [--arch 80,90] [--level full]``, from the repository's
root (the report is a tool of the repository, not of the wheel), prints the table and
``compile report: <n> configurations, <s> with spills, <e> failed``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
GROUPS = (1, 4, 8, 16)
BLOCK_SIZES = (1, 16, 64, 256, 13)
MODES = ("decode", "prefill")
#: feature sets compiled besides "none" (each flag alone, fp8 pools, everything on)
FEATURE_SETS = (("window",), ("softcap",), ("alibi",), ("sinks",), ("fp8e4m3",), ("fp8e5m2",),
                ("window", "softcap", "alibi", "sinks", "fp8e4m3"))


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one target (CUDA occupancy calculator values)."""

    cc: int
    smem_per_block: int  # opt-in maximum of one block, bytes
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    reserved_smem_per_block: int = 1024


ARCHS = {80: Arch(80, 166912, 167936), 86: Arch(86, 101376, 102400, max_warps_per_sm=48, max_blocks_per_sm=16),
         89: Arch(89, 101376, 102400, max_warps_per_sm=48, max_blocks_per_sm=24),
         90: Arch(90, 232448, 233472), 100: Arch(100, 232448, 233472),
         120: Arch(120, 101376, 102400, max_warps_per_sm=48, max_blocks_per_sm=24)}


@dataclass(frozen=True)
class Case:
    """One configuration: an op the launchers serve and the shapes that select its kernel config."""

    op: str  # decode, prefill, split (decode split across programs + merge), merge, gather, scatter, write_kv
    dtype: str
    head_dim: int
    group: int = 4
    block_size: int = 16
    features: tuple[str, ...] = ()
    head_dim_v: int | None = None  # MLA: one kv head, V = K's first head_dim_v columns, the LSE returned

    @property
    def name(self) -> str:
        feat = "+".join(self.features) or "-"
        dims = f"d{self.head_dim}" + (f"/{self.head_dim_v}" if self.head_dim_v else "")
        return f"{self.op} {self.dtype} {dims} g{self.group} bs{self.block_size} {feat}"


@dataclass
class Row:
    """One compiled kernel of one case on one target."""

    case: str
    kernel: str
    arch: int
    num_warps: int = 0
    num_stages: int = 0
    tile: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0
    occupancy: float = 0.0
    smem_ok: bool = True
    error: str = ""
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


# ---------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------


def matrix(level: str = "default") -> list[Case]:
    """Configurations to compile: ``ci`` (a subset under 2 minutes on 2 cores), ``default`` or ``full``.

    ``full`` is every dtype x head dim x group x block size x {decode, prefill} with features off, plus
    the feature sets, split-K decode and the copy kernels. ``default`` keeps every dtype x head dim x
    mode at group 4 and block size 16 and varies groups and block sizes at head dim 128 (the tile sizes
    depend on dtype, head dim and mode; groups up to 16 share the decode tile and block size only
    changes index arithmetic).
    """
    cases: list[Case] = []
    if level == "full":
        cases += [Case(m, dt, d, g, bs) for dt in DTYPES for d in HEAD_DIMS for g in GROUPS for bs in BLOCK_SIZES
                  for m in MODES]
    elif level == "default":
        cases += [Case(m, dt, d) for dt in DTYPES for d in HEAD_DIMS for m in MODES]
        cases += [Case(m, dt, 128, g) for dt in ("float32", "bfloat16") for g in GROUPS if g != 4 for m in MODES]
        cases += [Case(m, "bfloat16", 128, 4, bs) for bs in BLOCK_SIZES if bs != 16 for m in MODES]
    elif level == "ci":
        cases += [Case(m, dt, d) for dt in ("float32", "bfloat16") for d in (128, 256) for m in MODES]
        cases += [Case("prefill", "float16", 80), Case("decode", "float16", 192, 16, 13),
                  Case("prefill", "bfloat16", 64, 1, 1), Case("decode", "float32", 96, 8, 256)]
    else:
        raise ValueError(f"unknown level {level!r}: ci, default or full")
    feature_dims = (128,) if level == "ci" else (128, 256)
    feature_sets = FEATURE_SETS[-1:] if level == "ci" else FEATURE_SETS
    cases += [Case(m, "bfloat16", d, 4, 16, f) for f in feature_sets for d in feature_dims for m in MODES]
    if level == "ci":
        cases += [Case("decode", "float32", 128, 4, 16, ("fp8e4m3",))]
    split_dtypes = ("bfloat16", "float32") if level == "ci" else DTYPES
    split_dims = (128,) if level == "ci" else HEAD_DIMS
    cases += [Case("split", dt, d, 8) for dt in split_dtypes for d in split_dims]
    if level != "ci":
        cases += [Case("split", "bfloat16", 128, 4, 16, f) for f in FEATURE_SETS[-1:]]
    copy_dims = (128,) if level == "ci" else (64, 128, 256)
    for op in ("gather", "scatter", "write_kv"):
        cases += [Case(op, dt, d) for dt in (("bfloat16",) if level == "ci" else DTYPES) for d in copy_dims]
    cases += [Case("write_kv", "bfloat16", 128, 4, 16, ("fp8e4m3",)), Case("gather", "bfloat16", 128, 4, 1)]
    cases += mla_matrix(level)
    return list(dict.fromkeys(cases))


#: MLA's query heads a kv head (DeepSeek V3: 128; 16 with tensor parallelism 8).
MLA_GROUPS = (16, 32, 64, 128)


def mla_matrix(level: str = "default") -> list[Case]:
    """MLA's latent cache (576 = 512 latent + 64 rope, V its first 512 columns, one kv head, the LSE
    returned), 16 to 128 query heads, decode, prefill and split-K decode, and the merge of two states."""
    if level == "ci":  # the widest tile (128 heads in tiles of 16), split-K, prefill, the merge
        return [Case("decode", "bfloat16", 576, 128, 64, (), 512), Case("split", "bfloat16", 576, 128, 64, (), 512),
                Case("prefill", "bfloat16", 576, 16, 64, (), 512), Case("merge", "bfloat16", 512)]
    cases = [Case(m, dt, 576, g, 64, (), 512) for dt in DTYPES for g in MLA_GROUPS
             for m in ("decode", "prefill", "split")]
    return cases + [Case("merge", dt, 512) for dt in DTYPES] + [Case("merge", "float32", 128)]


# ---------------------------------------------------------------------------------------------------
# Recording launches (worker side: TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, grid, args, kwargs))
        return launch


def record(case: Case) -> list[tuple]:
    """``(JITFunction, grid, args, kwargs)`` of every kernel launch the launcher makes for ``case``."""
    import torch
    from triton.runtime.jit import JITFunction

    from pagedkv.backends.triton import kernels

    launches: list = []
    modules = [m for name, m in sys.modules.items() if name.startswith("pagedkv.backends.triton")]
    saved = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                saved.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launches))
    try:
        _launch(case, kernels, torch)
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
    return launches


def _launch(case: Case, kernels, torch) -> None:
    dtype = getattr(torch, case.dtype)
    hkv, d, bs, g = (1 if case.head_dim_v else 2), case.head_dim, case.block_size, case.group
    fp8 = next((f for f in case.features if f.startswith("fp8")), None)
    pool_dtype = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}.get(fp8, dtype)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.float32).to(pool_dtype)
    v_cache = k_cache[..., : case.head_dim_v] if case.head_dim_v else torch.zeros_like(k_cache)
    table = torch.arange(num_blocks, dtype=torch.int32).reshape(2, -1)
    if case.op in ("decode", "prefill", "split"):
        q_len = 1 if case.op != "prefill" else 130
        seq_lens = torch.tensor([q_len + 3, q_len + 7], dtype=torch.int32)
        qsl = torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)
        query = torch.zeros(2 * q_len, hkv * g, d, dtype=dtype)
        feats = set(case.features)
        kw = dict(window_left=8 if "window" in feats else -1, softcap=30.0 if "softcap" in feats else 0.0,
                  alibi_slopes=torch.ones(hkv * g) if "alibi" in feats else None,
                  sinks=torch.ones(hkv * g) if "sinks" in feats else None)
        if fp8:
            kw.update(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv))
        if case.op == "split":
            kw["num_splits"] = 4
        if case.head_dim_v:
            kw["return_lse"] = True
        kernels.paged_attention(query, k_cache, v_cache, table, seq_lens, qsl, 0.1, q_len, **kw)
    elif case.op == "merge":
        out = torch.zeros(40, 16, d, dtype=dtype)
        lse = torch.zeros(16, 40)
        kernels.merge_attn_states(out, lse, out.clone(), lse.clone())
    elif case.op == "gather":
        kernels.gather(k_cache, table[0], 40)
    elif case.op == "scatter":
        kernels.scatter(k_cache, table[0], torch.zeros(40, hkv, d, dtype=dtype), 3)
    elif case.op == "write_kv":
        key = torch.zeros(40, hkv, d, dtype=dtype)
        scales = dict(k_scale=torch.ones(hkv), v_scale=torch.ones(hkv)) if fp8 else {}
        kernels.write_kv(k_cache, v_cache, key, key.clone(), torch.arange(40), **scales)
    else:
        raise ValueError(f"unknown op {case.op!r}")


def _specialize(fn, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """Signature, constexprs, attrs and options of a launch, as Triton's JIT would derive them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
    params = fn.params
    values = {}
    for i, p in enumerate(params):
        if i < len(args):
            values[p.name] = args[i]
        elif p.name in kwargs:
            values[p.name] = kwargs[p.name]
        else:
            values[p.name] = p.default
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        ty, spec = native_specialize_impl(CUDABackend, v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            signature[p.name] = "constexpr"
            constexprs[p.name] = spec
            continue
        signature[p.name] = ty
        if isinstance(spec, str):
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    return signature, constexprs, attrs, options


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def parse_ptxas(log: str) -> dict:
    """Registers, spill stores / loads and stack frame (bytes) from a ``ptxas -v`` log."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(log)
        out[key] = int(m.group(1)) if m else 0
    return out


def occupancy(arch: Arch, registers: int, shared: int, num_warps: int) -> float:
    """Resident warps / maximum warps of one SM (register file in 4 quadrants, 256-register warp granules)."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    warps_by_regs = 4 * ((arch.regs_per_sm // 4) // regs_per_warp)
    blocks = min(arch.max_blocks_per_sm, arch.max_warps_per_sm // num_warps, warps_by_regs // num_warps)
    if shared:
        blocks = min(blocks, arch.smem_per_sm // (shared + arch.reserved_smem_per_block))
    return round(blocks * num_warps / arch.max_warps_per_sm, 3)


def compile_case(case: Case, archs: tuple[int, ...]) -> list[Row]:
    """Compile every launch of ``case`` for each target (worker side)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        launches = record(case)
    except Exception as exc:  # the launcher itself failed
        return [Row(case.name, "launcher", a, error=f"{type(exc).__name__}: {exc}"[:300]) for a in archs]
    rows = []
    for fn, _grid, args, kwargs in launches:
        for a in archs:
            arch = ARCHS[a]
            kw = dict(kwargs)
            signature, constexprs, attrs, options = _specialize(fn, args, kw)
            tile = "x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_T", "BLOCK_H", "BLOCK_D")
                            if k in constexprs)
            row = Row(case.name, fn.__name__, a, options.get("num_warps", 4), options.get("num_stages", 3), tile)
            t0 = time.perf_counter()
            try:
                ptxas_log = io.StringIO()
                with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope(), \
                        contextlib.redirect_stdout(ptxas_log):
                    triton.knobs.compilation.always_compile = True  # a cached kernel runs no ptxas: no log
                    triton.knobs.nvidia.dump_ptxas_log = True
                    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                              target=GPUTarget("cuda", a, 32), options=options)
                row.shared = int(compiled.metadata.shared)
                for key, value in parse_ptxas(ptxas_log.getvalue()).items():
                    setattr(row, key, value)
                row.smem_ok = row.shared <= arch.smem_per_block
                row.occupancy = occupancy(arch, row.registers, row.shared, row.num_warps)
            except Exception as exc:
                row.error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            row.seconds = round(time.perf_counter() - t0, 2)
            rows.append(row)
    return rows


def _worker() -> None:
    """Read ``{"cases": [...], "archs": [...]}`` on stdin; print one JSON list of rows per case."""
    job = json.loads(sys.stdin.read())
    archs = tuple(job["archs"])
    for c in job["cases"]:
        case = Case(**{**c, "features": tuple(c["features"])})
        print(json.dumps([asdict(r) for r in compile_case(case, archs)]), flush=True)


# ---------------------------------------------------------------------------------------------------
# Running and printing (parent side)
# ---------------------------------------------------------------------------------------------------


def run(cases: list[Case], archs: tuple[int, ...] = (80, 90), workers: int | None = None,
        progress=None) -> list[Row]:
    """Compile ``cases`` for ``archs`` in ``workers`` processes (``TRITON_INTERPRET=0``); rows in case order."""
    workers = max(1, min(workers or min(8, os.cpu_count() or 1), len(cases) or 1))
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    shards = [cases[i::workers] for i in range(workers)]
    by_case: dict[str, list[Row]] = {}
    lock = threading.Lock()

    def drive(shard: list[Case]) -> None:
        # one thread per worker drains its pipe (a worker blocked on a full pipe would stop compiling)
        with tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen([sys.executable, "-m", "bench.compile_report", "--worker"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            p.stdin.write(json.dumps({"cases": [asdict(c) for c in shard], "archs": list(archs)}))
            p.stdin.close()
            lines = iter(p.stdout)
            for case in shard:
                line = next(lines, "")
                try:
                    rows = [Row(**r) for r in json.loads(line)]
                except (json.JSONDecodeError, TypeError):
                    err.seek(0)
                    rows = [Row(case.name, "worker", a, error="worker died: " + err.read()[-300:]) for a in archs]
                with lock:
                    by_case[case.name] = rows
                    if progress:
                        progress(case, rows)
            p.wait()

    threads = [threading.Thread(target=drive, args=(shard,), daemon=True) for shard in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for c in cases for r in by_case.get(c.name, [])]


def format_table(rows: list[Row]) -> str:
    head = ("case", "kernel", "sm", "warps", "stages", "tile", "regs", "spill st/ld", "stack", "smem KiB", "occ",
            "status")
    lines = [head]
    for r in rows:
        status = ("FAILED " + r.error[:60]) if r.error else ("SPILLS" if r.spills else
                                                              ("SMEM>LIMIT" if not r.smem_ok else "ok"))
        lines.append((r.case, r.kernel.lstrip("_").removesuffix("_kernel"), str(r.arch), str(r.num_warps),
                      str(r.num_stages), r.tile, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
                      str(r.stack), f"{r.shared / 1024:.1f}", f"{r.occupancy:.2f}", status))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(x[i].ljust(widths[i]) for i in range(len(head))).rstrip() for x in lines)


def summary(rows: list[Row]) -> str:
    return (f"compile report: {len(rows)} configurations, {sum(r.spills for r in rows)} with spills, "
            f"{sum(bool(r.error) for r in rows)} failed")


def to_json(rows: list[Row], archs: tuple[int, ...], level: str) -> dict:
    import triton

    return {"triton": triton.__version__, "archs": list(archs), "level": level, "summary": summary(rows),
            "over_smem": sum(not r.smem_ok for r in rows), "rows": [asdict(r) for r in rows]}


def main(archs: tuple[int, ...] = (80, 90), level: str = "default", json_path: str | None = None,
         workers: int | None = None) -> int:
    """Print the report for ``level``'s matrix; 1 when any configuration spills, fails or exceeds shared memory."""
    for a in archs:
        if a not in ARCHS:
            print(f"compile report: unknown arch {a}; choose from {sorted(ARCHS)}", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    rows = run(matrix(level), archs, workers)
    print(format_table(rows))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(to_json(rows, archs, level), indent=1) + "\n")
    print(summary(rows))
    return 1 if any(r.spills or r.error or not r.smem_ok for r in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        import argparse

        ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        ap.add_argument("--arch", default="80,90")
        ap.add_argument("--level", choices=("ci", "default", "full"), default="default")
        ap.add_argument("--json")
        ap.add_argument("-j", "--workers", type=int)
        a = ap.parse_args()
        sys.exit(main(tuple(int(x) for x in a.arch.split(",")), a.level, a.json, a.workers))
