"""Argument checks shared by every backend, run before any kernel launch and before any write.

On CUDA an out-of-range block id that reaches a kernel is a device-side assert (which poisons the
whole process) or a silent out-of-bounds access, so every backend op calls one of the ``check_*``
functions below first. They read block tables and lengths on the host (one small device-to-host
copy on CUDA); callers that already validated can pass ``validate=False`` to the ops to skip them
(see ``docs/validation.md``: with ``validate=False`` a bad argument is undefined behaviour).

Error types follow the backend contract: a block id or slot that would be read or written outside
the pool is an ``IndexError`` (:class:`BlockIndexError`); shapes, lengths, table sizes and head
counts are a ``ValueError`` (:class:`ShapeError`); a dtype mismatch, or an argument of the wrong
kind (a float block table, a bool length), is a ``TypeError`` (:class:`DTypeMismatchError` or plain
``TypeError``); a device mismatch is a ``ValueError`` (:class:`DeviceMismatchError`). Messages name
the argument and the offending values.

Each check returns the normalised arguments the op needs (tables as ``int64`` on the cache device,
lengths as Python ints) so backends do not repeat the work.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from pagedkv.config import DTYPES, blocks_needed
from pagedkv.errors import (ArgumentTypeError, BackendError, BlockIndexError, DeviceMismatchError, DTypeMismatchError,
                            ShapeError)

TableLike = torch.Tensor | Sequence[int]

#: Pool dtypes holding an fp8 KV cache (written with ``k_scale`` / ``v_scale``, vLLM's ``kv_cache_dtype="fp8"``).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Every optional attention feature a backend can declare in its ``FEATURES`` frozenset.
ALL_FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def _check_tensor(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ShapeError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_cache(name: str, cache: object) -> torch.Tensor:
    """Check one pool: a 4-D ``[num_blocks, block_size, num_kv_heads, head_dim]`` float tensor.

    Raises:
        TypeError: not a tensor. DTypeMismatchError: not float32/float16/bfloat16/float8_e4m3fn/float8_e5m2.
        ShapeError: wrong rank or an empty dimension.
    """
    cache = _check_tensor(name, cache, 4)
    if cache.dtype not in DTYPES.values() and cache.dtype not in FP8_DTYPES:
        raise DTypeMismatchError(f"{name}.dtype must be one of float32/float16/bfloat16/float8_e4m3fn/float8_e5m2, "
                                 f"got {cache.dtype}")
    if min(cache.shape) < 1:
        raise ShapeError(f"{name} must have non-empty dims [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(cache.shape)}")
    if cache.device.type == "meta":
        raise DeviceMismatchError(f"{name} is on the meta device: it holds no data to read or write")
    return cache


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may address a common byte.

    Compares absolute address ranges (so views that reach one buffer through different storages,
    ``torch.from_numpy`` or DLPack, are caught). Two views of equal shape, strides and dtype whose
    strides nest (each stride exceeds the reach of the smaller ones: any view of an ordinary pool)
    are decided exactly: ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[num_blocks, 2, ...]`` pool share a
    buffer but no element. Anything else whose ranges intersect counts as overlapping (conservative:
    e.g. a ``key`` staged in a gap of an interleaved pool arena is refused).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False

    def span(x: torch.Tensor) -> tuple[int, int]:
        lo = x.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1) * x.element_size()

    (a_lo, a_hi), (b_lo, b_hi) = span(a), span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    diff, size = abs(a.data_ptr() - b.data_ptr()), a.element_size()
    if diff % size:
        return True  # elements straddle each other
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1 and st > 0), reverse=True)
    reach = [sum((n - 1) * st for st, n in dims[k + 1:]) for k in range(len(dims))]
    if any(reach[k] >= dims[k][0] for k in range(len(dims))):
        return True  # strides do not nest: no exact answer attempted

    def reachable(rest: int, k: int) -> bool:
        # An element of a sits at offset sum(i_k * st_k), of b at diff + sum(j_k * st_k): they meet
        # when diff = sum(c_k * st_k) with |c_k| <= n_k - 1. Nested strides leave only floor/ceil.
        if rest == 0:
            return True
        if k == len(dims) or abs(rest) > dims[k][0] * (dims[k][1] - 1) + reach[k]:
            return False
        st, n = dims[k]
        return any(abs(c) <= n - 1 and reachable(rest - c * st, k + 1) for c in {rest // st, rest // st + 1})

    return reachable(diff // size, 0)


def _check_no_overlap(name: str, x: torch.Tensor, cache: torch.Tensor, cache_name: str) -> None:
    if shares_memory(x, cache):
        raise ShapeError(f"{name} overlaps {cache_name} in memory: the write would read what it overwrites "
                         f"(pass {name}.clone())")


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``k_cache`` and ``v_cache``: same shape, dtype and device."""
    k_cache = check_cache("k_cache", k_cache)
    v_cache = check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape:
        raise ShapeError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise DTypeMismatchError(f"k_cache.dtype {k_cache.dtype} != v_cache.dtype {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise DeviceMismatchError(f"k_cache is on {k_cache.device}, v_cache on {v_cache.device}")
    return k_cache, v_cache


def _check_like_cache(name: str, x: torch.Tensor, cache: torch.Tensor, cache_name: str) -> None:
    if x.dtype != cache.dtype:
        raise DTypeMismatchError(f"{name}.dtype {x.dtype} != {cache_name}.dtype {cache.dtype}")
    if x.device != cache.device:
        raise DeviceMismatchError(f"{name} is on {x.device}, {cache_name} on {cache.device}")


def _check_int_tensor(name: str, x: torch.Tensor, allowed=(torch.int32, torch.int64)) -> None:
    if x.dtype not in allowed:
        raise DTypeMismatchError(f"{name}.dtype must be one of {[str(d) for d in allowed]}, got {x.dtype}")


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def normalize_block_table(block_table: TableLike, device: torch.device, name: str = "block_table") -> torch.Tensor:
    """A 1-D block table (tensor or sequence of ints) as ``int64`` on ``device``.

    A tensor table must be ``int32`` or ``int64`` and live on ``device`` or on the CPU (a host table is
    copied over, as a list would be). A sequence must hold Python/NumPy integers (not bools, not floats).

    Raises:
        ShapeError: a tensor that is not 1-D.
        DTypeMismatchError: a tensor of another dtype (float, bool, int8...).
        TypeError: a sequence holding something other than integers, or not a sequence at all.
        DeviceMismatchError: a tensor on a device other than ``device`` and the CPU.
        BlockIndexError: an entry outside the int64 range.
    """
    if isinstance(block_table, torch.Tensor):
        if block_table.dim() != 1:
            raise ShapeError(f"{name} must be 1-D, got shape {tuple(block_table.shape)}")
        _check_int_tensor(name, block_table)
        if block_table.device != torch.device(device) and block_table.device.type != "cpu":
            raise DeviceMismatchError(f"{name} is on {block_table.device}, the cache on {device}")
        return block_table.to(device=device, dtype=torch.int64)
    if isinstance(block_table, (str, bytes)) or not hasattr(block_table, "__iter__"):
        raise ArgumentTypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got {type(block_table).__name__}")
    values = []
    for i, b in enumerate(block_table):
        if isinstance(b, bool) or not hasattr(b, "__index__") or isinstance(b, torch.Tensor):
            raise ArgumentTypeError(f"{name}[{i}] must be an int, got {type(b).__name__} {b!r}")
        b = operator.index(b)
        if not _INT64_MIN <= b <= _INT64_MAX:
            raise BlockIndexError(f"{name}[{i}] = {b} does not fit in int64")
        values.append(b)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _check_ids_in_range(name: str, ids: torch.Tensor, num_blocks: int, what: str = "block id") -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        pos = int(torch.nonzero(ids == bad)[0][0]) if ids.dim() == 1 else None
        where = f" at entry {pos}" if pos is not None else ""
        raise BlockIndexError(f"{name} has {what} {bad}{where}, outside [0, num_blocks={num_blocks})")


def _check_length(name: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ShapeError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ShapeError(f"{name} must be >= 0, got {value}")
    return value


def check_scatter(cache: object, block_table: TableLike, values: object, start: int = 0) -> tuple[torch.Tensor, int, int]:
    """Validate ``scatter(cache, block_table, values, start)``.

    Returns:
        ``(table_int64_on_cache_device, start, n)``.

    Raises:
        ShapeError: ``values`` not ``[n, num_kv_heads, head_dim]``, negative ``start``, a table too short
            for ``start + n`` tokens, or one physical block at two written logical blocks.
        BlockIndexError: a written block id outside ``[0, num_blocks)``.
        DTypeMismatchError / DeviceMismatchError: ``values`` unlike ``cache``.
    """
    cache = check_cache("cache", cache)
    values = _check_tensor("values", values, 3)
    _check_like_cache("values", values, cache, "cache")
    _check_no_overlap("values", values, cache, "cache")
    if tuple(values.shape[1:]) != tuple(cache.shape[2:]):
        raise ShapeError(f"values must be [n, num_kv_heads, head_dim] = [n, {cache.shape[2]}, {cache.shape[3]}], "
                         f"got {tuple(values.shape)}")
    start = _check_length("start", start)
    n = values.shape[0]
    table = normalize_block_table(block_table, cache.device)
    block_size = cache.shape[1]
    if n == 0:
        return table, start, 0
    first, last = start // block_size, blocks_needed(start + n, block_size)
    if table.numel() < last:
        raise ShapeError(f"block_table has {table.numel()} entries, but start + n = {start} + {n} = {start + n} "
                         f"tokens need {last} blocks of block_size {block_size}")
    written = table[first:last]
    _check_ids_in_range("block_table", written, cache.shape[0])
    if torch.unique(written).numel() != written.numel():
        raise ShapeError(f"block_table maps two written logical blocks to one physical block: {written.tolist()}")
    return table, start, n


def check_gather(cache: object, block_table: TableLike, seq_len: int) -> tuple[torch.Tensor, int]:
    """Validate ``gather(cache, block_table, seq_len)``.

    Returns:
        ``(table_int64_on_cache_device, seq_len)``.

    Raises:
        ShapeError: negative ``seq_len`` or a table with fewer than ``ceil(seq_len / block_size)`` entries.
        BlockIndexError: a read block id outside ``[0, num_blocks)`` (``-1`` padding past the read
            entries is fine).
    """
    cache = check_cache("cache", cache)
    seq_len = _check_length("seq_len", seq_len)
    table = normalize_block_table(block_table, cache.device)
    need = blocks_needed(seq_len, cache.shape[1])
    if table.numel() < need:
        raise ShapeError(f"block_table has {table.numel()} entries, but seq_len {seq_len} needs {need} blocks "
                         f"of block_size {cache.shape[1]}")
    _check_ids_in_range("block_table", table[:need], cache.shape[0])
    return table, seq_len


def _check_real(name: str, value: object) -> float:
    """``value`` (a real number or a one-element tensor) as a Python float; bools and strings refused."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ShapeError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_kv_scale(name: str, scale: object, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """One fp8 dequantization scale (vLLM's ``k_scale`` / ``v_scale``) as ``float32 [num_kv_heads]`` on ``device``.

    Accepted: a real number (per tensor; rounded to float32), a one-element float32 tensor (per
    tensor), or a ``float32 [num_kv_heads]`` tensor (one scale per kv head), on ``device`` or the CPU.

    Raises:
        ArgumentTypeError: not a number or tensor (a bool, a string, ``None`` where one is required).
        DTypeMismatchError: a tensor that is not float32. ShapeError: a tensor of another shape, or a
            scale that is zero, negative or not finite (scales multiply stored values: they must be > 0).
        DeviceMismatchError: a tensor on a device other than ``device`` and the CPU.
    """
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32:
            raise DTypeMismatchError(f"{name}.dtype must be torch.float32, got {scale.dtype}")
        if scale.device != torch.device(device) and scale.device.type != "cpu":
            raise DeviceMismatchError(f"{name} is on {scale.device}, the cache on {device}")
        if scale.numel() == 1:
            values = scale.detach().reshape(1).to("cpu").expand(num_kv_heads)
        elif tuple(scale.shape) == (num_kv_heads,):
            values = scale.detach().to("cpu")
        else:
            raise ShapeError(f"{name} must be a number, a one-element tensor or float32 [num_kv_heads = "
                             f"{num_kv_heads}], got shape {tuple(scale.shape)}")
    else:
        values = torch.tensor([_check_real(name, scale)], dtype=torch.float32).expand(num_kv_heads)
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0][0])
        where = f"[{i}]" if isinstance(scale, torch.Tensor) and scale.numel() > 1 else ""
        raise ShapeError(f"{name}{where} must be finite and > 0, got {float(values[i])}")
    return values.to(device=device).contiguous()


def _as_scale(scale: object, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """:func:`check_kv_scale`'s normalisation without its checks or host reads (``validate=False``)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(-1).expand(num_kv_heads).contiguous()
    return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)


def _check_pool_scales(k_cache: torch.Tensor, k_scale: object, v_scale: object) -> tuple[torch.Tensor | None, ...]:
    """Scales are required for an fp8 pool and refused for any other (they would be silently ignored)."""
    if k_cache.dtype in FP8_DTYPES:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ArgumentTypeError(f"{name} is required for an fp8 pool (k_cache.dtype {k_cache.dtype}): "
                                        f"stored values are x / {name}")
        return (check_kv_scale("k_scale", k_scale, k_cache.shape[2], k_cache.device),
                check_kv_scale("v_scale", v_scale, k_cache.shape[2], k_cache.device))
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:
            raise ArgumentTypeError(f"{name} applies only to an fp8 pool (float8_e4m3fn / float8_e5m2); k_cache is "
                                    f"{k_cache.dtype}: pass {name}=None")
    return None, None


def check_features(requested: frozenset, supported: frozenset | None, op: str) -> None:
    """Raise unless every requested optional feature is in the backend's ``supported`` (its ``FEATURES``).

    ``supported=None`` means "declares everything" (pagedkv's own checks called directly).

    Raises:
        BackendError: a feature the backend does not declare; the message names it and the declared set.
    """
    if supported is None or not requested:
        return
    missing = sorted(requested - frozenset(supported))
    if missing:
        raise BackendError(f"{op}: feature(s) {missing} not supported by this backend (its FEATURES declare "
                           f"{sorted(supported)})")


@dataclass(frozen=True)
class WriteArgs:
    """Normalised ``write_kv`` arguments."""

    slots: torch.Tensor  # int64 [num_tokens] on the cache device
    k_scale: torch.Tensor | None = None  # float32 [num_kv_heads] on the cache device (fp8 pools only)
    v_scale: torch.Tensor | None = None


def check_write_kv(k_cache: object, v_cache: object, key: object, value: object, slot_mapping: object, *,
                   k_scale: object = None, v_scale: object = None) -> torch.Tensor:
    """Validate ``write_kv`` (vLLM ``reshape_and_cache``).

    ``key``/``value`` share the pools' dtype, except into an fp8 pool (``float8_e4m3fn`` /
    ``float8_e5m2``), which takes float32/float16/bfloat16 and requires ``k_scale`` and ``v_scale``
    (see :func:`check_kv_scale`); a non-fp8 pool refuses scales.

    Returns:
        ``slot_mapping`` as ``int64`` on the cache device (:func:`write_kv_args` also returns the scales).

    Raises:
        ShapeError: ``key``/``value`` not ``[num_tokens, num_kv_heads, head_dim]``, ``slot_mapping`` not
            ``[num_tokens]``, one slot written twice, ``k_cache`` and ``v_cache`` overlapping in memory, or
            ``key``/``value`` overlapping a pool; a scale that is zero, negative or not finite.
        BlockIndexError: a non-negative slot ``>= num_blocks * block_size``.
        DTypeMismatchError / DeviceMismatchError: key/value/slot_mapping/scales unlike the caches.
        ArgumentTypeError: an fp8 pool without scales, or scales for a non-fp8 pool.
    """
    return write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale).slots


def write_kv_args(k_cache: object, v_cache: object, key: object, value: object, slot_mapping: object, *,
                  k_scale: object = None, v_scale: object = None, validate: bool = True,
                  supported: frozenset | None = None) -> WriteArgs:
    """:func:`check_write_kv` returning :class:`WriteArgs` (slots and normalised scales).

    ``validate=False`` only normalises (the caller checked). ``supported``: the backend's
    ``FEATURES``; an fp8 pool needs ``"fp8"`` in it (:func:`check_features`).
    """
    if not validate:
        fp8 = k_cache.dtype in FP8_DTYPES
        h, dev = k_cache.shape[2], k_cache.device
        return WriteArgs(slot_mapping.to(torch.int64), _as_scale(k_scale, h, dev) if fp8 else None,
                         _as_scale(v_scale, h, dev) if fp8 else None)
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    if shares_memory(k_cache, v_cache):
        raise ShapeError("k_cache and v_cache overlap in memory (one pool passed twice, or overlapping views): "
                         "a write of value would overwrite key")
    key = _check_tensor("key", key, 3)
    value = _check_tensor("value", value, 3)
    fp8 = k_cache.dtype in FP8_DTYPES
    for name, x, cname, c in (("key", key, "k_cache", k_cache), ("value", value, "v_cache", v_cache)):
        if fp8:  # quantized on write: the values come in a float dtype
            if x.dtype not in DTYPES.values():
                raise DTypeMismatchError(f"{name}.dtype must be float32/float16/bfloat16 for an fp8 {cname} "
                                         f"({c.dtype}), got {x.dtype}")
            if x.device != c.device:
                raise DeviceMismatchError(f"{name} is on {x.device}, {cname} on {c.device}")
        else:
            _check_like_cache(name, x, c, cname)
        if tuple(x.shape[1:]) != tuple(c.shape[2:]):
            raise ShapeError(f"{name} must be [num_tokens, num_kv_heads, head_dim] = [num_tokens, {c.shape[2]}, "
                             f"{c.shape[3]}], got {tuple(x.shape)}")
    if key.shape[0] != value.shape[0]:
        raise ShapeError(f"key has {key.shape[0]} tokens, value has {value.shape[0]}")
    for name, x in (("key", key), ("value", value)):
        for cname, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_no_overlap(name, x, c, cname)
    slot_mapping = _check_tensor("slot_mapping", slot_mapping, 1)
    _check_int_tensor("slot_mapping", slot_mapping)
    if slot_mapping.device != k_cache.device:
        raise DeviceMismatchError(f"slot_mapping is on {slot_mapping.device}, k_cache on {k_cache.device}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping has {slot_mapping.shape[0]} entries, key has {key.shape[0]} tokens")
    slots = slot_mapping.to(torch.int64)
    valid = slots[slots >= 0]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if valid.numel():
        hi = int(valid.max())
        if hi >= num_slots:
            at = int(torch.nonzero(slots == hi)[0][0])
            raise BlockIndexError(f"slot_mapping[{at}] = {hi} (block {hi // k_cache.shape[1]}), outside "
                                  f"[0, num_blocks * block_size = {num_slots})")
        uniq, counts = torch.unique(valid, return_counts=True)
        if uniq.numel() != valid.numel():
            dup = int(uniq[counts > 1][0])
            at = torch.nonzero(slots == dup).flatten().tolist()
            raise ShapeError(f"slot_mapping writes slot {dup} twice (entries {at})")
    ks, vs = _check_pool_scales(k_cache, k_scale, v_scale)
    check_features(frozenset({"fp8"}) if fp8 else frozenset(), supported, "write_kv")
    return WriteArgs(slots, ks, vs)


def _check_scale(scale: object, head_dim: int) -> float:
    """``scale`` as a finite Python float (``None``: ``1 / sqrt(head_dim)``)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = _check_real("scale", scale)
    if not math.isfinite(value):
        raise ShapeError(f"scale must be finite, got {value}")
    return value


def _check_window(window_left: object) -> int:
    """flash-attn's ``window_size[0]``: an int ``>= -1`` (``-1``: no window)."""
    if isinstance(window_left, torch.Tensor) and window_left.numel() == 1 and not window_left.dtype.is_floating_point:
        window_left = window_left.item()
    if isinstance(window_left, bool) or not hasattr(window_left, "__index__") or isinstance(window_left, torch.Tensor):
        raise ArgumentTypeError(f"window_left must be an int (-1: no window), got {type(window_left).__name__} "
                                f"{window_left!r}")
    value = operator.index(window_left)
    if value < -1:
        raise ShapeError(f"window_left must be -1 (no window) or >= 0, got {value}")
    return value


def _check_softcap(softcap: object) -> float:
    """Gemma's logit soft-cap: a finite float ``>= 0`` (``0``: off)."""
    value = _check_real("softcap", softcap)
    if not math.isfinite(value) or value < 0:
        raise ShapeError(f"softcap must be finite and >= 0 (0: off), got {value}")
    return value


def _check_head_vector(name: str, x: object, num_q_heads: int, device: torch.device, allow_neg_inf: bool) -> torch.Tensor:
    """``float32 [num_q_heads]`` on ``device`` (ALiBi slopes, attention sinks), finite (sinks: or ``-inf``)."""
    x = _check_tensor(name, x, 1)
    if x.dtype != torch.float32:
        raise DTypeMismatchError(f"{name}.dtype must be torch.float32, got {x.dtype}")
    if x.shape[0] != num_q_heads:
        raise ShapeError(f"{name} must be float32 [num_q_heads = {num_q_heads}], got shape {tuple(x.shape)}")
    if x.device != torch.device(device):
        raise DeviceMismatchError(f"{name} is on {x.device}, query on {device}")
    ok = torch.isfinite(x) | (x == float("-inf")) if allow_neg_inf else torch.isfinite(x)
    if not bool(ok.all()):
        i = int(torch.nonzero(~ok)[0][0])
        allowed = "finite or -inf" if allow_neg_inf else "finite"
        raise ShapeError(f"{name}[{i}] must be {allowed}, got {float(x[i])}")
    return x.contiguous()


@dataclass(frozen=True)
class AttentionArgs:
    """Normalised ``paged_attention`` arguments (host copies of the small metadata)."""

    block_tables: torch.Tensor  # int64 [batch, max_blocks] on the cache device
    seq_lens: list[int]
    q_starts: list[int]  # query_start_loc as Python ints, len batch + 1
    scale: float
    num_queries_per_kv: int
    window_left: int = -1  # a query at position p sees keys p - window_left .. p; -1: no window
    softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap); 0: off
    alibi_slopes: torch.Tensor | None = None  # float32 [num_q_heads] on the query's device
    sinks: torch.Tensor | None = None  # float32 [num_q_heads]: one extra logit per head, no value
    k_scale: torch.Tensor | None = None  # float32 [num_kv_heads] (fp8 pools only)
    v_scale: torch.Tensor | None = None

    @property
    def features(self) -> frozenset:
        """The optional features this call uses (names as in a backend's ``FEATURES``)."""
        return frozenset(name for name, on in (
            ("window", self.window_left >= 0), ("softcap", self.softcap > 0), ("alibi", self.alibi_slopes is not None),
            ("sinks", self.sinks is not None), ("fp8", self.k_scale is not None)) if on)


