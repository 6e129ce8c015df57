"""What ``python -m pagedkv bench`` reports: the limits table, the text tables, the result files, the plot.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable

import torch

from pagedkv.cli.bench.sweep import CSV_COLUMNS, DATA_OPS, IMPLS, OPS, Row, _dtype
from pagedkv.cli.bench.timing import llc_bytes


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
    informational: bool = False  # reported, never fails ``--check``



def _point(r) -> tuple:
    """A row's sweep point: ``(preset, dtype, block_size, seq_len)``."""
    return (r.preset, r.dtype, r.block_size, r.seq_len)

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
    return Verdict(target, v, limit, sense, passed, where, n, "[informational]" in target)


def failed(verdicts: list[Verdict]) -> list[Verdict]:
    """The targets that fail (informational ones and targets without points never do)."""
    return [v for v in verdicts if v.passed is False and not v.informational]


def candidates(rows: list[Row]) -> list[str]:
    """Impls in ``rows`` that are neither built-in nor a bound: candidates loaded from a spec."""
    known = {impl for impls in IMPLS.values() for impl in impls} | {"copy", "clone"}
    return sorted({r.impl for r in rows} - known)


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
        loop_t = {_point(r): r.time_s for r in sel("gather", "loop")}
        # below 512 tokens at block sizes >= 64 both run the same one-slice torch.cat: a coin toss
        for target, lens in (("L >= 512", lambda L: L >= 512), ("whole sweep [informational]", lambda L: True)):
            out.append(_verdict(f"gather (indexed) / gather (loop), {target}",
                                [r for r in sel("gather", "indexed", seq_len=lens) if _point(r) in loop_t],
                                lambda r, loop_t=loop_t: r.time_s / loop_t[_point(r)], 1.0, "<="))
        for op in ("scatter", "write_kv"):
            out.append(_verdict(f"{op} (indexed) / copy bound, L >= 4096",
                                sel(op, "indexed", seq_len=lambda L: L >= 4096), lambda r: r.x_copy, 2.0, "<="))
            loop_t = {_point(r): r.time_s for r in sel(op, "loop")}
            out.append(_verdict(f"{op} (indexed) / {op} (loop), whole sweep [informational]",
                                [r for r in sel(op, "indexed") if _point(r) in loop_t],
                                lambda r, loop_t=loop_t: r.time_s / loop_t[_point(r)], 1.0, "<="))
    else:
        out.append(_verdict("gather (indexed) % copy bandwidth, bs >= 16, L >= 4096",
                            sel("gather", "indexed", block_size=lambda b: b >= 16, seq_len=lambda L: L >= 4096),
                            lambda r: r.pct_copy_bw, 90.0, ">="))
        out.append(_verdict("gather (indexed) % copy bandwidth, bs = 1, L >= 4096",
                            sel("gather", "indexed", block_size=lambda b: b == 1, seq_len=lambda L: L >= 4096),
                            lambda r: r.pct_copy_bw, 80.0, ">="))
        for impl in ("indexed", "triton"):
            out.append(_verdict(f"write_kv ({impl}) % copy bandwidth, L >= 4096",
                                sel("write_kv", impl, seq_len=lambda L: L >= 4096), lambda r: r.pct_copy_bw,
                                50.0, ">="))
        for tokens, pct in ((64 * 1024, 80.0), (256 * 1024, 90.0)):
            out.append(_verdict(f"fused decode attention (triton) % copy bandwidth, batch x context >= "
                                f"{tokens // 1024}k", sel("attention", "triton", seq_len=lambda L: True),
                                lambda r, tokens=tokens: r.pct_copy_bw if r.batch * r.seq_len >= tokens else None,
                                pct, ">="))
        sdpa = {(*_point(r), r.batch): r.time_s for r in sel("attention", "indexed+sdpa")}
        out.append(_verdict("fused decode (triton) / gather-then-SDPA time, batch x context >= 16k",
                            [r for r in sel("attention", "triton") if r.batch * r.seq_len >= 16 * 1024
                             and (*_point(r), r.batch) in sdpa],
                            lambda r: r.time_s / sdpa[(*_point(r), r.batch)], 1.0, "<="))
    for impl in candidates(rows):  # a candidate meets the copy-bound targets of the indexed backend
        if device.type == "cpu":
            out.append(_verdict(f"gather ({impl}) / copy bound, L >= 512, every block size",
                                sel("gather", impl, seq_len=lambda L: L >= 512), lambda r: r.x_copy, 1.25, "<="))
            for op in ("scatter", "write_kv"):
                out.append(_verdict(f"{op} ({impl}) / copy bound, L >= 4096",
                                    sel(op, impl, seq_len=lambda L: L >= 4096), lambda r: r.x_copy, 2.0, "<="))
        else:
            out.append(_verdict(f"gather ({impl}) % copy bandwidth, bs >= 16, L >= 4096",
                                sel("gather", impl, block_size=lambda b: b >= 16, seq_len=lambda L: L >= 4096),
                                lambda r: r.pct_copy_bw, 90.0, ">="))
            out.append(_verdict(f"write_kv ({impl}) % copy bandwidth, L >= 4096",
                                sel("write_kv", impl, seq_len=lambda L: L >= 4096), lambda r: r.pct_copy_bw,
                                50.0, ">="))
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
            for impl in ("copy", "clone") + IMPLS[op] + tuple(candidates(rows)):
                pts = sorted((r.seq_len, r.x_copy) for r in rows
                             if r.op == op and r.block_size == bs and r.impl == impl)
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


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(device: torch.device, threads: int, mem_method: str) -> dict:
    """Versions, device and settings recorded with the results."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
           "device": str(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
           "requested_threads": threads, "cpu_count": os.cpu_count(), "llc_bytes": llc_bytes(),
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
