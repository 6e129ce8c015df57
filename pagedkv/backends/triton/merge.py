"""The Triton merge of two partial attention states (vLLM's ``merge_attn_states`` Triton kernel's job).

One program per query token and tile of query heads, each head on its own: ``M = max(lse_p, lse_s)``,
weights ``2**(lse - M)``, the weighted mean of the two outputs and ``lse = M + log2(w_p + w_s)``, in base 2
and with head-major LSEs
(``[num_heads, total_q]``), the ``triton`` backend's declaration. A part with ``lse = -inf`` (no keys)
weighs 0 and its output is never read; two empty parts give ``out = 0, lse = -inf``. The definition is
:func:`pagedkv.attention.merge.merge_states`.
"""

from __future__ import annotations

import torch

from pagedkv.backends.triton.common import tl, triton
from pagedkv.backends.triton.attention import merge_heads_per_program, merge_num_warps
from pagedkv.backends.triton.launch_grid import merge_grid


@triton.jit
def _merge_states_kernel(out_ptr, lse_ptr, p_out_ptr, p_lse_ptr, s_out_ptr, s_lse_ptr, total_q, num_heads,
                         stride_ot, stride_oh, stride_od, stride_pt, stride_ph, stride_pd,
                         stride_st, stride_sh, stride_sd, stride_plh, stride_plt, stride_slh, stride_slt,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program: one query token x BLOCK_H heads, each head merged on its own.
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < num_heads
    p_lse = tl.load(p_lse_ptr + head * stride_plh + tok * stride_plt, mask=h_ok, other=float("-inf"))
    s_lse = tl.load(s_lse_ptr + head * stride_slh + tok * stride_slt, mask=h_ok, other=float("-inf"))
    m = tl.maximum(p_lse, s_lse)
    shift = tl.where(m == float("-inf"), 0.0, m)  # both parts empty: no -inf - -inf = NaN
    wp = tl.exp2(p_lse - shift)
    ws = tl.exp2(s_lse - shift)
    total = wp + ws
    d = tl.arange(0, HEAD_DIM_PAD)
    tile_ok = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    po = tl.load(p_out_ptr + tok * stride_pt + head[:, None] * stride_ph + d[None, :] * stride_pd, mask=tile_ok,
                 other=0.0)
    so = tl.load(s_out_ptr + tok * stride_st + head[:, None] * stride_sh + d[None, :] * stride_sd, mask=tile_ok,
                 other=0.0)
    # a part of weight 0 (no keys) adds nothing: whatever its output holds (NaN included) never reaches the merge
    acc = (tl.where(wp[:, None] > 0, po.to(tl.float32) * wp[:, None], 0.0)
           + tl.where(ws[:, None] > 0, so.to(tl.float32) * ws[:, None], 0.0))
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    lse = tl.where(total == 0.0, float("-inf"), shift + tl.log2(tl.where(total == 0.0, 1.0, total)))
    lse = tl.where((p_lse != p_lse) | (s_lse != s_lse), float("nan"), lse)
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + head * total_q + tok, lse, mask=h_ok)  # a new contiguous [num_heads, total_q]


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the merge (no checks: the caller validated).

    Args:
        prefix_out, suffix_out: ``[total_q, num_heads, head_dim_v]``, one float dtype, any strides.
        prefix_lse, suffix_lse: float32 ``[num_heads, total_q]`` in base 2, any strides.

    Returns:
        ``(out, lse)``: a new contiguous output like ``prefix_out`` and a new ``float32 [num_heads, total_q]``.
    """
    total_q, num_heads, head_dim = prefix_out.shape
    out = torch.empty((total_q, num_heads, head_dim), dtype=prefix_out.dtype, device=prefix_out.device)
    lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=prefix_out.device)
    if total_q == 0 or num_heads == 0:
        return out, lse
    pad = max(16, triton.next_power_of_2(head_dim))
    block_h = merge_heads_per_program(pad)
    _merge_states_kernel[merge_grid(total_q, num_heads, block_h)](
        out, lse, prefix_out, prefix_lse, suffix_out, suffix_lse, total_q, num_heads, *out.stride(),
        *prefix_out.stride(), *suffix_out.stride(), *prefix_lse.stride(), *suffix_lse.stride(), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pad, BLOCK_H=block_h, num_warps=merge_num_warps(block_h, pad))
    return out, lse
