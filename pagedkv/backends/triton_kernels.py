"""Triton kernels of the ``triton`` backend, and their launchers.

- :func:`paged_attention`: one kernel for decode (``q_len = 1``) and for prefill over a cached prefix
  (``q_len > 1``, causal), packed varlen batches (flash-attn's ``cu_seqlens_q``) and any GQA/MQA group.
  As in vLLM's paged attention it reads K/V straight from the blocks through the block table, one
  table entry per token position, and never gathers them. Softmax is online (running max and sum,
  FlashAttention): float32 logits and accumulators whatever the cache dtype.
  Optional features, each behind a ``tl.constexpr`` flag so the plain path compiles to the same
  code as without them (vLLM's ``unified_attention`` order): soft-cap (``HAS_SOFTCAP``), ALiBi
  (``HAS_ALIBI``), sliding window (``HAS_WINDOW``: masked per row, and the key loop starts at the
  tile's first visible key, so blocks before every row's window are never loaded), attention sinks
  (``HAS_SINKS``: the running max and sum start at the sink), fp8 pools (``IS_FP8``: loaded as bytes,
  converted to float32 exactly and multiplied by the kv head's scale).
- :func:`gather`, :func:`scatter`, :func:`write_kv` (vLLM ``reshape_and_cache``): token-tiled copies;
  fp8 pools move raw bytes, and ``write_kv`` into an fp8 pool quantizes ``x / scale`` in the kernel.

The launchers do no argument checking (``pagedkv.backends.triton`` validates first) and launch
nothing for empty work. Every tensor is addressed through explicit strides, so non-contiguous cache
views such as ``kv[:, 0]`` of a ``[num_blocks, 2, block_size, H, D]`` tensor work, and every element
offset is formed in 64 bits (a pool can exceed 2**31 elements).

Without a CUDA device the kernels run on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before any kernel is defined, since Triton reads it when a kernel is decorated).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------


LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """float32 tanh from ``exp`` alone (Triton's interpreter has no libdevice): Cephes ``tanhf``.

    ``|x| < 0.625``: odd minimax polynomial (no cancellation near 0, so a huge soft-cap stays exact);
    else ``(1 - t) / (1 + t)`` with ``t = exp(-2|x|)`` (never overflows: ``t -> 0`` gives 1). ~2 ulp.
    """
    ax = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def _fp8_to_f32(b, E4: tl.constexpr):
    """fp8 bytes (``uint8``) to their exact float32 values, the same on every target and the interpreter.

    e5m2 is the top byte of a float16. e4m3fn shifted into a float16's exponent/mantissa fields is its
    value / 2**8 (subnormals included); its only NaN code is ``0x7f`` (sign ignored), which a float16
    would read as 480.
    """
    b = b.to(tl.int32)
    if E4:
        h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        x = h.to(tl.float32) * 256.0
        x = tl.where((b & 0x7F) == 0x7F, float("nan"), x)
    else:
        x = (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _f32_to_fp8(y, E4: tl.constexpr):
    """float32 (finite within the format's range, or NaN) to fp8 bytes, round to nearest even.

    Integer arithmetic on the float32 bits, so it is bit for bit torch's cast on every target (Triton's
    interpreter rounds fp8 conversions wrongly across a binade). Normal results rebias the exponent and
    round away ``23 - MAN`` mantissa bits (a carry moves into the exponent, as it must); fp8 subnormals
    shift the full significand further. NaN becomes ``0x7f`` with its sign, as torch does.
    """
    MAN: tl.constexpr = 3 if E4 else 2
    BIAS: tl.constexpr = 7 if E4 else 15
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    e8 = exp - (127 - BIAS)  # the fp8 biased exponent, if normal
    normal = e8 >= 1
    val = tl.where(normal, a - ((127 - BIAS) << 23), (a & 0x7FFFFF) | 0x800000)
    shift = tl.where(normal, 23 - MAN, tl.minimum(24 - MAN - e8, 31))
    q = val >> shift
    rem = val - (q << shift)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where(exp == 0, 0, q)  # zero and float32 subnormals: far below half the smallest fp8 step
    q = tl.where(a > 0x7F800000, 0x7F, q)
    return (q | sign).to(tl.uint8)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # scale * log2(e): the softmax is computed in base 2 (exp2 is the fast path on GPUs)
    softcap_in,  # scale / softcap (HAS_SOFTCAP): logits / softcap straight from q . k
    softcap_log2,  # softcap * log2(e)
    window_left,  # HAS_WINDOW: a row at position p sees keys p - window_left .. p
    alibi_ptr, sinks_ptr,  # float32 [num_q_heads] (HAS_ALIBI, HAS_SINKS)
    k_scale_ptr, v_scale_ptr,  # float32 [num_kv_heads] (IS_FP8)
    num_q_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    num_kv_heads,
    QUERIES_PER_KV: tl.constexpr,  # num_q_heads // num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (any positive int)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_M // QUERIES_PER_KV tokens x the whole group
    BLOCK_N: tl.constexpr,  # key positions per iteration
    UPCAST: tl.constexpr,  # do the dots in float32 (float32 caches, bfloat16 under the interpreter)
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
    HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    IS_FP8: tl.constexpr = False,  # k/v caches are uint8 views of float8 pools
    FP8_E4: tl.constexpr = True,  # float8_e4m3fn (else float8_e5m2)
):
    # One program: one sequence, one kv head, one tile of that sequence's query tokens. All query heads
    # of the kv head's group share the tile, so each K/V block is read once per group, not per head.
    pid = tl.program_id(0)
    seq = pid // num_q_tiles
    q_tile = pid % num_q_tiles
    kv_head = tl.program_id(1).to(tl.int64)
    BLOCK_Q: tl.constexpr = BLOCK_M // QUERIES_PER_KV

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:  # shorter sequence than the longest in the batch (or q_len = 0)
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # the new query tokens are the last q_len positions

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + rows // QUERIES_PER_KV  # query token of each row, within the sequence
    g = rows % QUERIES_PER_KV
    # GQA/MQA: query head h uses kv head h // QUERIES_PER_KV, so kv head k serves query heads
    # k * QUERIES_PER_KV .. k * QUERIES_PER_KV + QUERIES_PER_KV - 1.
    q_head = kv_head * QUERIES_PER_KV + g
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    q_pos = context_len + q_tok  # row's position in the sequence: it sees keys 0 .. q_pos

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_SINKS:
        # A sink is one more logit with no value: start the row at m = sink, l = exp2(sink - m) = 1. A -inf
        # sink (or a padding row) keeps m = -inf; the first visible key then rescales l by alpha = 0.
        m_i = tl.load(sinks_ptr + q_head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's logits (base 2)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)  # running sum of exp2(logit - m_i) * v
    if HAS_ALIBI:
        slope_log2 = tl.load(alibi_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    if IS_FP8:
        k_sc = tl.load(k_scale_ptr + kv_head)
        v_sc = tl.load(v_scale_ptr + kv_head)

    num_seq_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    # Causal: no row of this tile sees past the tile's last query token.
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_lo = 0
    if HAS_WINDOW:
        # Nor before the first row's window: start there, so whole blocks outside the window are never
        # loaded (decode with window W touches ceil(W / BLOCK_SIZE) + 1 blocks at most).
        kv_lo = tl.maximum(context_len + q_tile * BLOCK_Q - window_left, 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_tb
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_lo, kv_end, BLOCK_N):
        kpos = kv_start + offs_n
        blk_idx = kpos // BLOCK_SIZE
        # Only the first ceil(seq_len / block_size) table entries are read (the rest may be -1 padding).
        blk = tl.load(table_row + blk_idx * stride_tn, mask=blk_idx < num_seq_blocks, other=0).to(tl.int64)
        # Slots at positions >= seq_len (the tail of the last block) are not this sequence's and may
        # hold NaN: mask the load itself, since a zero softmax weight would not hide them (0 * NaN = NaN).
        tok_ok = kpos < seq_len
        slot = (kpos % BLOCK_SIZE).to(tl.int64)
        kv_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + blk[:, None] * stride_kb + slot[:, None] * stride_ks + d[None, :] * stride_kd,
                    mask=kv_mask, other=0.0)
        v = tl.load(v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :] * stride_vd,
                    mask=kv_mask, other=0.0)
        if IS_FP8:  # exact fp8 value times the kv head's scale, rounded once in float32
            k = _fp8_to_f32(k, FP8_E4) * k_sc
            v = _fp8_to_f32(v, FP8_E4) * v_sc
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        if HAS_SOFTCAP:  # softcap * tanh(scale * q.k / softcap), in base 2
            s = _tanh(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * softcap_in) * softcap_log2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_ALIBI:  # slope * (k_pos - q_pos), relative to each row's own position
            s += slope_log2[:, None] * (kpos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = (kpos[None, :] <= q_pos[:, None]) & tok_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] >= q_pos[:, None] - window_left)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees nothing yet (padding rows) keeps m = -inf: shift by 0 there, not by -inf,
        # so that exp2(-inf - -inf) = NaN never arises.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if UPCAST:
            acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        else:
            # 16-bit tensor-core operands: P as a 16-bit head plus its rounding remainder. P rounded
            # once errs by up to 2**-12 (float16) / 2**-9 (bfloat16) of sum(p * |v|), far above the
            # tolerance when |v| is large and the output cancels; head + remainder carry 22 / 16 bits.
            p_hi = p.to(v.dtype)
            acc = tl.dot(p_hi, v, acc)
            acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
        m_i = m_new

    # Every stored row saw at least its own position, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def interpreting() -> bool:
    """True when this module's kernels and Triton's own ``tl.*`` helpers were defined for the interpreter."""
    return all(type(fn).__name__ == "InterpretedFunction" for fn in (_paged_attention_kernel, tl.zeros))


def check_runnable() -> None:
    """Raise unless the kernels can run here: a CUDA device, or Triton's interpreter set up in full.

    Triton decorates its own ``tl.*`` helpers when ``triton`` is first imported, so an import of
    ``triton`` before ``TRITON_INTERPRET=1`` was set leaves them compiled-only and every launch fails.

    Raises:
        BackendUnavailableError: no CUDA device and the interpreter is off or was enabled too late.
    """
    if torch.cuda.is_available() or interpreting():
        return
    from pagedkv.errors import BackendUnavailableError

    raise BackendUnavailableError(
        "backend 'triton' has no CUDA device here and Triton is not in interpreter mode "
        f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} when triton was imported): set "
        "TRITON_INTERPRET=1 before importing triton, or import pagedkv's triton backend before triton")


def attention_config(num_queries_per_kv: int, head_dim: int, dtype: torch.dtype, max_q_len: int,
                     fp8: bool = False) -> dict:
    """Tile sizes and launch options of :func:`paged_attention`.

    Decode (``max_q_len == 1``) tiles one token x the whole GQA group (16 rows at least, the smallest
    tensor-core tile); prefill tiles 64 rows. ``BLOCK_N`` keeps a K or V tile at <= 16 KiB.
    ``dtype`` is the query's; with an fp8 pool (``fp8``) K/V are dequantized to float32 and the dots
    run in float32.
    """
    group = triton.next_power_of_2(num_queries_per_kv)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16 if max_q_len <= 1 else 64, group)
    elem = 4 if fp8 else torch.finfo(dtype).bits // 8
    block_n = max(16, min(64, 16384 // (head_dim_pad * elem)))
    upcast = fp8 or dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
    return dict(
        QUERIES_PER_KV=num_queries_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m,
        BLOCK_N=block_n,
        # Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot, so it gets float32
        # operands; on a GPU float16/bfloat16 operands use tensor cores with float32 accumulation
        # (their products are exact in float32).
        UPCAST=upcast,
        # float32 caches: full-precision dots, not TF32 (10-bit mantissa breaks float32 tolerance).
        DOT_PRECISION="ieee" if upcast else None,
        # 8 warps once the float32 accumulator tile reaches 64 x 256 (128 registers a thread at 4 warps).
        num_warps=8 if block_m * head_dim_pad >= 16384 else 4, num_stages=2,
    )


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_q_len: int, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the fused paged-attention kernel (no argument checks: the caller validated).

    Args:
        query: ``[total_q, num_q_heads, head_dim]`` (any strides), packed by ``query_start_loc``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides); float8
            pools need ``k_scale`` and ``v_scale``.
        block_tables: ``int32``/``int64 [batch, max_blocks]``; seq_lens: ``int32``/``int64 [batch]``;
        query_start_loc: ``int32``/``int64 [batch + 1]``; all on the cache's device.
        scale: logits multiplier.
        max_q_len: the largest ``q_len`` in the batch (sizes the grid).
        window_left: ``>= 0``: sliding window (flash-attn's ``window_size[0]``); ``-1``: none.
        softcap: ``> 0``: logit soft-cap; ``0``: none.
        alibi_slopes, sinks: contiguous ``float32 [num_q_heads]`` or None.
        k_scale, v_scale: contiguous ``float32 [num_kv_heads]`` (fp8 pools).

    Returns:
        A new contiguous ``[total_q, num_q_heads, head_dim]`` tensor in ``query.dtype``.
    """
    total_q, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((total_q, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    batch = seq_lens.shape[0]
    if total_q == 0 or batch == 0 or max_q_len == 0:
        return out
    fp8 = k_cache.dtype in _FP8
    cfg = attention_config(num_q_heads // num_kv_heads, head_dim, query.dtype, max_q_len, fp8)
    block_q = cfg["BLOCK_M"] // cfg["QUERIES_PER_KV"]
    num_q_tiles = triton.cdiv(max_q_len, block_q)
    grid = (batch * num_q_tiles, num_kv_heads)
    flags = dict(HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
                 HAS_SINKS=sinks is not None, IS_FP8=fp8, FP8_E4=k_cache.dtype == torch.float8_e4m3fn)
    unused = out  # never loaded: its flag is off
    _paged_attention_kernel[grid](
        out, query, _bytes(k_cache), _bytes(v_cache), block_tables, seq_lens, query_start_loc,
        float(scale) * LOG2E,
        float(scale) / softcap if softcap > 0 else 0.0, softcap * LOG2E,
        max(int(window_left), 0),
        unused if alibi_slopes is None else alibi_slopes, unused if sinks is None else sinks,
        unused if k_scale is None else k_scale, unused if v_scale is None else v_scale,
        num_q_tiles,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        num_kv_heads,
        BLOCK_SIZE=block_size, **cfg, **flags,
    )
    return out


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as a ``uint8`` view (same bytes, same strides); any other tensor as is."""
    return x.view(torch.uint8) if x.dtype in _FP8 else x


# ---------------------------------------------------------------------------------------------------
# Data movement: gather, scatter, write_kv
#
# A program copies a [BLOCK_T tokens, BLOCK_H heads, HEAD_DIM_PAD] tile. The innermost dim is head_dim,
# which is contiguous in an NHD cache, so loads and stores vectorise; a token of a block is one
# contiguous num_kv_heads * head_dim run.
# ---------------------------------------------------------------------------------------------------


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
    vc_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_vh, stride_vd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    kt_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_kth, stride_ktd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    vt_head, _ = _head_tile(tl.program_id(1), num_kv_heads, stride_vth, stride_vtd, BLOCK_H, HEAD_DIM, HEAD_DIM_PAD)
    mask = tok_ok[:, None, None] & ok
    k = tl.load(key_ptr + (i * stride_kt)[:, None, None] + kt_head, mask=mask)
    v = tl.load(value_ptr + (i * stride_vt)[:, None, None] + vt_head, mask=mask)
    if IS_FP8:  # vLLM's scaled conversion: x / scale (IEEE division), saturated to the finite range, RNE
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        shape = [BLOCK_T, BLOCK_H, HEAD_DIM_PAD]
        ks = tl.broadcast_to(tl.load(k_scale_ptr + h, mask=h < num_kv_heads, other=1.0)[None, :, None], shape)
        vs = tl.broadcast_to(tl.load(v_scale_ptr + h, mask=h < num_kv_heads, other=1.0)[None, :, None], shape)
        k = tl.math.div_rn(k.to(tl.float32), ks)
        v = tl.math.div_rn(v.to(tl.float32), vs)
        # comparisons (not minimum/maximum) so that NaN stays NaN
        k = _f32_to_fp8(tl.where(k > FP8_MAX, FP8_MAX, tl.where(k < -FP8_MAX, -FP8_MAX, k)), FP8_E4)
        v = _f32_to_fp8(tl.where(v > FP8_MAX, FP8_MAX, tl.where(v < -FP8_MAX, -FP8_MAX, v)), FP8_E4)
    tl.store(k_cache_ptr + (blk * stride_kb + off * stride_ks)[:, None, None] + kc_head, k, mask=mask)
    tl.store(v_cache_ptr + (blk * stride_vb + off * stride_vs)[:, None, None] + vc_head, v, mask=mask)


def copy_config(num_kv_heads: int, head_dim: int) -> dict:
    """Tile of the copy kernels: ~4096 elements (8 KiB in 16-bit), all heads of a token when they fit."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // head_dim_pad))
    block_t = max(1, min(64, 4096 // (block_h * head_dim_pad)))
    return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)


def _copy_grid(num_tokens: int, num_kv_heads: int, cfg: dict) -> tuple[int, int]:
    return triton.cdiv(num_tokens, cfg["BLOCK_T"]), triton.cdiv(num_kv_heads, cfg["BLOCK_H"])


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
        _bytes(out), _bytes(cache), block_table, seq_len, num_kv_heads, block_table.stride(0), *cache.stride(), *out.stride(),
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
        _bytes(cache), _bytes(values), block_table, start, n, num_kv_heads, block_table.stride(0), *cache.stride(),
        *values.stride(), BLOCK_SIZE=block_size, **cfg)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """vLLM ``reshape_and_cache``: ``key[i]``/``value[i]`` to ``slot_mapping[i]``, negatives skipped (no checks).

    Into an fp8 pool (``k_scale``, ``v_scale``: contiguous ``float32 [num_kv_heads]``) the stored byte
    is ``sat(x / scale)`` rounded to nearest even, bit for bit :func:`pagedkv.fp8.quantize`.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    cfg = copy_config(num_kv_heads, head_dim)
    fp8 = k_cache.dtype in _FP8
    flags = dict(IS_FP8=True, FP8_E4=k_cache.dtype == torch.float8_e4m3fn,
                 FP8_MAX=float(torch.finfo(k_cache.dtype).max)) if fp8 else {}
    _write_kv_kernel[_copy_grid(num_tokens, num_kv_heads, cfg)](
        _bytes(k_cache), _bytes(v_cache), key, value, slot_mapping, num_tokens, num_kv_heads,
        *k_cache.stride(), *v_cache.stride(), *key.stride(), *value.stride(),
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        BLOCK_SIZE=block_size, **cfg, **flags)
