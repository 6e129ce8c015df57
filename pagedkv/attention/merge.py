"""Partial attention states and their merge: the definition of ``merge_attn_states``.

Attention over a context cut into disjoint parts ``A`` and ``B`` is recovered from each part's output
and log-sum-exp (LSE: the log of the softmax denominator over the part's visible logits, the sink
included where there is one)::

    M = max(lse_A, lse_B)
    w_A = exp(lse_A - M), w_B = exp(lse_B - M)
    out = (w_A * out_A + w_B * out_B) / (w_A + w_B),   lse = M + log(w_A + w_B)

(vLLM's ``merge_attn_states``, FlashInfer's ``merge_state``; chunked-context prefill, cascade
attention, context parallelism and split-K decode all use it). A part with no visible key is
``out = 0, lse = -inf`` ("no keys"): merging with it returns the other part exactly (its weight is 0,
so its output is never read, whatever it holds), and two empty parts give ``out = 0, lse = -inf``,
never NaN. A NaN LSE stays NaN.

LSE layouts: ``"token_major"`` ``[total_q, num_heads]`` (FlashInfer) or ``"head_major"``
``[num_heads, total_q]`` (vLLM); bases ``"e"`` (natural log) or ``"2"`` (``log2``, what kernels that
run their softmax in ``exp2`` store).
"""

from __future__ import annotations

import math

import torch

from pagedkv.errors import ArgumentValueError, DeviceMismatchError, DTypeMismatchError, ShapeError

LSE_LAYOUTS = ("head_major", "token_major")
LSE_BASES = ("e", "2")


def to_token_major_e(lse: torch.Tensor, layout: str, base: str) -> torch.Tensor:
    """An LSE in ``layout`` / ``base`` as ``float64 [total_q, num_heads]`` natural logs."""
    x = lse.double()
    x = x.transpose(0, 1) if layout == "head_major" else x
    return x * math.log(2.0) if base == "2" else x


def from_token_major_e(lse: torch.Tensor, layout: str, base: str, dtype=torch.float32) -> torch.Tensor:
    """:func:`to_token_major_e`'s inverse: ``[total_q, num_heads]`` natural logs to ``layout`` / ``base``."""
    x = lse / math.log(2.0) if base == "2" else lse
    x = x.transpose(0, 1) if layout == "head_major" else x
    return x.to(dtype).contiguous()


def merge_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                 suffix_lse: torch.Tensor, base: str = "e",
                 compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge on token-major LSEs (no checks): the definition, in ``compute_dtype``.

    Args:
        prefix_out, suffix_out: ``[total_q, num_heads, head_dim_v]``.
        prefix_lse, suffix_lse: ``[total_q, num_heads]`` in ``base``.
        compute_dtype: float32 for a backend, float64 for the reference.

    Returns:
        ``(out, lse)``: ``out`` in ``prefix_out.dtype``, ``lse`` ``[total_q, num_heads]`` in ``compute_dtype``.
    """
    exp = torch.exp2 if base == "2" else torch.exp
    log = torch.log2 if base == "2" else torch.log
    p, s = prefix_lse.to(compute_dtype), suffix_lse.to(compute_dtype)
    m = torch.maximum(p, s)
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: no -inf - -inf = NaN
    wp, ws = exp(p - shift), exp(s - shift)
    total = wp + ws
    po = torch.where(wp[..., None] > 0, prefix_out.to(compute_dtype) * wp[..., None], 0.0)
    so = torch.where(ws[..., None] > 0, suffix_out.to(compute_dtype) * ws[..., None], 0.0)
    out = (po + so) / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    lse = torch.where(total == 0, torch.full_like(total, float("-inf")), shift + log(total))
    lse = torch.where(torch.isnan(p) | torch.isnan(s), torch.full_like(lse, float("nan")), lse)
    return out.to(prefix_out.dtype), lse


def check_merge_attn_states(prefix_out: object, prefix_lse: object, suffix_out: object, suffix_lse: object,
                            layout: str) -> None:
    """Validate ``merge_attn_states`` arguments.

    Raises:
        TypeError: an argument that is not a tensor.
        ShapeError: outputs not ``[total_q, num_heads, head_dim_v]`` and equal; an LSE not
            ``[num_heads, total_q]`` (``head_major``) / ``[total_q, num_heads]`` (``token_major``).
        DTypeMismatchError: outputs of different dtypes or not floating point; an LSE not float32.
        DeviceMismatchError: tensors on different devices.
        ArgumentValueError: ``layout`` unknown.
    """
    if layout not in LSE_LAYOUTS:
        raise ArgumentValueError(f"lse layout must be one of {LSE_LAYOUTS}, got {layout!r}")
    named = (("prefix_out", prefix_out), ("prefix_lse", prefix_lse), ("suffix_out", suffix_out),
             ("suffix_lse", suffix_lse))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if prefix_out.dim() != 3 or prefix_out.shape != suffix_out.shape:
        raise ShapeError(f"prefix_out and suffix_out must both be [total_q, num_heads, head_dim_v], got "
                         f"{tuple(prefix_out.shape)} and {tuple(suffix_out.shape)}")
    if prefix_out.dtype != suffix_out.dtype or not prefix_out.dtype.is_floating_point:
        raise DTypeMismatchError(f"prefix_out.dtype {prefix_out.dtype} and suffix_out.dtype {suffix_out.dtype} must "
                                 f"be one floating dtype")
    total_q, heads = prefix_out.shape[:2]
    want = (heads, total_q) if layout == "head_major" else (total_q, heads)
    for name, x in named[1::2]:
        if tuple(x.shape) != want:
            raise ShapeError(f"{name} must be {layout} {list(want)}, got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise DTypeMismatchError(f"{name}.dtype must be float32, got {x.dtype}")
    for name, x in named[1:]:
        if x.device != prefix_out.device:
            raise DeviceMismatchError(f"{name} is on {x.device}, prefix_out on {prefix_out.device}")


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor, *, layout: str = "token_major", base: str = "e",
                      validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states (vLLM ``merge_attn_states``, FlashInfer ``merge_state``), in torch.

    Args:
        prefix_out, suffix_out: ``[total_q, num_heads, head_dim_v]``, one float dtype, any strides.
        prefix_lse, suffix_lse: ``float32``, ``[num_heads, total_q]`` (``layout="head_major"``) or
            ``[total_q, num_heads]`` (``"token_major"``), in ``base`` (``"e"`` or ``"2"``); ``-inf``: no keys.
        validate: check the arguments first (:func:`check_merge_attn_states`).

    Returns:
        ``(out, lse)``: new tensors, ``out`` like ``prefix_out`` (contiguous), ``lse`` float32 in ``layout``
        and ``base``. Float32 math.

    Raises:
        as :func:`check_merge_attn_states`.
    """
    if validate:
        check_merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, layout)
    tm = (lambda x: x.transpose(0, 1)) if layout == "head_major" else (lambda x: x)
    out, lse = merge_states(prefix_out, tm(prefix_lse), suffix_out, tm(suffix_lse), base)
    return out.contiguous(), tm(lse).contiguous()


def reference_merge(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                    suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 merge on token-major natural-log LSEs: ``(float64 out, float64 lse)``."""
    return merge_states(prefix_out.double(), prefix_lse.double(), suffix_out.double(), suffix_lse.double(), "e",
                        torch.float64)
