"""The output and input contract of every op call, and judging a case twice: what a candidate cannot fake.

:class:`GuardedBackend` stands between a property and the candidate. Every call of ``paged_attention``,
``paged_attention_csr``, ``write_kv``, ``gather`` and ``scatter`` is checked, whatever the property:

- **the output**: exactly ``torch.Tensor`` (``type(out) is torch.Tensor``: a subclass could answer
  comparisons from anything but its memory), of the contract's dtype, device and shape, sharing no
  memory with any input or with an earlier output still alive. It is inspected with torch-function
  dispatch off (:class:`torch._C.DisableTorchFunction`).
- **the inputs**: every tensor an op must not write (the query, both pools *including* slots no
  sequence owns, block tables including their padding, lengths, CSR metadata, scales; for ``write_kv``
  and ``scatter`` everything but the pools they write) is unchanged bit for bit afterwards. Which pool
  slots a write may change is the frame condition the data-movement properties check already.
- **fresh memory**: the call runs under ``torch.use_deterministic_algorithms(True, warn_only=True)``
  with :data:`torch.utils.deterministic.fill_uninitialized_memory` on, so ``torch.empty`` is filled
  (NaN for floating types) and an output row the candidate never writes cannot hold a previous answer.
- **threads and streams**: no thread the call started is alive when it returns; on CUDA every stream
  is synchronised (:func:`torch.cuda.synchronize`) before anything is read.

:meth:`GuardedBackend.judge_again` reruns the first calls a check made: on the same tensors holding
other values of the same shapes (another case), then holding the case's values again, and requires the
first run's bits; the call on other values must not return the first call's bits either. A candidate
that caches by shape or by data pointer, returns a stale buffer, skips work it has "seen", counts its
calls, or is nondeterministic, answers differently.

Calls whose inputs hold more than :data:`MAX_SNAPSHOT_BYTES` (the lazily backed pools of the limit
cases) are not snapshotted, filled or rerun: copying them would commit memory those cases never touch,
and deterministic index kernels on them would allocate as much again.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.testing.compare import Mismatch, bits

#: The ops whose calls are guarded.
GUARDED_OPS = ("paged_attention", "paged_attention_csr", "write_kv", "gather", "scatter", "merge_attn_states")
#: The positional arguments each op may write (the pools); every other tensor argument must be unchanged.
WRITES = {"write_kv": (0, 1), "scatter": (0,)}
#: Argument names of the positional arguments (for messages).
ARG_NAMES = {
    "paged_attention": ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "scale"),
    "paged_attention_csr": ("query", "k_cache", "v_cache", "kv_indptr", "kv_indices", "kv_last_page_len",
                            "query_start_loc", "scale"),
    "write_kv": ("k_cache", "v_cache", "key", "value", "slot_mapping"),
    "gather": ("cache", "block_table", "seq_len"),
    "scatter": ("cache", "block_table", "values", "start"),
    "merge_attn_states": ("prefix_out", "prefix_lse", "suffix_out", "suffix_lse"),
}
#: Ops that return ``(out, lse)``: ``merge_attn_states`` always, ``paged_attention`` with ``return_lse=True``.
PAIR_OPS = ("merge_attn_states",)
#: The arguments that hold data (not scales, sinks or slopes): another case of the same shapes has other values there.
DATA_ARGS = ("query", "k_cache", "v_cache", "key", "value", "cache", "values")
#: Largest total of input storage bytes a call is snapshotted and rerun for (64 MiB).
MAX_SNAPSHOT_BYTES = 64 << 20
#: How many calls of one check :func:`judge_again` reruns (the first ones: a property's main call).
RERUN_CALLS = 2


class ContractViolation(Mismatch):
    """An op call broke the output or input contract (see the module docstring)."""


@dataclass
class _Call:
    op: str
    args: tuple
    kwargs: dict
    before: dict  # id(storage) -> (storage copy) of every input storage, taken before the call
    output: Any = None
    output_bits: Any = None  # the output's bits when it was returned
    after: dict = field(default_factory=dict)  # tensor argument index -> a written pool's bits after the call


def _tensors(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor argument (a list argument of tensors counts each)."""
    found = []
    for name, value in list(zip(_names(len(args)), args)) + list(kwargs.items()):
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, (list, tuple)):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return found


