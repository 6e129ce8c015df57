"""End to end, the fp8 KV cache: scales, the pools, and the oracle's quantize -> dequantize round trip.

With ``kv_cache_dtype="fp8_e4m3"`` (or ``"fp8_e5m2"``; ``"fp8"`` is e4m3, as in vLLM) every layer's
K and V pools are ``float8_e4m3fn`` (``float8_e5m2``); the backend's ``write_kv`` quantizes the
step's K/V with per-tensor scales and ``paged_attention`` dequantizes them
(:mod:`pagedkv.attention.fp8` defines both).

**Scales** (:func:`calculate_kv_scales`): vLLM's ``calculate_kv_scales``: on a layer's first call (the
first prefill step) ``k_scale = max|K| / 200`` and ``v_scale = max|V| / 100`` (vLLM's
``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``), rounded to float32, per layer, then fixed for the
run. The headroom (448 / 200 for e4m3) absorbs later tokens larger than the first batch's; larger
ones saturate, in the paged run and the oracle alike.

**The oracle** runs transformers' own eager attention of the same model in float64 with K and V
(after RoPE) replaced by their quantize -> dequantize round trip with the same scales
(:func:`fp8_oracle_attention`), so the paged run is compared with the model it actually serves.
Rounding to 3 (e4m3) or 2 (e5m2) mantissa bits is discontinuous: a float64 value that lies within
float32 rounding of the midpoint between two fp8 codes may round one way in float64 and the other
way from the paged run's float32 K, a whole fp8 step apart. There, and only there (the stored code
is a rounding of a value within :data:`BOUNDARY_RTOL` of the oracle's own, relative to the layer's
``max|K| / scale``), the oracle takes the stored code; every other element uses its own rounding, so
a wrong scale, a scale applied twice or a code from the wrong slot still moves the logits. The
count of such boundary elements is reported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from pagedkv.cache.config import KV_CACHE_DTYPES as CONFIG_KV_CACHE_DTYPES

#: ``--kv-cache-dtype`` names (vLLM's) to pool dtypes: :data:`pagedkv.cache.config.KV_CACHE_DTYPES` plus vLLM's
#: ``"fp8"`` alias of ``fp8_e4m3``; ``"auto"`` keeps the model's dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, **{name: dtype for name, dtype in CONFIG_KV_CACHE_DTYPES.items() if dtype is not None}}

#: vLLM's defaults: ``k_scale = max|K| / K_SCALE_CONSTANT``, ``v_scale = max|V| / V_SCALE_CONSTANT``.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0

#: how close (relative to ``max|x| / scale`` of the layer's tensor) a float64 value must lie to an fp8
#: rounding boundary for the oracle to accept the paged run's side of it (float32 noise is ~1e-7).
BOUNDARY_RTOL = 1e-5

#: attention implementation name of the fp8 oracle (registered with transformers).
FP8_ORACLE_IMPLEMENTATION = "pagedkv_fp8_oracle"

#: keyword argument carrying a :class:`Fp8OracleStep` through the oracle model's forward.
FP8_ORACLE_KWARG = "pagedkv_fp8_oracle"


def kv_cache_dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"auto"`` / ``None`` -> ``None`` (the model's dtype); ``"fp8_e4m3"`` etc. -> the fp8 dtype.

    Raises:
        ValueError: an unknown name.
    """
    if name is None or name == "auto":
        return None
    if isinstance(name, torch.dtype):
        if name in KV_CACHE_DTYPES.values():
            return name
    elif name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn -> "fp8_e4m3"``, ``torch.float8_e5m2 -> "fp8_e5m2"``."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else "fp8_e5m2"


def calculate_kv_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """vLLM's ``calculate_kv_scales``: ``(max|key| / 200, max|value| / 100)`` as float32 values.

    A tensor of zeros gets scale 1 (a zero scale is invalid).
    """
    def one(x: torch.Tensor, constant: float) -> float:
        s = float((x.detach().abs().amax().float() / constant).cpu())
        return s if s > 0 and s == s and s != float("inf") else 1.0

    return one(key, K_SCALE_CONSTANT), one(value, V_SCALE_CONSTANT)


