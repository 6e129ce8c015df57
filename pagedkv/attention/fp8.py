"""fp8 KV cache arithmetic: quantize on write, dequantize on read (vLLM's ``kv_cache_dtype="fp8"`` path).

A pool of dtype ``float8_e4m3fn`` or ``float8_e5m2`` stores ``x / scale`` and is read as
``stored * scale``; ``scale`` is per tensor or per kv head (``float32 [num_kv_heads]``), float32.

- :func:`quantize`: ``(x.float() / scale)`` in float32 (one IEEE division), clamped to the format's
  finite range (``+-448`` for e4m3fn, ``+-57344`` for e5m2: vLLM's and the hardware's *satfinite*
  conversion), then torch's round-to-nearest-even cast. NaN stays NaN (``0x7f``, sign kept).
- :func:`dequantize`: the exact fp8 value times the scale, rounded once in the compute dtype.

The Triton backend does the same arithmetic in its kernels, bit for bit (see
``pagedkv.backends.triton.kernels``).
"""

from __future__ import annotations

import torch

from pagedkv.validation.calls import FP8_DTYPES

__all__ = ["FP8_DTYPES", "dequantize", "is_fp8", "quantize"]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 pool dtypes (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, num_kv_heads, head_dim]`` float values to ``dtype`` (fp8) as ``sat(x / scale)``.

    Args:
        x: float32/float16/bfloat16 ``[..., num_kv_heads, head_dim]``.
        scale: float32 ``[num_kv_heads]`` (a per-tensor scale repeated), same device.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        A new tensor of ``x``'s shape in ``dtype``.
    """
    top = torch.finfo(dtype).max
    return (x.float() / scale.view(-1, 1)).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 ``[..., num_kv_heads, head_dim]`` to ``dtype`` as ``x * scale`` (one rounding in ``dtype``)."""
    return x.to(dtype) * scale.to(dtype).view(-1, 1)