def _names(n: int) -> list[str]:
    return [f"argument {i}" for i in range(n)]


def _named(op: str, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    names = ARG_NAMES.get(op, ())
    out = []
    for name, t in _tensors(args, kwargs):
        if name.startswith("argument "):
            i = int(name.split()[1].split("[")[0])
            name = names[i] if i < len(names) else name
        out.append((name, t))
    return out


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device.type, s.device.index, s.data_ptr(), s.nbytes())


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of ``t``'s elements in memory (empty for an empty tensor)."""
    if t.numel() == 0:
        return (0, 0)
    lo = t.data_ptr()
    hi = lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    return (lo, hi)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (alo, ahi), (blo, bhi) = _span(a), _span(b)
    return alo < bhi and blo < ahi


def _storage_bytes(tensors) -> int:
    """Bytes a copy of ``tensors`` would take: their storages, or their elements where more (a view whose
    strides repeat memory, as the aliased large pools do, copies to far more than its storage)."""
    seen = {}
    for _, t in tensors:
        seen[_storage_key(t)] = max(t.untyped_storage().nbytes(), t.numel() * t.element_size())
    return sum(seen.values())


def _slot_of(t: torch.Tensor, index: list[int], name: str) -> str:
    """``index`` of a tensor argument in words (a pool's block and slot)."""
    if "cache" in name and t.dim() == 4:
        return f"block {index[0]}, index {index[1:]}"
    return f"index {index}"


def _fill_fresh_memory():
    """A context under which ``torch.empty`` memory is filled (NaN for floating dtypes)."""
    return _FreshMemoryFilled()


