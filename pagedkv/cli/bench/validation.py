"""``python -m pagedkv bench --validation-cost``: each built-in op timed at the three validation levels.

``full`` (the default: every check, block ids / slots / lengths read on the host), ``metadata`` (shapes,
dtypes, devices, strides, overlap: no tensor data read, no host synchronisation) and ``none`` (no
checks). One point per op: a sequence of ``seq_len`` tokens (``gather``, ``scatter``, ``write_kv`` of
its whole prefill) and a decode step of ``batch`` sequences of that length (``paged_attention``), on a
pool of scattered blocks. ``torch.utils.benchmark`` medians, the levels interleaved over ``rounds``
rounds and the best median kept (CPU: thread CPU time); the same inputs at each level.
"""

from __future__ import annotations

import time

import torch
import torch.utils.benchmark as benchmark

from pagedkv.backends.contract import OPS
from pagedkv.validation.calls import LEVELS

COLUMNS = ("impl", "op", *(f"{level}_us" for level in LEVELS), "saved_us")


def _inputs(device, dtype, seq_len, block_size, heads, dim, batch, gen):
    blocks = -(-seq_len // block_size)
    num_blocks = 2 * blocks * batch
    pool = lambda: torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(device, dtype)
    k, v = pool(), pool()
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: batch * blocks].view(batch, blocks).to(device, torch.int32)
    table = tables[0]
    slots = (table.to(torch.int64).repeat_interleave(block_size) * block_size
             + torch.arange(block_size, device=device).repeat(blocks))[:seq_len]
    rows = lambda n: torch.randn(n, heads, dim, generator=gen).to(device, dtype)
    return dict(
        gather=(k, table, seq_len),
        scatter=(k, table, rows(seq_len), 0),
        write_kv=(k, v, rows(seq_len), rows(seq_len), slots),
        paged_attention=(torch.randn(batch, 4 * heads, dim, generator=gen).to(device, dtype), k, v, tables,
                         torch.full((batch,), seq_len, dtype=torch.int32, device=device),
                         torch.arange(batch + 1, dtype=torch.int32, device=device), None))


def validation_cost(backends: dict, device: torch.device, *, seq_len: int = 512, block_size: int = 16,
                    heads: int = 8, dim: int = 128, dtype: torch.dtype = torch.float32, batch: int = 4,
                    min_time: float = 0.1, rounds: int = 3, seed: int = 0) -> list[dict]:
    """Rows ``{impl, op, full_us, metadata_us, none_us, saved_us}`` (``saved_us``: full minus metadata).

    Args:
        backends: ``{name: backend}`` of backends whose ops take ``validate`` (pagedkv's own).
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(device, dtype, seq_len, block_size, heads, dim, batch, gen)
    # CPU: the thread's CPU time (other processes on the cores do not count); CUDA: wall time, synchronised
    clock = {"timer": time.thread_time} if device.type == "cpu" else {}
    rows = []
    for impl, backend in backends.items():
        for op in OPS:
            fn, args = getattr(backend, op), inputs[op]
            times = {level: float("inf") for level in LEVELS}
            for level in LEVELS:
                fn(*args, level)  # warm-up (and the first call's lazy set-up)
            for _ in range(rounds):  # levels interleaved, best median of the rounds: less drift from the load
                for level in LEVELS:
                    timer = benchmark.Timer("fn(*args, level)", globals=dict(fn=fn, args=args, level=level), **clock)
                    times[level] = min(times[level], timer.blocked_autorange(min_run_time=min_time).median * 1e6)
            rows.append(dict(impl=impl, op=op, **{f"{lv}_us": round(t, 1) for lv, t in times.items()},
                             saved_us=round(times["full"] - times["metadata"], 1)))
    return rows


def format_validation_cost(rows: list[dict], note: str = "") -> str:
    """A plain-text table of :func:`validation_cost`'s rows."""
    lines = [f"validation cost per call (us, median){note}", "  ".join(f"{c:>15}" for c in COLUMNS)]
    lines += ["  ".join(f"{r[c]:>15}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)
