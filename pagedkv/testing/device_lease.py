"""A device-memory budget shared by every xdist worker of one pytest run: tests that need large device
allocations take a *lease* from it, and wait for one instead of skipping.

Sixteen workers on one GPU read the same free memory and allocate at once: without a shared budget they
run out of memory or skip at random, and coverage depends on scheduling. Here the workers share one
ledger under the run's shared temporary directory (the controller's ``basetemp``, the parent of each
worker's), guarded by a lock file (:mod:`filelock`):

- ``state.json``: the budget in bytes and the leases now held (``{id: [bytes, pid, holder]}``);
- ``ledger.jsonl``: one line per grant and release (time, holder, bytes, bytes in use after, seconds waited).

The budget is the declared one (``--pagedkv-device-memory``, ini ``pagedkv_device_memory`` or
``$PAGEDKV_DEVICE_MEMORY``, e.g. ``141GiB``; a *simulated* budget on the CPU, where the pools are
lazily backed), else the device's total memory less a headroom (``pagedkv_device_headroom``, default
:data:`DEFAULT_HEADROOM`). A lease larger than the whole budget is a usage error
(:class:`LeaseTooLarge`), never a wait that cannot end. Leases of a worker that died are reclaimed.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

from pagedkv.units import parse_bytes  # noqa: F401 - the one rule for sizes (re-exported: its callers)

#: What a device keeps free of leases when no budget is declared (the CUDA context of each worker,
#: the allocator's cache, the small tensors of every other test).
DEFAULT_HEADROOM = 16 * 2**30
#: How often a waiting test looks at the ledger again, in seconds.
POLL_S = 0.05


class LeaseTooLarge(ValueError):
    """A lease larger than the whole budget: it could never be granted."""


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB (MiB under one GiB), for reports."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class Grant:
    """One lease held: its bytes and the seconds its test waited for it."""

    nbytes: int
    waited_s: float


class DeviceMemoryBudget:
    """The shared budget of one run (see the module docstring).

    Args:
        directory: the run's shared directory (created; every worker passes the same one).
        total_bytes: the budget; the first worker to open the ledger writes it, later ones check it.
        declared: the budget was declared (a simulation or an operator's choice), not read from the device.
    """

    def __init__(self, directory: Path, total_bytes: int, *, declared: bool = True):
        from filelock import FileLock

        if total_bytes <= 0:
            raise ValueError(f"device memory budget: {total_bytes} bytes; it must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.total_bytes = int(total_bytes)
        self.declared = declared
        self._lock = FileLock(str(self.directory / "ledger.lock"))
        self._state_path = self.directory / "state.json"
        self.ledger_path = self.directory / "ledger.jsonl"
        with self._lock:
            if not self._state_path.exists():
                self._write({"total_bytes": self.total_bytes, "leases": {}})

    def _read(self) -> dict:
        return json.loads(self._state_path.read_text())

    def _write(self, state: dict) -> None:
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state_path)

    def _log(self, **entry) -> None:
        with self.ledger_path.open("a") as f:
            f.write(json.dumps({"t": time.time(), **entry}) + "\n")

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _try_take(self, lease_id: str, nbytes: int, holder: str, waited_s: float) -> bool:
        with self._lock:
            state = self._read()
            dead = [k for k, (_, pid, _) in state["leases"].items() if not self._alive(pid)]
            for k in dead:  # a worker that crashed holding a lease: its memory went with it
                self._log(event="reclaim", holder=state["leases"][k][2], bytes=state["leases"][k][0])
                del state["leases"][k]
            in_use = sum(b for b, _, _ in state["leases"].values())
            if in_use + nbytes > state["total_bytes"]:
                if dead:
                    self._write(state)
                return False
            state["leases"][lease_id] = [nbytes, os.getpid(), holder]
            self._write(state)
            self._log(event="grant", holder=holder, bytes=nbytes, in_use=in_use + nbytes,
                      total=state["total_bytes"], waited_s=round(waited_s, 4), pid=os.getpid())
            return True

    def _release(self, lease_id: str) -> None:
        with self._lock:
            state = self._read()
            nbytes, _, holder = state["leases"].pop(lease_id)
            self._write(state)
            in_use = sum(b for b, _, _ in state["leases"].values())
            self._log(event="release", holder=holder, bytes=nbytes, in_use=in_use, pid=os.getpid())

    @contextmanager
    def lease(self, nbytes: int, holder: str) -> Iterator[Grant]:
        """Hold ``nbytes`` of the budget for the ``with`` block, waiting (polling every :data:`POLL_S`)
        until the other workers' leases leave room.

        Raises:
            LeaseTooLarge: ``nbytes`` exceeds the whole budget (no wait could end).
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"lease of {nbytes} bytes for {holder}: must be >= 0")
        if nbytes > self.total_bytes:
            source = ("the declared budget (--pagedkv-device-memory / pagedkv_device_memory / "
                      "$PAGEDKV_DEVICE_MEMORY)" if self.declared else "the device's memory less the headroom")
            raise LeaseTooLarge(f"{holder} needs {format_bytes(nbytes)} of device memory, more than the whole of "
                                f"{source}, {format_bytes(self.total_bytes)}: it can never run")
        lease_id, start = uuid.uuid4().hex, time.monotonic()
        while not self._try_take(lease_id, nbytes, holder, time.monotonic() - start):
            time.sleep(POLL_S)
        try:
            yield Grant(nbytes, time.monotonic() - start)
        finally:
            self._release(lease_id)


