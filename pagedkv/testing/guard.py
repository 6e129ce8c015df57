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
- **threads and streams**: every CUDA device the call's tensors (and its output) are on is synchronised
  (:func:`torch.cuda.synchronize` of that device) before anything is read. A thread the call started
  may outlive it (a pool of workers the kernel creates on first use and keeps) as long as it writes
  nothing once the call has returned: the output and every tensor argument are read when the call
  returns and again :data:`SETTLE_S` later (or when those threads end, if sooner); a difference is a
  violation (the result was still being written), idle workers are not. Only a call that started
  threads pays the wait.

:meth:`GuardedBackend.judge_again` reruns the first calls a check made: on the same tensors holding
other values of the same shapes (another case), then holding the case's values again, and requires the
first run's bits; the call on other values must not return the first call's bits either. A candidate
that caches by shape or by data pointer, returns a stale buffer, skips work it has "seen", counts its
calls, or is nondeterministic, answers differently. A kernel that is nondeterministic by design (atomics
in a split reduction) declares it, ``Capabilities(nondeterminism_ulp=N)``: its rerun's output may then
differ from the first run's by up to ``N`` ulps of the scale of the values the output sums (the largest
finite ``|V|`` or ``|output|``; :func:`pagedkv.testing.compare.rerun_differs`), at most the output dtype's
cap (:data:`pagedkv.backends.capabilities.NONDETERMINISM_ULP_CAP`); NaN and infinities exactly where the
first run had them. The reference comparisons of the properties keep their usual bar, and written pools
are still compared bit for bit.

Calls whose inputs hold more than :data:`MAX_SNAPSHOT_BYTES` in all are not copied, filled or rerun
(copies would commit memory the large-pool cases never touch, and deterministic index kernels on them
would allocate as much again): their inputs are checked unchanged by a digest of each storage instead
(:func:`storage_digest`, chunked weighted sums: any change of one word changes its chunk's sum; the
chunk says where), small ones copied as usual. Storages above :data:`MAX_DIGEST_BYTES` (the lazily
backed pools of the limit cases, gigabytes of zero pages whose own properties scan them for writes)
and ``meta`` tensors are not read.

Every call the guard sees is counted per candidate for the process's history
(:mod:`pagedkv.testing.history`: what a case file records, so replay can bring back a failure that
depends on earlier calls).
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

from pagedkv.testing import history as process_history
from pagedkv.testing.compare import Mismatch, bits, rerun_differs, rerun_scale

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
#: The arguments whose values an op's output sums (the scale of a nondeterministic rerun's error).
SUMMED_ARGS = ("v_cache", "prefix_out", "suffix_out", "cache", "values")
#: Largest total of input storage bytes a call is snapshotted and rerun for (64 MiB).
MAX_SNAPSHOT_BYTES = 64 << 20
#: How many calls of one check :func:`judge_again` reruns (the first ones: a property's main call).
RERUN_CALLS = 2
#: Largest storage a large call's digest reads (bytes); larger ones are not checked (module docstring).
MAX_DIGEST_BYTES = 2 << 30
#: Int64 words per chunk of a storage digest (16 MiB).
DIGEST_CHUNK = 1 << 21
#: How long a call that started threads still alive at its return is watched for late writes (seconds).
SETTLE_S = 0.2


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
    n = t.numel()
    if n == 0:
        return (0, 0)
    lo, size = t.data_ptr(), t.element_size()
    if t.is_contiguous():  # the common case, without a Python loop over the dims (the guard's hot path)
        return (lo, lo + n * size)
    return (lo, lo + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * size + size)


def _extent(t: torch.Tensor) -> tuple:
    """``(device, lo, hi)``: where ``t``'s elements lie, to compare with :func:`_disjoint` (``hi == lo``: empty)."""
    return (t.device, *_span(t))


def _disjoint(a: tuple, b: tuple) -> bool:
    """Two :func:`_extent` share no byte (other devices, either empty, or apart)."""
    return a[0] != b[0] or a[1] == a[2] or b[1] == b[2] or not (a[1] < b[2] and b[1] < a[2])


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


