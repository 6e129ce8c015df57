"""Dense attention: the shared math behind the gathering backends, and the fp64 reference.

Conventions (the backend contract, after flash-attn's varlen API):

- a sequence's query rows are its *last* ``q_len`` positions: row ``i`` sits at position
  ``seq_len - q_len + i`` and attends causally to positions ``0 .. seq_len - q_len + i``;
- GQA/MQA: query head ``h`` uses kv head ``h // (num_q_heads // num_kv_heads)``;
- ``scale`` defaults to ``1 / sqrt(head_dim)``.
"""

from __future__ import annotations

import math

import torch


def causal_mask(q_len: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``bool [q_len, seq_len]``: True where query row ``i`` may attend to key position ``j``.

    Row ``i`` is at position ``seq_len - q_len + i`` (the cached prefix comes first).
    """
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (seq_len - q_len)
    return torch.arange(seq_len, device=device).unsqueeze(0) <= rows


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of one sequence's new queries over its whole (gathered) context.

    Args:
        query: ``[q_len, num_q_heads, head_dim]``, the last ``q_len`` positions of the sequence.
        key, value: ``[seq_len, num_kv_heads, head_dim]`` with ``seq_len >= q_len``;
            ``num_q_heads % num_kv_heads == 0``.
        scale: logits multiplier; ``None`` means ``1 / sqrt(head_dim)``.
        compute_dtype: dtype of the math (float32 for the backends, float64 for the reference).

    Returns:
        ``[q_len, num_q_heads, head_dim]`` in ``query.dtype``. A row with ``q_len == 0`` input gives
        an empty output.
    """
    q_len, num_q_heads, head_dim = query.shape
    seq_len, num_kv_heads = key.shape[0], key.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if q_len == 0:
        return query.new_empty((0, num_q_heads, head_dim))
    group = num_q_heads // num_kv_heads
    q = query.to(compute_dtype).view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
    k = key.to(compute_dtype).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
    v = value.to(compute_dtype).permute(1, 0, 2).unsqueeze(1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, G, q, L]
    logits = logits.masked_fill(~causal_mask(q_len, seq_len, query.device), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, v)  # [Hkv, G, q, D]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(query.dtype)


def reference_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_start_loc: list[int], scale: float | None = None) -> torch.Tensor:
    """fp64 dense reference for a packed varlen batch, over *logical* (never paged) K/V.

    Args:
        query: ``[total_q, num_q_heads, head_dim]``.
        keys, values: one ``[seq_len_b, num_kv_heads, head_dim]`` tensor per sequence.
        query_start_loc: ``batch + 1`` cumulative query lengths.

    Returns:
        ``float64 [total_q, num_q_heads, head_dim]``.
    """
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        lo, hi = query_start_loc[b], query_start_loc[b + 1]
        out[lo:hi] = attend(query[lo:hi].to(torch.float64), k, v, scale, compute_dtype=torch.float64)
    return out


def paged_attention_by_gather(gather, query, k_cache, v_cache, args) -> torch.Tensor:
    """``paged_attention`` for a gathering backend: gather each sequence's K/V, then :func:`attend`.

    Args:
        gather: the backend's ``gather(cache, block_table, seq_len, validate=False)``.
        args: :class:`pagedkv.validation.AttentionArgs` from ``check_paged_attention``.

    Returns:
        ``[total_q, num_q_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    for b, seq_len in enumerate(args.seq_lens):
        lo, hi = args.q_starts[b], args.q_starts[b + 1]
        if hi == lo:
            continue
        key = gather(k_cache, args.block_tables[b], seq_len, validate=False)
        value = gather(v_cache, args.block_tables[b], seq_len, validate=False)
        out[lo:hi] = attend(query[lo:hi], key, value, args.scale)
    return out