def read_ledger(path: Path) -> list[dict]:
    """The ledger's entries in the order they were written (``[]`` when there is none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ledger_summary(entries: list[dict]) -> dict:
    """Leases granted, the peak bytes in use, the budget, the seconds waited in all and the longest wait
    (holder and seconds) of a ledger's entries."""
    grants = [e for e in entries if e["event"] == "grant"]
    longest = max(grants, key=lambda e: e["waited_s"], default=None)
    return {"leases": len(grants), "peak_bytes": max((e["in_use"] for e in grants), default=0),
            "total_bytes": max((e["total"] for e in grants), default=0),
            "waited_s": sum(e["waited_s"] for e in grants), "waiting": sum(e["waited_s"] > POLL_S / 2 for e in grants),
            "longest": (longest["holder"], longest["waited_s"]) if longest else None}


def summary_line(directory: Path) -> str | None:
    """The terminal summary's line about the run's leases, or ``None`` when no test took one."""
    s = ledger_summary(read_ledger(Path(directory) / "ledger.jsonl"))
    if not s["leases"]:
        return None
    longest = f"; longest {s['longest'][1]:.1f} s ({s['longest'][0]})" if s["waiting"] else ""
    return (f"pagedkv device memory: {s['leases']} leases of a {format_bytes(s['total_bytes'])} budget, peak "
            f"{format_bytes(s['peak_bytes'])} in use; {s['waiting']} tests waited {s['waited_s']:.1f} s in all"
            f"{longest}")


# -- the budget of this process (set by the pytest plugin; read by the properties that allocate) --------

_BUDGET: DeviceMemoryBudget | None = None


def configure(budget: DeviceMemoryBudget | None) -> None:
    """Make ``budget`` the one :func:`hold` leases from (``None``: none)."""
    global _BUDGET
    _BUDGET = budget


def current() -> DeviceMemoryBudget | None:
    """The budget :func:`configure` set, or ``None``."""
    return _BUDGET


def shared_directory(config: Any, name: str = "pagedkv-device-memory") -> Path:
    """A directory every process of a pytest run shares (the ledger's by default): under the controller's
    ``basetemp``, which is the parent of every xdist worker's (``popen-gwN``)."""
    base = config._tmp_path_factory.getbasetemp()
    return (base.parent if hasattr(config, "workerinput") else base) / name


def budget_for(directory: Path, declared: str | int | None, device: str, headroom: str | int | None = None
               ) -> DeviceMemoryBudget | None:
    """The budget of a run: ``declared`` (bytes or a size string) when given, else on a CUDA ``device`` its
    total memory less ``headroom`` (default :data:`DEFAULT_HEADROOM`), else ``None`` (a CPU needs none:
    its large pools are lazily backed).

    Raises:
        ValueError: a malformed size, or a headroom that leaves nothing.
    """
    if declared not in (None, ""):
        return DeviceMemoryBudget(directory, parse_bytes(declared, "pagedkv_device_memory"), declared=True)
    if not str(device).startswith("cuda"):
        return None
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    spare = parse_bytes(headroom, "pagedkv_device_headroom") if headroom not in (None, "") else DEFAULT_HEADROOM
    if total - spare <= 0:
        raise ValueError(f"pagedkv_device_headroom {format_bytes(spare)} leaves nothing of the device's "
                         f"{format_bytes(total)}")
    return DeviceMemoryBudget(directory, total - spare, declared=False)


@contextmanager
def hold(nbytes: int, holder: str, device: str) -> Iterator[Grant | None]:
    """Lease ``nbytes`` from this process's budget for the ``with`` block when one is configured and the
    allocation is real memory there (any CUDA device; the CPU only under a declared, simulated budget);
    otherwise a no-op yielding ``None``.

    Raises:
        LeaseTooLarge: more than the whole budget (a usage error).
    """
    budget = current()
    if budget is None or not (str(device).startswith("cuda") or budget.declared):
        yield None
        return
    with budget.lease(nbytes, holder) as grant:
        yield grant


def leased(bytes_of: Callable[[Any], int]):
    """Decorate a check ``check(backend, case, device)`` to run holding a lease of ``bytes_of(case)`` bytes
    (:func:`hold`), named after the running pytest test.

    On a device whose whole memory (less the headroom) cannot hold them the check is skipped with the
    reason (:class:`~pagedkv.testing.compare.MissingOp`); a *declared* budget that small is a usage error
    (:class:`LeaseTooLarge` propagates)."""
    def decorate(check):
        @functools.wraps(check)
        def run(backend: Any, case: Any, device: str = "cpu") -> None:
            holder = os.environ.get("PYTEST_CURRENT_TEST", check.__name__).split(" ")[0]
            try:
                with hold(bytes_of(case), holder, device):
                    return check(backend, case, device)
            except LeaseTooLarge as exc:
                if current() is not None and current().declared:
                    raise
                from pagedkv.testing.compare import MissingOp

                raise MissingOp(f"the device cannot hold this check's pools: {exc}") from None
        run.leased_bytes = bytes_of  # read by the plan (pagedkv.tools.plan)
        return run
    return decorate
