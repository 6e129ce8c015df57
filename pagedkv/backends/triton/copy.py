"""Token-tiled copy kernels of the ``triton`` backend and their launchers.

:func:`gather`, :func:`scatter`, :func:`write_kv` (vLLM ``reshape_and_cache``): a program copies a
``[BLOCK_T tokens, BLOCK_H heads, HEAD_DIM_PAD]`` tile. The innermost dim is head_dim, contiguous in an
NHD cache, so loads and stores vectorise; a token of a block is one contiguous ``num_kv_heads x
head_dim`` run. fp8 pools move raw bytes, and ``write_kv`` into an fp8 pool quantizes ``x / scale`` in
the kernel. The launchers do no argument checking and launch nothing for empty work; element offsets
are 64-bit.
"""

from __future__ import annotations

import torch

from pagedkv.backends.triton.launch_grid import copy_grid
from pagedkv.backends.triton.common import FP8_DTYPES, _f32_to_fp8, as_bytes, tl, triton

@triton.jit
def _head_tile(pid_h, num_kv_heads, stride_h, stride_d, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr):
    """``[1, BLOCK_H, HEAD_DIM_PAD]`` element offsets (int64) and mask of a tile's heads."""
    h = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
    off = h[None, :, None] * stride_h + d[None, None, :] * stride_d
    ok = (h[None, :, None] < num_kv_heads) & (d[None, None, :] < HEAD_DIM)
    return off, ok


@triton.jit
def _gather_kernel(
    out_ptr, cache_ptr, table_ptr, seq_len, num_kv_heads,
    stride_tn, stride_cb, stride_cs, stride_ch, stride_cd, stride_ot, stride_oh, stride_od,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pos = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tok_ok = pos < seq_len  # also keeps table reads within the first ceil(seq_len / block_size) entries
    blk = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_tn, mask=tok_ok, other=0).to(tl.int64)
    c_head, ok = _head_tile(tl.program_id(1), num_kv_heads, stride_ch, stride_cd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    o_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_oh, stride_od, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    mask = tok_ok[:, None, None] & ok
    src = (blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None, None] + c_head
    x = tl.load(cache_ptr + src, mask=mask)
    tl.store(out_ptr + (pos * stride_ot)[:, None, None] + o_head, x, mask=mask)


@triton.jit
def _scatter_kernel(
    cache_ptr, values_ptr, table_ptr, start, n, num_kv_heads,
    stride_tn, stride_cb, stride_cs, stride_ch, stride_cd, stride_vt, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    j = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tok_ok = j < n
    pos = start + j  # logical position written by values[j]
    blk = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_tn, mask=tok_ok, other=0).to(tl.int64)
    c_head, ok = _head_tile(tl.program_id(1), num_kv_heads, stride_ch, stride_cd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    v_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_vh, stride_vd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    mask = tok_ok[:, None, None] & ok
    x = tl.load(values_ptr + (j * stride_vt)[:, None, None] + v_head, mask=mask)
    dst = (blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None, None] + c_head
    tl.store(cache_ptr + dst, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slot_ptr, num_tokens, num_kv_heads,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    stride_kt, stride_kth, stride_ktd, stride_vt, stride_vth, stride_vtd,
    k_scale_ptr, v_scale_ptr,  # float32 [num_kv_heads] (IS_FP8)
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,  # V's width (MLA: 512 of K's 576)
    IS_FP8: tl.constexpr = False,  # the pools are uint8 views of float8 pools: store sat(x / scale)
    FP8_E4: tl.constexpr = True,  # float8_e4m3fn (max 448), else float8_e5m2 (max 57344)
    FP8_MAX: tl.constexpr = 448.0,
):
    i = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    slot = tl.load(slot_ptr + i, mask=i < num_tokens, other=-1).to(tl.int64)
    tok_ok = slot >= 0  # a negative slot is a padding token: skipped (vLLM reshape_and_cache)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    kc_head, ok = _head_tile(tl.program_id(1), num_kv_heads, stride_kh, stride_kd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    vc_head, v_ok = _head_tile(tl.program_id(1), num_kv_heads, stride_vh, stride_vd, BLOCK_H, HEAD_DIM_V,
                               HEAD_DIM_V_PAD)
    kt_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_kth, stride_ktd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    vt_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_vth, stride_vtd, BLOCK_H, HEAD_DIM_V,
                            HEAD_DIM_V_PAD)
    mask = tok_ok[:, None, None] & ok
    v_mask = tok_ok[:, None, None] & v_ok
    k = tl.load(key_ptr + (i * stride_kt)[:, None, None] + kt_head, mask=mask)
    v = tl.load(value_ptr + (i * stride_vt)[:, None, None] + vt_head, mask=v_mask)
    if IS_FP8:  # vLLM's scaled conversion: x / scale (IEEE division), saturated to the finite range, RNE
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ks = tl.broadcast_to(tl.load(k_scale_ptr + h, mask=h < num_kv_heads, other=1.0)[None, :, None],
                             (BLOCK_T, BLOCK_H, HEAD_DIM_PAD))
        vs = tl.broadcast_to(tl.load(v_scale_ptr + h, mask=h < num_kv_heads, other=1.0)[None, :, None],
                             (BLOCK_T, BLOCK_H, HEAD_DIM_V_PAD))
        k = tl.math.div_rn(k.to(tl.float32), ks)
        v = tl.math.div_rn(v.to(tl.float32), vs)
        # comparisons (not minimum/maximum) so that NaN stays NaN
        k = _f32_to_fp8(tl.where(k > FP8_MAX, FP8_MAX, tl.where(k < -FP8_MAX, -FP8_MAX, k)), FP8_E4)
        v = _f32_to_fp8(tl.where(v > FP8_MAX, FP8_MAX, tl.where(v < -FP8_MAX, -FP8_MAX, v)), FP8_E4)
    tl.store(k_cache_ptr + (blk * stride_kb + off * stride_ks)[:, None, None] + kc_head, k, mask=mask)
    tl.store(v_cache_ptr + (blk * stride_vb + off * stride_vs)[:, None, None] + vc_head, v, mask=v_mask)