def _use_deterministic_algorithms(mode: bool, *, warn_only: bool) -> None:
    """:func:`torch.use_deterministic_algorithms`, without importing inductor to get there: the public call
    imports ``torch._inductor`` (and with it ``torch._dynamo``, about 1.8 s in a fresh process: every replay
    and every gate run paid it) only to set inductor's ``deterministic`` flag, which nothing reads until
    inductor is loaded. Once it is, the public call."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


class _FreshMemoryFilled:
    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        self.fill = torch.utils.deterministic.fill_uninitialized_memory
        _use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
        return self

    def __exit__(self, *exc):
        self.warnings.__exit__(*exc)
        torch.utils.deterministic.fill_uninitialized_memory = self.fill
        _use_deterministic_algorithms(self.was[0], warn_only=self.was[1])
        return False


def _synchronize(tensors) -> None:
    if any(t.device.type == "cuda" for _, t in tensors) and torch.cuda.is_available():
        torch.cuda.synchronize()


class GuardedBackend:
    """``backend`` with every call of its ops checked against the output and input contract (module
    docstring); other attributes are the backend's own.

    Args:
        backend: the candidate (the object the user declared, before any layout adapter).
    """

    def __init__(self, backend: Any):
        self._backend = backend
        self._calls: list[_Call] = []
        self._outputs: list = []  # weak references to outputs returned so far

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._backend, name)
        if name in GUARDED_OPS and callable(value):
            guarded = functools.wraps(value)(functools.partial(self._guarded_call, name, value))
            object.__setattr__(self, name, guarded)
            return guarded
        return value

    @property
    def guarded(self) -> Any:
        """The backend under the guard."""
        return self._backend

    def _guarded_call(self, op: str, fn: Any, *args, **kwargs) -> Any:
        __tracebackhide__ = True
        tensors = _named(op, args, kwargs)
        small = _storage_bytes(tensors) <= MAX_SNAPSHOT_BYTES
        before = {name: t.clone() for name, t in tensors} if small else {}
        threads = set(threading.enumerate())
        with _fill_fresh_memory() if small else contextlib.nullcontext():
            out = fn(*args, **kwargs)
        _synchronize(tensors)
        started = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        if started:
            for t in started:  # let them end, so the failure leaves no work running behind it
                t.join(timeout=30)
            raise ContractViolation(f"{op} returned while a thread it started is still running "
                                    f"({', '.join(t.name for t in started)}): its result may not be written yet")
        with torch._C.DisableTorchFunction():
            self._check_output(op, out, tensors)
            self._check_inputs(op, tensors, before)
        aliased = any(_overlaps(a, b) for i, (_, a) in enumerate(tensors) for _, b in tensors[i + 1:])
        if small and not aliased and len(self._calls) < RERUN_CALLS:  # aliased pools: copies would not alias
            written = {i: bits(tensors[i][1]).clone() for i in WRITES.get(op, ()) if i < len(tensors)}
            kept = _first(out)
            self._calls.append(_Call(op, args, kwargs, before, kept, bits(kept).clone() if kept is not None else None,
                                     written))
        return out

    def _check_output(self, op: str, out: Any, tensors: list, pair: bool = False) -> None:
        if op in WRITES:
            return
        if isinstance(out, tuple) and not pair:
            if len(out) != 2:
                raise ContractViolation(f"{op} returned a tuple of {len(out)}, expected (out, lse)")
            self._check_output(op, out[0], tensors, True)
            self._check_output(op, out[1], tensors, True)
            return
        if not isinstance(out, torch.Tensor):
            raise ContractViolation(f"{op} returned {type(out).__name__}, not a torch.Tensor")
        if type(out) is not torch.Tensor:
            raise ContractViolation(f"{op}: output is a torch.Tensor subclass {type(out).__name__} (a subclass can "
                                    f"answer comparisons from anything but its memory; return a plain torch.Tensor)")
        first = tensors[0][1] if tensors else None
        if pair and out.dtype == torch.float32 and out.dim() == 2:
            want = (None, torch.float32, first.device if first is not None else None)  # an LSE
        elif op.startswith("paged_attention") and first is not None:
            v_dim = tensors[2][1].shape[-1] if len(tensors) > 2 and tensors[2][1].dim() == 4 else first.shape[-1]
            if len(tensors) > 2 and tensors[1][1].dim() == 4 and v_dim == tensors[1][1].shape[-1]:
                v_dim = first.shape[-1]  # V as wide as K: the query's width (whatever the pools' layout)
            want = ((*first.shape[:2], v_dim), first.dtype, first.device)
        elif op == "merge_attn_states" and first is not None:
            want = (tuple(first.shape), first.dtype, first.device)
        elif op == "gather" and first is not None:
            want = (None, first.dtype, first.device)  # the shape depends on the declared layout; checked by gather
        else:
            want = (None, None, None)
        shape, dtype, device = want
        if shape is not None and tuple(out.shape) != shape:
            raise ContractViolation(f"{op}: output shape {tuple(out.shape)}, the contract's is {shape} (query's)")
        if dtype is not None and out.dtype != dtype:
            raise ContractViolation(f"{op}: output dtype {out.dtype}, the contract's is {dtype}")
        if device is not None and out.device != device:
            raise ContractViolation(f"{op}: output on {out.device}, the contract's device is {device}")
        for name, t in tensors:
            if _overlaps(out, t):
                raise ContractViolation(f"{op}: output shares memory with its input {name}")
        alive = []
        for ref in self._outputs:
            prev = ref()
            if prev is None:
                continue
            alive.append(ref)
            if _overlaps(out, prev):
                raise ContractViolation(f"{op}: output shares memory with an earlier output the suite still holds "
                                        f"(a reused buffer: the earlier result changes under its holder)")
        import weakref

        self._outputs = alive + [weakref.ref(out)]

    def _check_inputs(self, op: str, tensors: list, before: dict) -> None:
        if not before:
            return
        writable = {tensors[i][0] for i in WRITES.get(op, ()) if i < len(tensors)}
        written = [t for name, t in tensors if name in writable]
        for name, t in tensors:
            if name in writable or any(_overlaps(t, w) for w in written):
                continue  # a pool the op writes (its frame condition is a property of its own)
            old = before[name]
            if t.shape != old.shape or not torch.equal(bits(t.detach()), bits(old)):
                if t.shape != old.shape:
                    raise ContractViolation(f"{op} changed the shape of its input {name}")
                diff = (bits(t.detach()) != bits(old)).nonzero()
                where = [int(x) for x in diff[0]]
                what = _slot_of(t, where, name)
                raise ContractViolation(f"{op} wrote its input {name} at {what} ({diff.shape[0]} elements changed; "
                                        f"it must leave {name} unchanged bit for bit, padding and unused slots "
                                        f"included)")

    def judge_again(self, seed: int = 0) -> None:
        """Judge the first calls of the check again: each call once more on the same tensors holding other
        values of the same shapes (another case), then on the same tensors holding the case's values again,
        requiring the first run's bits (output and written pools). The same tensors, so a cache keyed by
        data pointer meets its key again; the tensors keep the first run's state afterwards.

        Raises:
            ContractViolation: the second run differs from the first, an output the suite holds changed, or
                a call on other values returned the first call's bits.
        """
        __tracebackhide__ = True
        calls, self._calls = self._calls, []
        for n, c in enumerate(calls):
            fn = getattr(self._backend, c.op)
            named = _named(c.op, c.args, c.kwargs)
            gen = torch.Generator().manual_seed(seed + 1 + n)
            changed = []
            for name, t in named:
                if name in DATA_ARGS and t.is_floating_point() and t.dtype.itemsize >= 2:
                    t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
                    changed.append(name)
                else:
                    t.copy_(c.before[name])
            every = bool(changed) and all(name in changed for name, _ in named if name in DATA_ARGS)
            out_other = _first(self._plain_call(fn, c, named))
            if c.output is not None and not torch.equal(bits(c.output), c.output_bits):
                raise ContractViolation(f"{c.op}: an output the suite still holds changed when {c.op} ran again on "
                                        f"other inputs of the same shapes (the output is a reused buffer)")
            if every and c.output is not None and c.output.numel() and isinstance(out_other, torch.Tensor) and \
                    out_other.shape == c.output.shape and torch.equal(bits(out_other), c.output_bits):
                raise ContractViolation(f"{c.op} returned the same bits for other {'/'.join(changed)} values of the "
                                        f"same shapes in the same tensors: the result does not depend on them (a "
                                        f"result cached by shape or data pointer)")
            del out_other
            for name, t in named:
                t.copy_(c.before[name])
            out = _first(self._plain_call(fn, c, named))
            with torch._C.DisableTorchFunction():
                if c.output is not None and (not isinstance(out, torch.Tensor) or out.shape != c.output.shape
                                             or not torch.equal(bits(out), c.output_bits)):
                    raise ContractViolation(_again_message(c.op, out, c.output_bits))
                for i, first in c.after.items():
                    if not torch.equal(bits(named[i][1]), first):
                        raise ContractViolation(f"{c.op} judged twice: {named[i][0]} after the second run on the "
                                                f"same inputs differs from the first (after another call of the same "
                                                f"shapes in between): the result depends on earlier calls (a write "
                                                f"skipped by data pointer, a call count) or is nondeterministic")

    def _plain_call(self, fn: Any, c: _Call, named: list) -> Any:
        """``fn`` on the recorded arguments, memory filled, streams synchronised, threads ended."""
        threads = set(threading.enumerate())
        with _fill_fresh_memory():
            out = fn(*c.args, **c.kwargs)
        _synchronize(named)
        for t in threading.enumerate():
            if t not in threads and t.is_alive():
                t.join(timeout=30)
        return out


def _first(out: Any) -> Any:
    """The output tensor of a call: ``out`` itself, or the first of ``(out, lse)``; ``None`` otherwise."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out if isinstance(out, torch.Tensor) else None


def _again_message(op: str, out: Any, first: torch.Tensor) -> str:
    """``first``: the bits of the first run's output."""
    where = ""
    if isinstance(out, torch.Tensor) and out.shape == first.shape:
        diff = (bits(out) != first).nonzero()
        if diff.numel():
            where = f" at index {[int(x) for x in diff[0]]} ({diff.shape[0]} elements differ)"
    return (f"{op} judged twice: on the same inputs again, after a call on other values of the same shapes, "
            f"the output differs from the first run{where}: the result depends on earlier calls (a cache by shape or "
            f"data pointer, a stale buffer, a call count) or is nondeterministic")