def _synchronize(tensors, out: Any = None) -> None:
    """Synchronise every CUDA device the tensors (and ``out``) are on: a kernel may run on any of them."""
    devices = {t.device for _, t in tensors if t.device.type == "cuda"}
    if isinstance(out, torch.Tensor) and out.device.type == "cuda":
        devices.add(out.device)
    for device in devices:
        torch.cuda.synchronize(device)


_WEIGHTS: dict = {}


def _weights(device: torch.device) -> torch.Tensor:
    """Odd int64 weights, one per word of a chunk: a change of one word by ``d != 0`` changes the chunk's
    wrapped sum by ``d * w``, which is never 0 mod 2**64 for an odd ``w``."""
    if (device, DIGEST_CHUNK) not in _WEIGHTS:
        gen = torch.Generator().manual_seed(0x9E3779B97F4A7C15 & (2**63 - 1))
        w = torch.randint(-(2**62), 2**62, (DIGEST_CHUNK,), generator=gen, dtype=torch.int64) | 1
        _WEIGHTS[device, DIGEST_CHUNK] = w.to(device)
    return _WEIGHTS[device, DIGEST_CHUNK]


def storage_digest(t: torch.Tensor) -> torch.Tensor | None:
    """A digest of the whole storage under ``t`` (every byte, whatever the view): one wrapped int64 weighted
    sum per :data:`DIGEST_CHUNK` words, as an int64 tensor on ``t``'s device; ``None`` for a ``meta`` tensor
    or a storage over :data:`MAX_DIGEST_BYTES`. Two digests of one storage are equal when no byte changed
    (up to a collision of a multi-word change, about 2**-64 per chunk for unstructured changes)."""
    storage = t.untyped_storage()
    n = storage.nbytes()
    if t.device.type == "meta" or n > MAX_DIGEST_BYTES:
        return None
    with torch._C.DisableTorchFunction():
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        words = raw[: n - n % 8].view(torch.int64)
        w = _weights(t.device)
        product = torch.empty_like(w)  # reused: no allocation per chunk (1.75x faster on CPU)
        sums = []
        for i in range(0, words.numel(), DIGEST_CHUNK):
            m = min(DIGEST_CHUNK, words.numel() - i)
            torch.mul(words[i:i + m], w[:m], out=product[:m])
            sums.append(product[:m].sum())
        sums.append((raw[n - n % 8:].to(torch.int64) * w[: n % 8]).sum())
        return torch.stack(sums)


