"""Blockwise paged attention in plain PyTorch: the fused kernel's algorithm, written to be read.

The Triton kernel (:mod:`pagedkv.backends.triton.kernels`) computes attention block by block with an online
softmax (FlashAttention's running max / running sum, as in vLLM's paged attention) and never gathers
K/V. This module does the same math with torch ops, one sequence and one cache block at a time, in
float32. Compared with the fp64 dense reference it separates the two ways the kernel can be wrong:
an error here is in the algorithm, an error only in the kernel is in the kernel.

Per query row, with ``m`` the largest logit so far, ``row_sum`` the sum of ``exp(logit - m)`` and ``acc``
the sum of ``exp(logit - m) * v``, each block of keys does::

    m_new = max(m, max(block logits));  alpha = exp(m - m_new)
    p = exp(block logits - m_new);  row_sum = row_sum * alpha + sum(p);  acc = acc * alpha + p @ V_block

and the output is ``acc / row_sum``.

Optional features (``docs/contract.md``), in vLLM unified attention's order: logits are
``scale * q . k``, soft-capped (``softcap * tanh(s / softcap)``), biased by ALiBi
(``slope * (k_pos - q_pos)``) and masked (causal, and ``q_pos - window_left <= k_pos``). Attention
sinks start each row at ``m = sink, row_sum = 1, acc = 0`` (the sink's ``exp(sink - m)`` joins the sum, with
no value). A window also skips every block that no query row of the sequence can see. An fp8 pool
is read as ``float32(stored) * scale``.
"""

from __future__ import annotations

import torch

from pagedkv.cache.config import blocks_needed
from pagedkv.validation.calls import attention_args

#: Optional attention features this implementation supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    validate: bool = True, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal varlen attention over paged K/V, block by block with an online softmax (float32).

    Args:
        query: ``[total_q, num_q_heads, head_dim]``, packed by ``query_start_loc``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides).
        block_tables: ``int32 [batch, max_blocks_per_seq]``, ``-1``-padded; only the first
            ``ceil(seq_len / block_size)`` entries of a row are read.
        seq_lens: ``int32 [batch]`` context lengths including the new query tokens.
        query_start_loc: ``int32 [batch + 1]`` (flash-attn's ``cu_seqlens_q``).
        scale: logits multiplier, default ``1 / sqrt(head_dim)``.
        validate: check arguments first (see :func:`pagedkv.validation.calls.check_paged_attention`).
        window_left: a query at position ``p`` sees keys ``p - window_left .. p``; ``-1``: no window.
        softcap: ``> 0`` soft-caps the logits (Gemma 2); ``0``: off.
        alibi_slopes: ``[num_q_heads]`` float32, float16 or bfloat16 (or a sequence of floats;
            converted once to float32): bias ``slope * (k_pos - q_pos)``.
        sinks: ``[num_q_heads]``, dtypes as the slopes: one extra logit per head in the denominator (gpt-oss).
        k_scale, v_scale: required for an fp8 pool: a float, or ``float32 [num_kv_heads]``.

    Returns:
        ``[total_q, num_q_heads, head_dim]`` in ``query.dtype``. Slots at positions ``>= seq_len``
        (the tail of the last block) and blocks wholly before every row's window are never read, so
        poison there cannot reach the output.

    Raises:
        as :func:`pagedkv.validation.calls.check_paged_attention`.
    """
    args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                          window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, supported=FEATURES)
    block_size = k_cache.shape[1]
    num_q_heads = query.shape[1]
    # GQA/MQA: query head h uses kv head h // group.
    kv_head_of = torch.arange(num_q_heads, device=query.device) // args.num_queries_per_kv
    slopes = None if args.alibi_slopes is None else args.alibi_slopes.float()[:, None, None]
    ks = None if args.k_scale is None else args.k_scale[kv_head_of][:, None, None]  # [num_q_heads, 1, 1]
    vs = None if args.v_scale is None else args.v_scale[kv_head_of][:, None, None]
    out = torch.empty_like(query)
    starts = args.q_starts  # host ints, read once
    for b, seq_len in enumerate(args.seq_lens):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        q = query[lo:hi].float().transpose(0, 1)  # [num_q_heads, q_len, head_dim]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # row i sits at seq_len - q_len + i
        if args.sinks is None:
            m = torch.full((num_q_heads, q_len), float("-inf"), device=query.device)
            row_sum = torch.zeros((num_q_heads, q_len), device=query.device)
        else:
            # the sink is a logit seen before any key: m = sink, row_sum = exp(sink - m) = 1 (a -inf sink adds nothing)
            m = args.sinks.float()[:, None].expand(num_q_heads, q_len).clone()
            row_sum = torch.ones((num_q_heads, q_len), device=query.device)
        acc = torch.zeros_like(q)
        first = 0 if args.window_left < 0 else max(0, seq_len - q_len - args.window_left) // block_size
        for i in range(first, blocks_needed(seq_len, block_size)):
            block = int(args.block_tables[b, i])
            n = min(block_size, seq_len - i * block_size)  # the last block's tail is not ours: not read
            k = k_cache[block, :n, kv_head_of].float().transpose(0, 1)  # [num_q_heads, n, head_dim]
            v = v_cache[block, :n, kv_head_of].float().transpose(0, 1)
            if ks is not None:  # fp8: the exact stored value times the scale, rounded once in float32
                k, v = k * ks, v * vs
            logits = torch.matmul(q, k.transpose(1, 2)) * args.scale  # [num_q_heads, q_len, n]
            if args.softcap > 0:
                logits = args.softcap * torch.tanh(logits / args.softcap)
            k_pos = torch.arange(i * block_size, i * block_size + n, device=query.device)
            rel = k_pos[None, None, :] - q_pos[None, :, None]  # key minus query position
            if slopes is not None:
                logits = logits + slopes * rel
            hidden = rel > 0
            if args.window_left >= 0:
                hidden |= rel < -args.window_left
            logits = logits.masked_fill(hidden, float("-inf"))
            m_new = torch.maximum(m, logits.amax(-1))
            # A row that sees no key yet keeps m = -inf; shift it by 0 so exp(-inf - -inf) = NaN never arises.
            m_shift = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m - m_shift)
            p = torch.exp(logits - m_shift[..., None])
            row_sum = row_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v)
            m = m_new
        out[lo:hi] = (acc / row_sum[..., None]).transpose(0, 1).to(query.dtype)
    return out