def copy_config(num_kv_heads: int, head_dim: int, widest: int | None = None) -> dict:
    """Tile of the copy kernels: ~4096 elements (8 KiB in 16-bit), all heads of a token when they fit;
    ``widest``: the widest row the tile holds (``write_kv`` with V wider than K), ``head_dim`` by default."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    widest_pad = triton.next_power_of_2(max(head_dim, widest or head_dim))
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // widest_pad))
    block_t = max(1, min(64, 4096 // (block_h * widest_pad)))
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)


def _copy_grid(num_tokens: int, num_kv_heads: int, cfg: dict) -> tuple[int, int]:
    return copy_grid(num_tokens, num_kv_heads, cfg["BLOCK_T"], cfg["BLOCK_H"])


def gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions ``0 .. seq_len - 1`` of one sequence as a new contiguous ``[seq_len, H, D]`` tensor.

    ``block_table``: 1-D integer tensor on the cache's device (no checks: the caller validated).
    An fp8 pool is copied as raw bytes.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    out = cache.new_empty((seq_len, num_kv_heads, head_dim))
    if seq_len == 0:
        return out
    cfg = copy_config(num_kv_heads, head_dim)
    _gather_kernel[_copy_grid(seq_len, num_kv_heads, cfg)](
        as_bytes(out), as_bytes(cache), block_table, seq_len, num_kv_heads, block_table.stride(0), *cache.stride(),
        *out.stride(),
        BLOCK_SIZE=block_size, **cfg)
    return out


def scatter(cache: torch.Tensor, block_table: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Write ``values[j]`` (``[n, H, D]``) to logical position ``start + j`` in place (no checks)."""
    n = values.shape[0]
    if n == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    cfg = copy_config(num_kv_heads, head_dim)
    _scatter_kernel[_copy_grid(n, num_kv_heads, cfg)](
        as_bytes(cache), as_bytes(values), block_table, start, n, num_kv_heads, block_table.stride(0), *cache.stride(),
        *values.stride(), BLOCK_SIZE=block_size, **cfg)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """vLLM ``reshape_and_cache``: ``key[i]``/``value[i]`` to ``slot_mapping[i]``, negatives skipped (no checks).
    ``key [num_tokens, H, head_dim]``, ``value [num_tokens, H, head_dim_v]`` (V of its own width, as its pool).

    Into an fp8 pool (``k_scale``, ``v_scale``: contiguous ``float32 [num_kv_heads]``) the stored byte
    is ``sat(x / scale)`` rounded to nearest even, bit for bit :func:`pagedkv.attention.fp8.quantize`.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    head_dim_v = v_cache.shape[-1]  # V may be narrower or wider than K
    cfg = copy_config(num_kv_heads, head_dim, head_dim_v)
    cfg.update(HEAD_DIM_V=head_dim_v, HEAD_DIM_V_PAD=triton.next_power_of_2(head_dim_v))
    fp8 = k_cache.dtype in FP8_DTYPES
    flags = dict(IS_FP8=True, FP8_E4=k_cache.dtype == torch.float8_e4m3fn,
                 FP8_MAX=float(torch.finfo(k_cache.dtype).max)) if fp8 else {}
    _write_kv_kernel[_copy_grid(num_tokens, num_kv_heads, cfg)](
        as_bytes(k_cache), as_bytes(v_cache), key, value, slot_mapping, num_tokens, num_kv_heads,
        *k_cache.stride(), *v_cache.stride(), *key.stride(), *value.stride(),
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        BLOCK_SIZE=block_size, **cfg, **flags)