def gather_codes(pool: torch.Tensor, block_table: list[int], n: int) -> torch.Tensor:
    """The stored bytes of positions ``0 .. n - 1`` of one sequence, ``[n, num_kv_heads, head_dim]`` (a copy)."""
    bs = pool.shape[1]
    table = torch.tensor(block_table, dtype=torch.int64)
    pos = torch.arange(n, dtype=torch.int64)
    slots = table[pos // bs] * bs + pos % bs
    return pool.reshape(-1, *pool.shape[2:])[slots.to(pool.device)].cpu().clone()


@dataclass
class BoundaryCount:
    """Elements the oracle quantized (``total``) and those where it took the stored code at a boundary."""

    total: int = 0
    adopted: int = 0


def round_trip(x: torch.Tensor, scale: float, dtype: torch.dtype, stored: torch.Tensor | None,
               count: BoundaryCount | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype, taking ``stored`` codes at rounding boundaries.

    Args:
        x: ``[..., T, num_kv_heads, head_dim]``-like float64 values (any shape whose leading rows are
            positions ``0 .. T - 1`` when ``stored`` is given).
        scale: the per-tensor scale.
        dtype: the fp8 dtype.
        stored: the paged run's codes of the first ``n <= T`` rows, or ``None``.
        count: updated with the number of elements and of boundary adoptions.
    """
    top = torch.finfo(dtype).max
    y = (x / scale).clamp(-top, top)
    # via float32, as torch casts to fp8: the double rounding matters only within float32 rounding of a
    # boundary, exactly where the stored code decides below
    own = y.to(torch.float32).to(dtype).to(x.dtype)
    if stored is not None and stored.shape[0] > 0:
        n = stored.shape[0]
        tol = BOUNDARY_RTOL * float(y.abs().amax())
        lo = (y[:n] - tol).clamp(-top, top).to(torch.float32).to(dtype).to(x.dtype)
        hi = (y[:n] + tol).clamp(-top, top).to(torch.float32).to(dtype).to(x.dtype)
        paged = stored.to(device=x.device).to(x.dtype)
        accept = (paged >= lo) & (paged <= hi)
        if count is not None:
            count.adopted += int((accept & (paged != own[:n])).sum())
        own = torch.cat([torch.where(accept, paged, own[:n]), own[n:]])
    if count is not None:
        count.total += own.numel()
    return own * scale


@dataclass
class Fp8OracleStep:
    """One request's context for :func:`fp8_oracle_attention`.

    Attributes:
        dtype: the fp8 pool dtype.
        scales: ``{layer: (k_scale, v_scale)}`` of the paged run.
        codes: ``{layer: (k_codes, v_codes)}``, the request's stored bytes ``[n, num_kv_heads, head_dim]``
            (``None``: no boundary adoption).
        count: boundary adoptions, summed over the run.
    """

    dtype: torch.dtype
    scales: dict[int, tuple[float, float]]
    codes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    count: BoundaryCount = field(default_factory=BoundaryCount)


def fp8_oracle_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs):
    """The model's own eager attention with K/V (``[1, num_kv_heads, T, head_dim]``) round-tripped through fp8."""
    ctx = kwargs.pop(FP8_ORACLE_KWARG)
    layer = module.layer_idx
    k_scale, v_scale = ctx.scales[layer]
    k_codes, v_codes = ctx.codes[layer] if ctx.codes is not None else (None, None)

    def rt(x: torch.Tensor, scale: float, stored: torch.Tensor | None) -> torch.Tensor:
        rows = x[0].transpose(0, 1)  # [T, H, D]
        return round_trip(rows, scale, ctx.dtype, stored, ctx.count).transpose(0, 1).unsqueeze(0)

    key, value = rt(key, k_scale, k_codes), rt(value, v_scale, v_codes)
    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


def register_fp8_oracle() -> str:
    """Register :func:`fp8_oracle_attention` (and transformers' eager mask for it); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FP8_ORACLE_IMPLEMENTATION, fp8_oracle_attention)
    AttentionMaskInterface.register(FP8_ORACLE_IMPLEMENTATION, eager_mask)
    return FP8_ORACLE_IMPLEMENTATION