def check_paged_attention(query: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object,
                          query_start_loc: object, scale: float | None = None, *, window_left: object = -1,
                          softcap: object = 0.0, alibi_slopes: object = None, sinks: object = None,
                          k_scale: object = None, v_scale: object = None,
                          supported: frozenset | None = None) -> AttentionArgs:
    """Validate ``paged_attention`` (packed varlen, flash-attn's ``cu_seqlens_q`` convention).

    The optional features (see ``docs/contract.md``; vLLM's unified attention and flash-attn's names):
    ``window_left`` (int ``>= -1``), ``softcap`` (float ``>= 0``), ``alibi_slopes`` and ``sinks``
    (``float32 [num_q_heads]`` on the query's device; sinks may be ``-inf``), ``k_scale`` / ``v_scale``
    (required for, and only for, an fp8 pool; see :func:`check_kv_scale`). With an fp8 pool the
    query is float32/float16/bfloat16. ``supported``: the backend's ``FEATURES``; a feature in use
    that it does not declare is refused (:func:`check_features`).

    Raises:
        ShapeError: wrong ranks; ``num_q_heads % num_kv_heads != 0``; ``head_dim`` mismatch;
            ``query_start_loc`` not ``[batch + 1]``, not starting at 0, decreasing, or not ending at
            ``total_q``; ``seq_lens`` not ``[batch]`` or negative; ``q_len > seq_len``; a table row too
            short for its ``seq_len``; ``scale`` not finite; ``window_left < -1``; ``softcap`` negative or
            not finite; slopes/sinks of the wrong shape or not finite; a scale ``<= 0`` or not finite.
        BlockIndexError: a read block id outside ``[0, num_blocks)``.
        DTypeMismatchError / DeviceMismatchError: query, metadata, slopes, sinks or scales unlike the caches.
        ArgumentTypeError: ``window_left`` not an int, ``softcap`` not a number, an fp8 pool without
            scales or scales for a non-fp8 pool.
        BackendError: a feature in use that ``supported`` does not declare.
    """
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    query = _check_tensor("query", query, 3)
    if k_cache.dtype in FP8_DTYPES:  # dequantized in the kernel: the query stays in a float dtype
        if query.dtype not in DTYPES.values():
            raise DTypeMismatchError(f"query.dtype must be float32/float16/bfloat16 for an fp8 k_cache "
                                     f"({k_cache.dtype}), got {query.dtype}")
        if query.device != k_cache.device:
            raise DeviceMismatchError(f"query is on {query.device}, k_cache on {k_cache.device}")
    else:
        _check_like_cache("query", query, k_cache, "k_cache")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.shape[2] != head_dim:
        raise ShapeError(f"query head_dim {query.shape[2]} != k_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0 or query.shape[1] == 0:
        raise ShapeError(f"query has num_q_heads {query.shape[1]}, not a positive multiple of k_cache's "
                         f"num_kv_heads {num_kv_heads}")
    block_tables = _check_tensor("block_tables", block_tables, 2)
    seq_lens = _check_tensor("seq_lens", seq_lens, 1)
    query_start_loc = _check_tensor("query_start_loc", query_start_loc, 1)
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _check_int_tensor(name, x)
        if x.device != k_cache.device:
            raise DeviceMismatchError(f"{name} is on {x.device}, k_cache on {k_cache.device}")
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch:
        raise ShapeError(f"block_tables has {block_tables.shape[0]} rows, seq_lens has {batch} entries")
    if query_start_loc.shape[0] != batch + 1:
        raise ShapeError(f"query_start_loc must have batch + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}")
    lens = [int(x) for x in seq_lens.tolist()]
    starts = [int(x) for x in query_start_loc.tolist()]
    if starts[0] != 0:
        raise ShapeError(f"query_start_loc[0] must be 0, got {starts[0]}")
    if starts[-1] != query.shape[0]:
        raise ShapeError(f"query_start_loc[-1] = {starts[-1]} != total_q = query.shape[0] = {query.shape[0]}")
    tables = block_tables.to(torch.int64)
    for b in range(batch):  # all of query_start_loc first: a decrease also makes a neighbour's q_len too long
        if starts[b + 1] < starts[b]:
            raise ShapeError(f"query_start_loc decreases at sequence {b}: query_start_loc[{b}] = {starts[b]} > "
                             f"query_start_loc[{b + 1}] = {starts[b + 1]}")
    for b in range(batch):
        q_len = starts[b + 1] - starts[b]
        if lens[b] < 0:
            raise ShapeError(f"seq_lens[{b}] = {lens[b]} is negative")
        if q_len > lens[b]:
            raise ShapeError(f"sequence {b} has q_len {q_len} (query_start_loc[{b + 1}] - query_start_loc[{b}]) > "
                             f"seq_lens[{b}] = {lens[b]}")
        need = blocks_needed(lens[b], block_size)
        if need > tables.shape[1]:
            raise ShapeError(f"seq_lens[{b}] = {lens[b]} needs {need} blocks of block_size {block_size}, "
                             f"block_tables has {tables.shape[1]} columns")
        _check_ids_in_range(f"block_tables[{b}]", tables[b, :need], num_blocks)
    scale = _check_scale(scale, head_dim)
    num_q_heads = query.shape[1]
    if (type(window_left) is int and window_left == -1 and type(softcap) in (float, int) and softcap == 0
            and alibi_slopes is None and sinks is None and k_scale is None and v_scale is None
            and k_cache.dtype not in FP8_DTYPES):  # the plain call: no feature, nothing more to check
        return AttentionArgs(tables, lens, starts, scale, num_q_heads // num_kv_heads)
    window_left = _check_window(window_left)
    softcap = _check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, query.device, False)
    if sinks is not None:
        sinks = _check_head_vector("sinks", sinks, num_q_heads, query.device, True)
    k_scale, v_scale = _check_pool_scales(k_cache, k_scale, v_scale)
    args = AttentionArgs(tables, lens, starts, scale, num_q_heads // num_kv_heads, window_left, softcap,
                         alibi_slopes, sinks, k_scale, v_scale)
    check_features(args.features, supported, "paged_attention")
    return args


def attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                   validate: bool = True, *, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   k_scale=None, v_scale=None, supported: frozenset | None = None) -> AttentionArgs:
    """:func:`check_paged_attention`, or with ``validate=False`` only the normalisation (caller checked)."""
    features = dict(window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                    k_scale=k_scale, v_scale=v_scale)
    if validate:
        return check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     supported=supported, **features)
    fp8 = k_cache.dtype in FP8_DTYPES
    h, dev = k_cache.shape[2], k_cache.device
    return AttentionArgs(block_tables.to(torch.int64), [int(x) for x in seq_lens.tolist()],
                         [int(x) for x in query_start_loc.tolist()],
                         1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
                         query.shape[1] // k_cache.shape[2], int(window_left), float(softcap), alibi_slopes, sinks,
                         _as_scale(k_scale, h, dev) if fp8 else None, _as_scale(v_scale, h, dev) if fp8 else None)