def _changed_bytes(t: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> str:
    """Where two digests of ``t``'s storage differ, in words (the first changed chunk, and its block for a pool)."""
    chunk = int((old != new).nonzero()[0])
    lo = chunk * DIGEST_CHUNK * 8
    hi = min(lo + DIGEST_CHUNK * 8, t.untyped_storage().nbytes())
    where = f"bytes {lo}..{hi} of its storage"
    if t.dim() >= 1 and t.stride(0) > 0:
        first = (lo - t.storage_offset() * t.element_size()) // (t.stride(0) * t.element_size())
        where += f" (from about index {max(first, 0)} of dim 0)"
    return where


class _Snapshot:
    """Every input's state before a call: a copy (small calls, small tensors) or a storage digest."""

    def __init__(self, tensors: list, small: bool, writable: frozenset = frozenset()):
        self.copies, self.digests = {}, {}
        for name, t in tensors:
            if not small and name in writable:
                continue  # a pool the op writes: not judged unchanged, and a large one is not rerun either
            if small or t.numel() * t.element_size() <= MAX_SNAPSHOT_BYTES >> 6:  # small ones: copied (1 MiB)
                self.copies[name] = t.clone()
            else:  # views of one storage (K and V of one arena) share a digest
                same = next((n for n, u in tensors if n in self.digests and _storage_key(u) == _storage_key(t)), None)
                self.digests[name] = self.digests[same] if same else storage_digest(t)

    def __bool__(self) -> bool:
        return bool(self.copies or self.digests)


def _state(out: Any, tensors: list) -> dict:
    """The bits (small) or digest (large) of the output and every tensor argument, to compare a moment later."""
    state = {}
    for name, t in ([("the output", out)] if isinstance(out, torch.Tensor) else []) + list(tensors):
        with torch._C.DisableTorchFunction():
            state[name] = bits(t.detach()).clone() if t.numel() * t.element_size() <= MAX_SNAPSHOT_BYTES \
                else storage_digest(t)
    return state


class GuardedBackend:
    """``backend`` with every call of its ops checked against the output and input contract (module
    docstring); other attributes are the backend's own.

    Args:
        backend: the candidate (the object the user declared, before any layout adapter).
        caps: its :class:`~pagedkv.backends.capabilities.Capabilities` (``None``: read from ``backend``); its
            ``nondeterminism_ulp`` is the rerun tolerance of :meth:`judge_again`.
    """

    def __init__(self, backend: Any, caps: Any = None):
        if caps is None:
            from pagedkv.backends.capabilities import capabilities_of

            caps = capabilities_of(backend)
        self._backend = backend
        self._caps = caps
        self._calls: list[_Call] = []
        self._outputs: list = []  # weak references to outputs returned so far

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._backend, name)
        if name in GUARDED_OPS and callable(value):
            guarded = functools.wraps(value)(functools.partial(self._guarded_call, name, value))
            object.__setattr__(self, name, guarded)
            return guarded
        return value

    def _guarded_call(self, op: str, fn: Any, *args, **kwargs) -> Any:
        __tracebackhide__ = True
        process_history.count_call(self._backend)
        tensors = _named(op, args, kwargs)
        small = _storage_bytes(tensors) <= MAX_SNAPSHOT_BYTES
        before = _Snapshot(tensors, small, frozenset(tensors[i][0] for i in WRITES.get(op, ()) if i < len(tensors)))
        threads = set(threading.enumerate())
        with _fill_fresh_memory() if small else contextlib.nullcontext():
            out = fn(*args, **kwargs)
        _synchronize(tensors, out)
        _settle(op, out, tensors, threads)
        extents = [_extent(t) for _, t in tensors]  # once a call: every check below compares these
        with torch._C.DisableTorchFunction():
            self._check_output(op, out, tensors, extents)
            self._check_inputs(op, tensors, before, extents)
        aliased = any(not _disjoint(a, b) for i, a in enumerate(extents) for b in extents[i + 1:])
        if small and not aliased and len(self._calls) < RERUN_CALLS:  # aliased pools: copies would not alias
            written = {i: bits(tensors[i][1]).clone() for i in WRITES.get(op, ()) if i < len(tensors)}
            kept = _first(out)
            self._calls.append(_Call(op, args, kwargs, before.copies, kept,
                                     bits(kept).clone() if kept is not None else None, written))
        return out

    def _check_output(self, op: str, out: Any, tensors: list, extents: list, pair: bool = False) -> None:
        if op in WRITES:
            return
        if isinstance(out, tuple) and not pair:
            if len(out) != 2:
                raise ContractViolation(f"{op} returned a tuple of {len(out)}, expected (out, lse)")
            self._check_output(op, out[0], tensors, extents, True)
            self._check_output(op, out[1], tensors, extents, True)
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
        at = _extent(out)
        for (name, _), extent in zip(tensors, extents):
            if not _disjoint(at, extent):
                raise ContractViolation(f"{op}: output shares memory with its input {name}")
        alive = []
        for ref in self._outputs:
            prev = ref()
            if prev is None:
                continue
            alive.append(ref)
            if not _disjoint(at, _extent(prev)):
                raise ContractViolation(f"{op}: output shares memory with an earlier output the suite still holds "
                                        f"(a reused buffer: the earlier result changes under its holder)")
        import weakref

        self._outputs = alive + [weakref.ref(out)]

    def _check_inputs(self, op: str, tensors: list, before: _Snapshot, extents: list) -> None:
        if not before:
            return
        writable = {tensors[i][0] for i in WRITES.get(op, ()) if i < len(tensors)}
        written = [e for (name, _), e in zip(tensors, extents) if name in writable]
        for (name, t), extent in zip(tensors, extents):
            if name in writable or any(not _disjoint(extent, w) for w in written):
                continue  # a pool the op writes (its frame condition is a property of its own)
            if name in before.digests:
                old, new = before.digests[name], storage_digest(t)
                if old is not None and new is not None and not torch.equal(old, new):
                    raise ContractViolation(f"{op} wrote its input {name} at {_changed_bytes(t, old, new)}; it must "
                                            f"leave {name} unchanged bit for bit, padding and unused slots included")
                continue
            old = before.copies[name]
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
                if c.output is not None:
                    ulps = self._rerun_ulps(c.output.dtype)
                    first = c.output_bits.view(c.output.dtype)
                    if not isinstance(out, torch.Tensor) or out.shape != c.output.shape or out.dtype != first.dtype:
                        raise ContractViolation(_again_message(c.op, out, c.output_bits, ulps))
                    # the scale matters only within a declared tolerance (bit for bit otherwise): it reads every
                    # pool the output sums, gigabytes on the large-pool cases
                    scale = rerun_scale(first, out, *(t for name, t in named if name in SUMMED_ARGS)) if ulps else 0.0
                    differs = rerun_differs(out, first, ulps, scale)
                    if bool(differs.any()):
                        raise ContractViolation(_again_message(c.op, out, c.output_bits, ulps, differs, scale))
                for i, first in c.after.items():
                    if not torch.equal(bits(named[i][1]), first):
                        raise ContractViolation(f"{c.op} judged twice: {named[i][0]} after the second run on the "
                                                f"same inputs differs from the first (after another call of the same "
                                                f"shapes in between): the result depends on earlier calls (a write "
                                                f"skipped by data pointer, a call count) or is nondeterministic")

    def _rerun_ulps(self, dtype: torch.dtype) -> int:
        rerun_ulps = getattr(self._caps, "rerun_ulps", None)
        return int(rerun_ulps(dtype)) if rerun_ulps is not None else 0

    def _plain_call(self, fn: Any, c: _Call, named: list) -> Any:
        """``fn`` on the recorded arguments, memory filled, devices synchronised, late writes refused."""
        process_history.count_call(self._backend)
        threads = set(threading.enumerate())
        with _fill_fresh_memory():
            out = fn(*c.args, **c.kwargs)
        _synchronize(named, out)
        _settle(c.op, out, named, threads)
        return out


