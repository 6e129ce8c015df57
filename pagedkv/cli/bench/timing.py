"""How ``python -m pagedkv bench`` times one call and measures its memory.

CPU: ``torch.utils.benchmark.Timer.blocked_autorange`` (median of blocks) on the calling thread's CPU
clock or wall time, rotating over input sets; CUDA: events around each call with the L2 flushed
before it, small payloads replayed from a CUDA graph. Memory: the peak allocated during one call
beyond what was allocated before. Also the glibc setting that keeps freed outputs mapped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def llc_bytes() -> int:
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
