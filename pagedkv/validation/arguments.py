"""Checks of single arguments: tensors, pools, block tables, lengths, numbers and the attention features.

The building blocks of :mod:`pagedkv.validation.calls` (which checks whole calls and re-exports the public
names here). Error types follow the backend contract (see ``docs/validation.md``). Functions taking
``read_values`` read tensor *data* (a host synchronisation on CUDA) only when it is true: the
``"metadata"`` validation level passes false and checks dtype, shape and device alone.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from pagedkv.cache.config import DTYPES
from pagedkv.errors import (ArgumentTypeError, ArgumentValueError, BackendError, BlockIndexError, DeviceMismatchError,
                            DTypeMismatchError, ShapeError)
from pagedkv.validation.overlap import shares_memory

TableLike = torch.Tensor | Sequence[int]

#: Pool dtypes holding an fp8 KV cache (written with ``k_scale`` / ``v_scale``, vLLM's ``kv_cache_dtype="fp8"``).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Every optional attention feature a backend can declare in its ``FEATURES`` frozenset.
ALL_FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def check_tensor(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ShapeError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def logical_pools(layout: object, **pools: object) -> list[object]:
    """Each pool of ``pools`` (``k_cache=..., v_cache=...`` or ``cache=...``) as the logical
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` view its ``layout`` declares
    (:mod:`pagedkv.layouts`), so that the checks read block size and head count where the contract puts
    them: a head-major ``HND`` pool ``[num_blocks, num_kv_heads, block_size, head_dim]`` (FlashInfer's,
    vLLM's) becomes its permuted view. Nothing is copied; ``"NHD"`` returns the pools as given.

    Args:
        layout: what ``Capabilities.layout`` takes: ``"NHD"``, ``"HND"``, a view-form
            :class:`~pagedkv.layouts.PoolLayout`, or a ``(key, value)`` pair of them (the key's applies to
            ``k_cache`` and to a single ``cache``, the value's to ``v_cache``).

    Raises:
        ArgumentValueError: an unknown ``layout``, or one in the copy form (no view exists: check the logical
            pools its ``to_logical`` returns).
        ArgumentTypeError / ShapeError: a pool that is not a 4-D tensor, or one the layout cannot view.
    """
    from pagedkv.layouts import NHD, pool_layouts

    if layout is NHD or isinstance(layout, str) and layout == "NHD":
        return list(pools.values())
    try:
        key_layout, value_layout = pool_layouts(layout)
    except ValueError as exc:
        raise ArgumentValueError(f"layout: {exc}") from None
    out = []
    for name, pool in pools.items():
        chosen = value_layout if name == "v_cache" else key_layout
        if not chosen.is_view:
            raise ArgumentValueError(f"layout {chosen.name!r} is a copy pair, not a view: check the logical pools "
                                     f"(layout.to_logical({name})), or declare the layout as a view")
        pool = check_tensor(name, pool, 4)
        try:
            view = chosen.logical(pool)
        except RuntimeError as exc:
            raise ShapeError(f"{name} of shape {tuple(pool.shape)} has no {chosen.name} view: {exc}") from None
        out.append(view)
    return out


def check_in_layout(layout: object, check, **pools: object):
    """``check(*views)`` over the logical views of ``pools`` in ``layout`` (:func:`logical_pools`), its result.
    Where the default ``"NHD"`` was read and ``check`` refuses the pools (``ShapeError``, ``BlockIndexError``) but
    passes them read head-major, the refusal says to pass ``layout="HND"``: an HND kernel calling a check without
    ``layout=`` gets its block size read as the head count.

    Raises:
        what :func:`logical_pools` and ``check`` raise.
    """
    views = logical_pools(layout, **pools)
    try:
        return check(*views)
    except (ShapeError, BlockIndexError) as exc:
        if not (isinstance(layout, str) and layout == "NHD") or not all(
                isinstance(p, torch.Tensor) and p.dim() == 4 for p in views):
            raise
        try:
            check(*logical_pools("HND", **pools))
        except Exception:  # noqa: BLE001 - refused as HND too: the error stands as it is
            raise exc from None
        raise type(exc)(f"{exc} (read as head-major pools [num_blocks, num_kv_heads, block_size, head_dim] the "
                        f"call is valid: pass layout=\"HND\", the layout Capabilities declares)") from None


def check_cache(name: str, cache: object) -> torch.Tensor:
    """Check one pool: a 4-D ``[num_blocks, block_size, num_kv_heads, head_dim]`` float tensor.

    Raises:
        TypeError: not a tensor. DTypeMismatchError: not float32/float16/bfloat16/float8_e4m3fn/float8_e5m2.
        ShapeError: wrong rank or an empty dimension.
    """
    cache = check_tensor(name, cache, 4)
    if cache.dtype not in DTYPES.values() and cache.dtype not in FP8_DTYPES:
        raise DTypeMismatchError(f"{name}.dtype must be one of float32/float16/bfloat16/float8_e4m3fn/float8_e5m2, "
                                 f"got {cache.dtype}")
    if min(cache.shape) < 1:
        raise ShapeError(f"{name} must have non-empty dims [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(cache.shape)}")
    if cache.device.type == "meta":
        raise DeviceMismatchError(f"{name} is on the meta device: it holds no data to read or write")
    return cache


def check_no_overlap(name: str, x: torch.Tensor, cache: torch.Tensor, cache_name: str) -> None:
    if shares_memory(x, cache):
        raise ShapeError(f"{name} overlaps {cache_name} in memory: the write would read what it overwrites "
                         f"(pass {name}.clone())")


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``k_cache`` and ``v_cache``: same dtype, device and shape but for the last dim (``head_dim_v``
    may differ from ``head_dim``: MLA's V is the first 512 of K's 576 columns)."""
    k_cache = check_cache("k_cache", k_cache)
    v_cache = check_cache("v_cache", v_cache)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ShapeError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise DTypeMismatchError(f"k_cache.dtype {k_cache.dtype} != v_cache.dtype {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise DeviceMismatchError(f"k_cache is on {k_cache.device}, v_cache on {v_cache.device}")
    return k_cache, v_cache


def check_like_cache(name: str, x: torch.Tensor, cache: torch.Tensor, cache_name: str) -> None:
    if x.dtype != cache.dtype:
        raise DTypeMismatchError(f"{name}.dtype {x.dtype} != {cache_name}.dtype {cache.dtype}")
    if x.device != cache.device:
        raise DeviceMismatchError(f"{name} is on {x.device}, {cache_name} on {cache.device}")


def check_int_tensor(name: str, x: torch.Tensor, allowed=(torch.int32, torch.int64)) -> None:
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
        check_int_tensor(name, block_table)
        if block_table.device != torch.device(device) and block_table.device.type != "cpu":
            raise DeviceMismatchError(f"{name} is on {block_table.device}, the cache on {device}")
        return block_table.to(device=device, dtype=torch.int64)
    if isinstance(block_table, (str, bytes)) or not hasattr(block_table, "__iter__"):
        raise ArgumentTypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, "
                                f"got {type(block_table).__name__}")
    values = []
    for i, b in enumerate(block_table):
        if isinstance(b, bool) or not hasattr(b, "__index__") or isinstance(b, torch.Tensor):
            raise ArgumentTypeError(f"{name}[{i}] must be an int, got {type(b).__name__} {b!r}")
        b = operator.index(b)
        if not _INT64_MIN <= b <= _INT64_MAX:
            raise BlockIndexError(f"{name}[{i}] = {b} does not fit in int64")
        values.append(b)
    return torch.tensor(values, dtype=torch.int64, device=device)


def check_ids_in_range(name: str, ids: torch.Tensor, num_blocks: int, what: str = "block id") -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        pos = int(torch.nonzero(ids == bad)[0][0]) if ids.dim() == 1 else None
        where = f" at entry {pos}" if pos is not None else ""
        raise BlockIndexError(f"{name} has {what} {bad}{where}, outside [0, num_blocks={num_blocks})")


def check_length(name: str, value: object) -> int:
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


def check_real(name: str, value: object) -> float:
    """``value`` (a real number or a one-element tensor) as a Python float; bools and strings refused."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ShapeError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ArgumentTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_kv_scale(name: str, scale: object, num_kv_heads: int, device: torch.device,
                   read_values: bool = True) -> torch.Tensor:
    """One fp8 dequantization scale (vLLM's ``k_scale`` / ``v_scale``) as ``float32 [num_kv_heads]`` on ``device``.

    Accepted: a real number (per tensor; rounded to float32), a one-element float32 tensor (per
    tensor), or a ``float32 [num_kv_heads]`` tensor (one scale per kv head), on ``device`` or the CPU.

    Raises:
        ArgumentTypeError: not a number or tensor (a bool, a string, ``None`` where one is required).
        DTypeMismatchError: a tensor that is not float32. ShapeError: a tensor of another shape.
        ArgumentValueError: a scale that is zero, negative or not finite (scales multiply stored
            values: they must be > 0).
        DeviceMismatchError: a tensor on a device other than ``device`` and the CPU.

    With ``read_values=False`` a tensor's values are not read (nor copied to the host): only its
    dtype, device and shape are checked.
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
        if not read_values:
            return as_scale(scale, num_kv_heads, device)
    else:
        values = torch.tensor([check_real(name, scale)], dtype=torch.float32).expand(num_kv_heads)
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0][0])
        where = f"[{i}]" if isinstance(scale, torch.Tensor) and scale.numel() > 1 else ""
        raise ArgumentValueError(f"{name}{where} must be finite and > 0, got {float(values[i])}")
    return values.to(device=device).contiguous()


def as_scale(scale: object, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """:func:`check_kv_scale`'s normalisation without its checks or host reads (validation level ``"none"``)."""
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(-1).expand(num_kv_heads).contiguous()
    return torch.full((num_kv_heads,), float(scale), dtype=torch.float32, device=device)


def check_pool_scales(k_cache: torch.Tensor, k_scale: object, v_scale: object,
                      read_values: bool = True) -> tuple[torch.Tensor | None, ...]:
    """Scales are required for an fp8 pool and refused for any other (they would be silently ignored)."""
    if k_cache.dtype in FP8_DTYPES:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ArgumentTypeError(f"{name} is required for an fp8 pool (k_cache.dtype {k_cache.dtype}): "
                                        f"stored values are x / {name}")
        return (check_kv_scale("k_scale", k_scale, k_cache.shape[2], k_cache.device, read_values),
                check_kv_scale("v_scale", v_scale, k_cache.shape[2], k_cache.device, read_values))
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


def check_scale(scale: object, head_dim: int) -> float:
    """``scale`` as a finite Python float (``None``: ``1 / sqrt(head_dim)``)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = check_real("scale", scale)
    if not math.isfinite(value):
        raise ArgumentValueError(f"scale must be finite, got {value}")
    return value


def check_window(window_left: object) -> int:
    """flash-attn's ``window_size[0]``: an int ``>= -1`` (``-1``: no window)."""
    if isinstance(window_left, torch.Tensor) and window_left.numel() == 1 and not window_left.dtype.is_floating_point:
        window_left = window_left.item()
    if isinstance(window_left, bool) or not hasattr(window_left, "__index__") or isinstance(window_left, torch.Tensor):
        raise ArgumentTypeError(f"window_left must be an int (-1: no window), got {type(window_left).__name__} "
                                f"{window_left!r}")
    value = operator.index(window_left)
    if value < -1:
        raise ArgumentValueError(f"window_left must be -1 (no window) or >= 0, got {value}")
    return value


def check_softcap(softcap: object) -> float:
    """Gemma's logit soft-cap: a finite float ``>= 0`` (``0``: off)."""
    value = check_real("softcap", softcap)
    if not math.isfinite(value) or value < 0:
        raise ArgumentValueError(f"softcap must be finite and >= 0 (0: off), got {value}")
    return value


#: dtypes a head vector (ALiBi slopes, sinks) may come in; it is converted once to float32 (vLLM and
#: FlashInfer take them in the model's dtype, gpt-oss ships bfloat16 sinks).
HEAD_VECTOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_head_vector(name: str, x: object, num_q_heads: int, device: torch.device, allow_neg_inf: bool,
                      read_values: bool = True) -> torch.Tensor:
    """ALiBi slopes or attention sinks as a contiguous ``float32 [num_q_heads]`` tensor on ``device``.

    Accepted: a 1-D float32, float16 or bfloat16 tensor on ``device`` (converted once, exactly, to
    float32), or a sequence of real numbers (rounded to float32), as vLLM and FlashInfer take them.
    The values must be finite (sinks: or ``-inf``); they are not read with ``read_values=False``.

    Raises:
        ArgumentTypeError: neither a tensor nor a sequence of real numbers (a bool or string entry).
        DTypeMismatchError: a tensor of another dtype (float64, an integer type).
        ShapeError: not ``[num_q_heads]``. DeviceMismatchError: a tensor on another device.
        ArgumentValueError: an entry that is NaN or infinite (sinks: ``+inf`` or NaN).
    """
    if isinstance(x, torch.Tensor):
        x = check_tensor(name, x, 1)
        if x.dtype not in HEAD_VECTOR_DTYPES:
            raise DTypeMismatchError(f"{name}.dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                                     f"got {x.dtype}")
        if x.device != torch.device(device):
            raise DeviceMismatchError(f"{name} is on {x.device}, query on {device}")
    else:
        if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__") or not hasattr(x, "__len__"):
            raise ArgumentTypeError(f"{name} must be a 1-D float tensor or a sequence of floats, "
                                    f"got {type(x).__name__}")
        x = torch.tensor([check_real(f"{name}[{i}]", v) for i, v in enumerate(x)], dtype=torch.float32,
                         device=device)
    if x.shape[0] != num_q_heads:
        raise ShapeError(f"{name} must be float32 [num_q_heads = {num_q_heads}], got shape {tuple(x.shape)}")
    x = x.to(torch.float32).contiguous()
    if not read_values:
        return x
    ok = torch.isfinite(x) | (x == float("-inf")) if allow_neg_inf else torch.isfinite(x)
    if not bool(ok.all()):
        i = int(torch.nonzero(~ok)[0][0])
        allowed = "finite or -inf" if allow_neg_inf else "finite"
        raise ArgumentValueError(f"{name}[{i}] must be {allowed}, got {float(x[i])}")
    return x


def as_head_vector(x: object, device: torch.device) -> torch.Tensor | None:
    """:func:`check_head_vector`'s normalisation without its checks (validation level ``"none"``)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float32).contiguous()
    return torch.tensor([float(v) for v in x], dtype=torch.float32, device=device)


#: Most split-K parts of one query tile's context (CUDA's limit of grid axis 2, where the Triton kernel puts them).
MAX_NUM_SPLITS = 65535


def check_num_splits(num_splits: object) -> int | None:
    """Split-K parts of each query tile's context (flash-decoding): ``None`` (the backend's heuristic) or
    an int in ``1 .. MAX_NUM_SPLITS`` (``1``: no split).

    Raises:
        ArgumentTypeError: not an int (a float, a bool, a string). ArgumentValueError: below 1 or above
            :data:`MAX_NUM_SPLITS`.
    """
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not hasattr(num_splits, "__index__") or isinstance(num_splits, torch.Tensor):
        raise ArgumentTypeError(f"num_splits must be an int or None (the heuristic), got {type(num_splits).__name__} "
                                f"{num_splits!r}")
    value = operator.index(num_splits)
    if not 1 <= value <= MAX_NUM_SPLITS:
        raise ArgumentValueError(f"num_splits must be in 1 .. {MAX_NUM_SPLITS} (1: no split), got {value}")
    return value