def _first(out: Any) -> Any:
    """The output tensor of a call: ``out`` itself, or the first of ``(out, lse)``; ``None`` otherwise."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out if isinstance(out, torch.Tensor) else None


def _settle(op: str, out: Any, tensors: list, threads: set) -> None:
    """When the call left threads it started alive: its output and every tensor argument must read the same
    when it returned and :data:`SETTLE_S` later (or once those threads ended). An idle worker kept for later
    calls passes; a thread still writing the result is a :class:`ContractViolation`."""
    started = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
    if not started:
        return
    import time

    at_return = _state(out, tensors)
    deadline = time.monotonic() + SETTLE_S
    for t in started:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    _synchronize(tensors, out)
    later = _state(out, tensors)
    for name, first in at_return.items():
        if first is not None and later[name] is not None and not torch.equal(first, later[name]):
            names = ", ".join(t.name for t in started)
            raise ContractViolation(f"{op} returned while a thread it started ({names}) was still writing: "
                                    f"{name} changed after the call returned (its result was not written yet)")


def _again_message(op: str, out: Any, first: torch.Tensor, tolerance_ulp: int = 0, differs: Any = None,
                   scale: float = 0.0) -> str:
    """``first``: the bits of the first run's output; ``differs``: where it differs beyond the tolerance."""
    where = ""
    if isinstance(out, torch.Tensor) and out.shape == first.shape:
        diff = (differs if differs is not None else bits(out) != first).nonzero()
        if diff.numel():
            where = f" at index {[int(x) for x in diff[0]]} ({diff.shape[0]} elements differ)"
    within = (f" by more than the declared nondeterminism_ulp={tolerance_ulp} (ulps of the scale {scale:.3g} of the "
              f"values summed, at most the output dtype's cap)" if tolerance_ulp else "")
    return (f"{op} judged twice: on the same inputs again, after a call on other values of the same shapes, "
            f"the output differs from the first run{where}{within}: the result depends on earlier calls (a cache "
            f"by shape or data pointer, a stale buffer, a call count) or is nondeterministic"
            + ("" if tolerance_ulp else " (a kernel nondeterministic by design declares "
                                        "Capabilities(nondeterminism_ulp=N))"))
