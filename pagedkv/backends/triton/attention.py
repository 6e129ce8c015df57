"""The fused paged-attention kernel of the ``triton`` backend, its split-K merge and its launcher.

:func:`paged_attention`: one kernel for decode (``q_len = 1``) and for prefill over a cached prefix
(``q_len > 1``, causal), packed varlen batches (flash-attn's ``cu_seqlens_q``) and any GQA/MQA group.
As in vLLM's paged attention it reads K/V straight from the blocks through the block table, one table
entry per token position, and never gathers them. Softmax is online (running max and sum,
FlashAttention): float32 logits and accumulators whatever the cache dtype.

Optional features, each behind a ``tl.constexpr`` flag so the plain path compiles to the same code as
without them (vLLM's ``unified_attention`` order): soft-cap (``HAS_SOFTCAP``), ALiBi (``HAS_ALIBI``),
sliding window (``HAS_WINDOW``: masked per row, and the key loop starts at the tile's first visible
key, so blocks before every row's window are never loaded), attention sinks (``HAS_SINKS``: the running
max and sum start at the sink), fp8 pools (``IS_FP8``: loaded as bytes, converted to float32 exactly
and multiplied by the kv head's scale).

Split-K decode (flash-decoding, ``SPLIT``): each query tile's keys are cut into ``num_splits`` parts in
whole ``BLOCK_N`` steps, one program each; every program stores its rows' partial running max ``m``,
sum ``l`` and accumulator (a part with no visible key stores ``m = -inf, l = 0``), and
:func:`_merge_splits_kernel` combines them: ``M = max m_s``, ``out = sum 2**(m_s - M) acc_s /
sum 2**(m_s - M) l_s``. The sink, when there is one, starts the first part only. A later part with no
key stores its empty partial before loading anything. Grids and the split
count: :mod:`pagedkv.backends.triton.launch_grid`.

The launcher does no argument checking (``pagedkv.backends.triton.backend`` validates first), reads nothing
from the device and launches nothing for empty work. Every tensor is addressed through explicit
strides and every element offset is formed in 64 bits.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.backends.triton.launch_grid import (attention_grid, choose_num_splits, cdiv, fixed_num_splits, merge_grid)
from pagedkv.backends.triton.common import LOG2E, FP8_DTYPES, _fp8_to_f32, _tanh, as_bytes, interpreting, tl, triton


@triton.jit
def _find_sequence(query_start_loc_ptr, target, batch, BLOCK_Q: tl.constexpr):
    """The last sequence ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= target`` (binary search)."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + batch
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2,  # scale * log2(e): the softmax is computed in base 2 (exp2 is the fast path on GPUs)
    softcap_in,  # scale / softcap (HAS_SOFTCAP): logits / softcap straight from q . k
    softcap_log2,  # softcap * log2(e)
    window_left,  # HAS_WINDOW: a row at position p sees keys p - window_left .. p
    alibi_ptr, sinks_ptr,  # float32 [num_q_heads] (HAS_ALIBI, HAS_SINKS)
    k_scale_ptr, v_scale_ptr,  # float32 [num_kv_heads] (IS_FP8)
    part_m_ptr, part_l_ptr, part_acc_ptr,  # SPLIT: float32 [num_splits, total_q, num_q_heads(, HEAD_DIM_V)]
    lse_ptr,  # RETURN_LSE (unsplit): float32, base 2, element (t, h) at t * stride_lse_t + h * stride_lse_h
    batch, total_q, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_lse_t, stride_lse_h,
    num_kv_heads,
    QUERIES_PER_KV: tl.constexpr,  # num_q_heads // num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (any positive int)
    HEAD_DIM: tl.constexpr,  # K's first piece: all of K, or its first HEAD_DIM_V columns when ROPE_DIM > 0
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    HEAD_DIM_V: tl.constexpr,  # V's width (the output's)
    HEAD_DIM_V_PAD: tl.constexpr,
    ROPE_DIM: tl.constexpr,  # K's columns past HEAD_DIM (MLA: 64 rope columns after the 512 latent), or 0
    ROPE_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_M // GROUP_TILE tokens x GROUP_TILE query heads
    GROUP_TILE: tl.constexpr,  # query heads of the group per program (the whole group but for MLA's 16..128)
    BLOCK_N: tl.constexpr,  # key positions per iteration
    UPCAST: tl.constexpr,  # do the dots in float32 (float32 caches, bfloat16 under the interpreter)
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
    HAS_ALIBI: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    IS_FP8: tl.constexpr = False,  # k/v caches are uint8 views of float8 pools
    FP8_E4: tl.constexpr = True,  # float8_e4m3fn (else float8_e5m2)
    SEARCH: tl.constexpr = False,  # programs enumerate packed query tiles (else program b = sequence b)
    SPLIT: tl.constexpr = False,  # write this split's partial (m, l, acc) instead of the output
    RETURN_LSE: tl.constexpr = False,  # also store each row's log2-sum-exp2 (unsplit; else the merge does)
):
    # One program: one sequence, one kv head, one tile of that sequence's query tokens (and with SPLIT
    # one part of the tile's keys). All query heads of the kv head's group share the tile, so each K/V
    # block is read once per group, not per head.
    pid = tl.program_id(0)
    GROUP_TILES: tl.constexpr = (QUERIES_PER_KV + GROUP_TILE - 1) // GROUP_TILE
    kv_head = (tl.program_id(1) // GROUP_TILES).to(tl.int64)
    group_tile = tl.program_id(1) % GROUP_TILES
    split = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_TILE
    if SEARCH:  # sequence s owns programs query_start_loc[s] // BLOCK_Q + s onwards (launch_grid)
        seq = _find_sequence(query_start_loc_ptr, pid, batch, BLOCK_Q)
        q_tile = pid - (tl.load(query_start_loc_ptr + seq).to(tl.int32) // BLOCK_Q + seq)
    else:
        seq = pid
        q_tile = 0

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:  # shorter sequence than the longest in the batch (or q_len = 0)
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # the new query tokens are the last q_len positions

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_tile * BLOCK_Q + rows // GROUP_TILE  # query token of each row, within the sequence
    g = group_tile * GROUP_TILE + rows % GROUP_TILE
    # GQA/MQA: query head h uses kv head h // QUERIES_PER_KV, so kv head k serves query heads
    # k * QUERIES_PER_KV .. k * QUERIES_PER_KV + QUERIES_PER_KV - 1.
    q_head = kv_head * QUERIES_PER_KV + g
    row_ok = (rows < BLOCK_Q * GROUP_TILE) & (q_tok < q_len) & (g < QUERIES_PER_KV)
    q_pos = context_len + q_tok  # row's position in the sequence: it sees keys 0 .. q_pos

    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)
    dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = dv < HEAD_DIM_V
    if SPLIT:
        # A later split whose part starts at or past the tile's last key has no key: it stores the partial it
        # would reach with nothing loaded (m = -inf, l = 0, acc = 0; a sink starts split 0 only), at once.
        # Short contexts cut in whole BLOCK_N steps leave most splits so.
        first_key = 0
        if HAS_WINDOW:
            first_key = tl.maximum(context_len + q_tile * BLOCK_Q - window_left, 0)
        tile_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
        if split > 0 and first_key + split * (tl.cdiv(tl.cdiv(tile_end - first_key, num_splits), BLOCK_N) * BLOCK_N) \
                >= tile_end:
            part = (split * total_q + q_rows) * (num_kv_heads * QUERIES_PER_KV) + q_head
            tl.store(part_m_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(part_l_ptr + part, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_V + dv[None, :],
                     tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32), mask=row_ok[:, None] & dv_ok[None, :])
            return
    q_off = q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if ROPE_DIM > 0:  # K's rope columns HEAD_DIM .. HEAD_DIM + ROPE_DIM - 1, a dot of their own
        dr = tl.arange(0, ROPE_PAD)
        dr_ok = dr < ROPE_DIM
        qr = tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + (HEAD_DIM + dr[None, :])
                     * stride_qd, mask=row_ok[:, None] & dr_ok[None, :], other=0.0)
        if UPCAST:
            qr = qr.to(tl.float32)

    if HAS_SINKS:
        # A sink is one more logit with no value: start the row at m = sink, l = exp2(sink - m) = 1. A -inf
        # sink (or a padding row) keeps m = -inf; the first visible key then rescales l by alpha = 0.
        m_i = tl.load(sinks_ptr + q_head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        if SPLIT:  # the first split alone starts at the sink
            m_i = tl.where(split == 0, m_i, float("-inf"))
            l_i = tl.where(split == 0, l_i, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's logits (base 2)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(logit - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32)  # running sum of exp2(logit - m_i) * v
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
    kv_hi = kv_end
    if SPLIT:  # this split's part of [kv_lo, kv_end), in whole BLOCK_N steps; a part may be empty
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_lo + chunk, kv_end)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_tb
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    for kv_start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = kv_start + offs_n
        blk_idx = kpos // BLOCK_SIZE
        # Only the first ceil(seq_len / block_size) table entries are read (the rest may be -1 padding).
        blk = tl.load(table_row + blk_idx * stride_tn, mask=blk_idx < num_seq_blocks, other=0).to(tl.int64)
        # Slots at positions >= seq_len (the tail of the last block) are not this sequence's and may
        # hold NaN: mask the load itself, since a zero softmax weight would not hide them (0 * NaN = NaN).
        tok_ok = kpos < seq_len
        slot = (kpos % BLOCK_SIZE).to(tl.int64)
        k_rows = k_head + blk[:, None] * stride_kb + slot[:, None] * stride_ks
        k = tl.load(k_rows + d[None, :] * stride_kd, mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vs + dv[None, :] * stride_vd,
                    mask=tok_ok[:, None] & dv_ok[None, :], other=0.0)
        if IS_FP8:  # exact fp8 value times the kv head's scale, rounded once in float32
            k = _fp8_to_f32(k, FP8_E4) * k_sc
            v = _fp8_to_f32(v, FP8_E4) * v_sc
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if ROPE_DIM > 0:
            kr = tl.load(k_rows + (HEAD_DIM + dr[None, :]) * stride_kd, mask=tok_ok[:, None] & dr_ok[None, :],
                         other=0.0)
            if IS_FP8:
                kr = _fp8_to_f32(kr, FP8_E4) * k_sc
            elif UPCAST:
                kr = kr.to(tl.float32)
            qk = tl.dot(qr, tl.trans(kr), qk, input_precision=DOT_PRECISION)

        if HAS_SOFTCAP:  # softcap * tanh(scale * q.k / softcap), in base 2
            s = _tanh(qk * softcap_in) * softcap_log2
        else:
            s = qk * scale_log2
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

    if SPLIT:  # partials, rows (split, token, q head) of dense float32 buffers; merged by _merge_splits_kernel
        part = (split * total_q + q_rows) * (num_kv_heads * QUERIES_PER_KV) + q_head
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_V + dv[None, :], acc,
                 mask=row_ok[:, None] & dv_ok[None, :])
    else:
        # Every stored row saw at least its own position, so l_i > 0 there; padding rows are not stored.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + dv[None, :] * stride_od
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        if RETURN_LSE:  # log2 of the denominator: m_i + log2(l_i); -inf for no key (and no sink)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + q_rows * stride_lse_t + q_head * stride_lse_h, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, lse_ptr, num_splits, total_q, num_q_heads,
                         stride_ot, stride_oh, stride_od, stride_lse_t, stride_lse_h, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr, RETURN_LSE: tl.constexpr = False):
    # One program: one query token x BLOCK_H query heads; the partials of their num_splits parts. Each head's
    # row is merged on its own, in the same order (a tile of heads, not one program a head: Triton's
    # interpreter pays per program and per op, a GPU reads the same bytes either way).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = head < num_q_heads
    row = tok * num_q_heads + head
    rows_per_split = total_q * num_q_heads
    m_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + s * rows_per_split + row, mask=h_ok, other=float("-inf")))
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    tile_ok = h_ok[:, None] & d_ok[None, :]
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32)
    for s in range(num_splits):
        r = s * rows_per_split + row
        m_s = tl.load(part_m_ptr + r, mask=h_ok, other=float("-inf"))
        # a part that saw no key (m = -inf) weighs 0; NaN partials stay NaN
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_shift))
        l_sum += w * tl.load(part_l_ptr + r, mask=h_ok, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + r[:, None] * HEAD_DIM + d[None, :], mask=tile_ok, other=0.0)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=tile_ok)
    if RETURN_LSE:  # an empty split weighs 0 above; all empty: -inf
        lse = tl.where(l_sum == 0.0, float("-inf"), m_shift + tl.log2(tl.where(l_sum == 0.0, 1.0, l_sum)))
        tl.store(lse_ptr + tok * stride_lse_t + head * stride_lse_h, lse, mask=h_ok)


#: Elements of a split-K merge program's accumulator tile (query heads x V's padded width): 16 heads of
#: 128 a program, 4 of MLA's 512.
MERGE_TILE = 2048


def merge_heads_per_program(head_dim_v_pad: int) -> int:
    """Query heads one split-K merge program combines: :data:`MERGE_TILE` elements, 16 heads at most (a
    constant of V's width, so the merge compiles no variant per head count)."""
    return max(1, min(16, MERGE_TILE // head_dim_v_pad))


def merge_num_warps(block_h: int, head_dim_v_pad: int) -> int:
    """Warps of a merge program over ``block_h`` heads of ``head_dim_v_pad`` elements: 4 from 1024 elements on."""
    return 4 if block_h * head_dim_v_pad >= 1024 else 2


def attention_config(num_queries_per_kv: int, head_dim: int, dtype: torch.dtype, max_q_len: int,
                     fp8: bool = False, head_dim_v: int | None = None) -> dict:
    """Tile sizes and launch options of :func:`paged_attention` (``python -m bench.compile_report`` checks them).

    Decode (``max_q_len == 1``) tiles one token x the whole GQA group (16 rows at least, the smallest
    tensor-core tile) with 4 warps; prefill tiles 64 rows (32 with float32 dots or head dims over
    128) with 8 warps. Both step through keys ``BLOCK_N`` at a time (at most 64 keys; K and V tiles
    of at most 4096 elements, 2048 in float32), so a row rounds the same whichever tiles its batch
    gets. ``dtype`` is the query's; with an fp8 pool (``fp8``) K/V are dequantized to float32 and the
    dots run in float32. Tile sizes and warps were chosen with the compile report
    (:mod:`bench.compile_report`) so that no configuration spills registers on sm_80 or
    sm_90.

    ``head_dim_v`` (default ``head_dim``): V's width. When it is below ``head_dim`` (MLA: 512 of 576), K is
    read as two pieces, its first ``head_dim_v`` columns (``HEAD_DIM``) and the rest (``ROPE_DIM``), each
    padded to a power of two on its own (576 as 512 + 64, not 1024).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    rope_dim = head_dim - head_dim_v if head_dim_v < head_dim else 0
    group_tile = num_queries_per_kv
    head_dim_pad = max(16, triton.next_power_of_2(head_dim - rope_dim))
    rope_pad = max(16, triton.next_power_of_2(rope_dim)) if rope_dim else 0
    head_dim_v_pad = max(16, triton.next_power_of_2(head_dim_v))
    widest = max(head_dim_pad + rope_pad, head_dim_v_pad)
    if widest >= 512 and num_queries_per_kv > 16:  # MLA: 16 query heads a program (a 16 x 512 accumulator)
        group_tile = 16
    group = triton.next_power_of_2(group_tile)
    upcast = fp8 or dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
    # Key tiles of at most 4096 elements (2048 in float32), the same for decode and prefill: a row sums
    # its keys in BLOCK_N steps, so a decode next to a prefill (prefill tiles) rounds as it does alone
    # (decode tiles): a request's output does not depend on its batch.
    fit = (2048 if upcast else 4096) // widest
    block_n = max(16, min(64, 1 << (fit.bit_length() - 1) if fit else 0))  # a power of two (K 32 + 8 rope: 48)
    if max_q_len <= 1:  # decode: one token x the GQA group, 16 rows at least, 4 warps
        block_m = max(16, group)
        num_warps = 4
    else:  # prefill: 64 rows (32 in float32 or past head_dim 128), 8 warps (a 32 x 256 float32 accumulator
        # is 32 registers a thread)
        block_m = max(32 if upcast or widest > 128 else 64, group)
        num_warps = 8
        if upcast and widest >= 512:  # float32 MLA: a 32-row tile of 512-wide rows spills on sm_90, 16 does not
            block_m, num_warps = max(16, group), 4
    return dict(
        QUERIES_PER_KV=num_queries_per_kv, GROUP_TILE=group_tile, HEAD_DIM=head_dim - rope_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEAD_DIM_V=head_dim_v, HEAD_DIM_V_PAD=head_dim_v_pad, ROPE_DIM=rope_dim, ROPE_PAD=rope_pad, BLOCK_M=block_m,
        BLOCK_N=block_n,
        # Triton's interpreter multiplies bfloat16 bit patterns as integers in tl.dot, so it gets float32
        # operands; on a GPU float16/bfloat16 operands use tensor cores with float32 accumulation
        # (their products are exact in float32).
        UPCAST=upcast,
        # float32 caches: full-precision dots, not TF32 (10-bit mantissa breaks float32 tolerance).
        DOT_PRECISION="ieee" if upcast else None,
        # fp8: software-pipelined byte loads feeding the float32 conversion spill (255 registers): 1 stage
        num_warps=num_warps, num_stages=1 if fp8 else 2,
        # tensor-core tiles: without an explicit limit ptxas caps some (8-warp prefill, 4-warp decode at
        # head_dim 256) at 128 registers and spills a few bytes rather than use more; the float32 FMA
        # dots spill with the limit (ptxas then schedules for 255 registers) and stay under 128 without it
        maxnreg=None if upcast else 255,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(query: torch.Tensor, batch: int, num_kv_heads: int, max_context: int, q_tiles: int,
                   decode: bool, num_splits: int | None = None) -> int:
    """The split count: ``num_splits`` if given, else the fixed one (:func:`launch_grid.splits`,
    ``$PAGEDKV_NUM_SPLITS``), else on CUDA :func:`launch_grid.choose_num_splits` for decode, else 1."""
    if num_splits is None:
        num_splits = fixed_num_splits()
    if num_splits is not None:
        return max(1, int(num_splits))
    if not decode or query.device.type != "cuda":
        return 1
    return choose_num_splits(batch, num_kv_heads, max_context, _num_sms(query.device.index or 0), q_tiles)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_q_len: int, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    num_splits: int | None = None, return_lse: bool = False):
    """Launch the fused paged-attention kernel (no argument checks: the caller validated).

    Args:
        query: ``[total_q, num_q_heads, head_dim]`` (any strides), packed by ``query_start_loc``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides); float8
            pools need ``k_scale`` and ``v_scale``.
        block_tables: ``int32``/``int64 [batch, max_blocks]``; seq_lens: ``int32``/``int64 [batch]``;
        query_start_loc: ``int32``/``int64 [batch + 1]`` from 0 to ``total_q``; all on the cache's device.
        scale: logits multiplier.
        max_q_len: the largest ``q_len`` or an upper bound (picks decode or prefill tiles and the grid); ``< 0``:
            unknown (no host read), bounded by ``total_q``, decode tiles when ``total_q <= batch``.
        window_left: ``>= 0``: sliding window (flash-attn's ``window_size[0]``); ``-1``: none.
        softcap: ``> 0``: logit soft-cap; ``0``: none.
        alibi_slopes, sinks: contiguous ``float32 [num_q_heads]`` or None.
        k_scale, v_scale: contiguous ``float32 [num_kv_heads]`` (fp8 pools).
        num_splits: split-K parts of each query tile's context (see :func:`num_splits_for`).
        return_lse: also return each row's LSE in base 2, ``float32 [num_q_heads, total_q]`` (head-major).

    Returns:
        A new contiguous ``[total_q, num_q_heads, head_dim_v]`` tensor in ``query.dtype`` (``head_dim_v``:
        ``v_cache``'s width), and with ``return_lse`` the LSE.
    """
    total_q, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    out = torch.empty((total_q, num_q_heads, head_dim_v), dtype=query.dtype, device=query.device)
    lse = torch.empty((num_q_heads, total_q), dtype=torch.float32, device=query.device) if return_lse else None
    result = (out, lse) if return_lse else out
    batch = seq_lens.shape[0]
    if total_q == 0 or batch == 0 or max_q_len == 0:
        return result
    # unknown (< 0, no host read): bounded by total_q; decode tiles when there are no more queries than
    # sequences (every tile is still served: the grid then enumerates packed query tiles)
    decode = max_q_len == 1 or (max_q_len < 0 and total_q <= batch)
    if max_q_len < 0:
        max_q_len = total_q
    fp8 = k_cache.dtype in FP8_DTYPES
    cfg = attention_config(num_q_heads // num_kv_heads, head_dim, query.dtype, 1 if decode else max_q_len, fp8,
                           head_dim_v)
    block_q = cfg["BLOCK_M"] // cfg["GROUP_TILE"]
    # keys a tile can see, bounded without reading the device: the table's width (or the window)
    max_context = block_tables.shape[1] * block_size
    if window_left >= 0:
        max_context = min(max_context, window_left + block_q)
    splits = num_splits_for(query, batch, num_kv_heads, max_context, 1 if decode else cdiv(max_q_len, block_q),
                            decode, num_splits)
    group_tiles = cdiv(cfg["QUERIES_PER_KV"], cfg["GROUP_TILE"])
    grid, search = attention_grid(batch, total_q, num_kv_heads * group_tiles, max_q_len, block_q, splits)
    flags = dict(HAS_WINDOW=window_left >= 0, HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None,
                 HAS_SINKS=sinks is not None, IS_FP8=fp8, FP8_E4=k_cache.dtype == torch.float8_e4m3fn,
                 SEARCH=search, SPLIT=splits > 1, RETURN_LSE=return_lse)
    unused = out  # never loaded: its flag is off
    lse_arg, lse_strides = (lse, (lse.stride(1), lse.stride(0))) if return_lse else (unused, (0, 0))
    part_m = part_l = part_acc = unused
    if splits > 1:
        part_m = torch.empty((splits, total_q, num_q_heads), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((splits, total_q, num_q_heads, head_dim_v), dtype=torch.float32, device=query.device)
    _paged_attention_kernel[grid](
        out, query, as_bytes(k_cache), as_bytes(v_cache), block_tables, seq_lens, query_start_loc,
        float(scale) * LOG2E,
        float(scale) / softcap if softcap > 0 else 0.0, softcap * LOG2E,
        max(int(window_left), 0),
        unused if alibi_slopes is None else alibi_slopes, unused if sinks is None else sinks,
        unused if k_scale is None else k_scale, unused if v_scale is None else v_scale,
        part_m, part_l, part_acc, lse_arg, batch, total_q, splits,
        *query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *lse_strides, num_kv_heads,
        BLOCK_SIZE=block_size, **cfg, **flags,
    )
    if splits > 1:
        block_h = merge_heads_per_program(cfg["HEAD_DIM_V_PAD"])
        _merge_splits_kernel[merge_grid(total_q, num_q_heads, block_h)](
            out, part_m, part_l, part_acc, lse_arg, splits, total_q, num_q_heads, *out.stride(), *lse_strides,
            HEAD_DIM=head_dim_v, HEAD_DIM_PAD=cfg["HEAD_DIM_V_PAD"], BLOCK_H=block_h, RETURN_LSE=return_lse,
            num_warps=merge_num_warps(block_h, cfg["HEAD_DIM_V_PAD"]))
    return result
