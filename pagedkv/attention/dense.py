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


def feature_logits(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *, window_left: int = -1,
                   softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled logits to masked logits, in vLLM unified attention's order: softcap, + ALiBi, mask.

    Args:
        logits: ``scale * q . k``, ``[heads, q_len, n_keys]`` (any leading dims of heads; the last two
            are query rows and keys).
        q_pos, k_pos: absolute positions of the rows and keys (int tensors ``[q_len]``, ``[n_keys]``).
        window_left: a row at position ``p`` sees keys ``p - window_left .. p`` (``-1``: ``0 .. p``).
        softcap: ``logits -> softcap * tanh(logits / softcap)`` (Gemma 2), ``0``: off.
        alibi_slopes: ``[heads]`` (broadcast against the leading dims), bias ``slope * (k_pos - q_pos)``.

    Returns:
        Logits of the same shape and dtype with invisible keys at ``-inf``.
    """
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    rel = k_pos[None, :] - q_pos[:, None]  # [q_len, n_keys], <= 0 where visible
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(logits.dtype).reshape(*logits.shape[:-2], 1, 1)
        logits = logits + slopes * rel.to(logits.dtype)
    visible = rel <= 0
    if window_left >= 0:
        visible &= rel >= -window_left
    return logits.masked_fill(~visible, float("-inf"))


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim with one extra logit per head (``sinks``, ``[heads]``) in the denominator.

    gpt-oss / vLLM attention sinks: the sink joins the normalisation and carries no value, so the
    probabilities sum to ``1 - p_sink``. ``sinks=None`` is a plain softmax; a sink of ``-inf`` adds nothing.
    """
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.to(logits.dtype).reshape(*logits.shape[:-2], 1, 1).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
           compute_dtype: torch.dtype = torch.float32, *, window_left: int = -1, softcap: float = 0.0,
           alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           return_lse: bool = False, key_mask: torch.Tensor | None = None):
    """Causal attention of one sequence's new queries over its whole (gathered) context.

    Positions only matter through ``k - q`` (causal mask, window, ALiBi), so ``key``/``value`` may
    start at any position as long as they end at the last query's position.

    Args:
        query: ``[q_len, num_q_heads, head_dim]``, the last ``q_len`` positions of the sequence.
        key: ``[seq_len, num_kv_heads, head_dim]`` with ``seq_len >= q_len``; value ``[seq_len,
            num_kv_heads, head_dim_v]`` (``head_dim_v`` may differ: MLA's 576-wide K, 512-wide V);
            ``num_q_heads % num_kv_heads == 0``; fp8 when ``k_scale``/``v_scale`` are given.
        scale: logits multiplier; ``None`` means ``1 / sqrt(head_dim)``.
        compute_dtype: dtype of the math (float32 for the backends, float64 for the reference).
        window_left, softcap, alibi_slopes: see :func:`feature_logits` (slopes ``[num_q_heads]``).
        sinks: ``[num_q_heads]``, see :func:`softmax_with_sinks`.
        k_scale, v_scale: ``float32 [num_kv_heads]``: K/V are read as ``key * k_scale``, ``value * v_scale``.
        return_lse: also return each row's log-sum-exp (natural log) of its visible logits, the sink
            included (the log of the softmax denominator; vLLM's and FlashInfer's ``lse``).
        key_mask: ``bool [q_len, seq_len]``, ANDed with the causal / window mask: attention over a part
            of the context (a row with no visible key gives output 0 and LSE ``-inf``, or the sink's
            logit with a sink; never NaN).

    Returns:
        ``[q_len, num_q_heads, head_dim_v]`` in ``query.dtype``; with ``return_lse`` also
        ``[q_len, num_q_heads]`` in ``compute_dtype``. A row with ``q_len == 0`` input gives
        an empty output. The bits depend only on the values and shapes of the arguments, not on where
        ``query`` lies in memory (a slice of a packed batch at any offset gives the same bits).
    """
    q_len, num_q_heads, head_dim = query.shape
    seq_len, num_kv_heads, head_dim_v = key.shape[0], key.shape[1], value.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if q_len == 0:
        out = query.new_empty((0, num_q_heads, head_dim_v))
        return (out, torch.empty((0, num_q_heads), dtype=compute_dtype, device=query.device)) if return_lse else out
    group = num_q_heads // num_kv_heads
    key = key.to(compute_dtype) if k_scale is None else key.to(compute_dtype) * k_scale.to(compute_dtype).view(-1, 1)
    value = (value.to(compute_dtype) if v_scale is None
             else value.to(compute_dtype) * v_scale.to(compute_dtype).view(-1, 1))
    # [Hkv, G, q, D] in storage of its own: ``query`` is often a row slice of a packed batch, and MKL's
    # kernels pick their blocking by the operand's address, so a view would make the bits of this
    # sequence depend on where it sits in the batch (the batch-order invariance).
    q = query.to(compute_dtype).view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.clone(memory_format=torch.contiguous_format)
    k = key.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
    v = value.permute(1, 0, 2).unsqueeze(1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, G, q, L]
    sink = None if sinks is None else sinks.view(num_kv_heads, group)
    if window_left < 0 and softcap <= 0 and alibi_slopes is None and sinks is None:
        logits = logits.masked_fill(~causal_mask(q_len, seq_len, query.device), float("-inf"))
    else:
        k_pos = torch.arange(seq_len, device=query.device)
        logits = feature_logits(logits, k_pos[seq_len - q_len:], k_pos, window_left=window_left, softcap=softcap,
                                alibi_slopes=None if alibi_slopes is None else alibi_slopes.view(num_kv_heads, group))
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.to(query.device), float("-inf"))
    probs = softmax_with_sinks(logits, sink)
    out = torch.matmul(probs, v)  # [Hkv, G, q, Dv]
    out = out.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim_v)
    if not return_lse and key_mask is None:
        return out.to(query.dtype)
    lse = log_sum_exp(logits, sink)  # [Hkv, G, q]
    if key_mask is not None:  # a row with no visible key (and no sink): softmax's 0/0, the convention's 0
        empty = (lse == float("-inf")).permute(2, 0, 1).reshape(q_len, num_q_heads, 1)
        out = out.masked_fill(empty, 0.0)
    out = out.to(query.dtype)
    return (out, lse.permute(2, 0, 1).reshape(q_len, num_q_heads)) if return_lse else out


def log_sum_exp(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``log(sum(exp(logits)) + exp(sink))`` over the last dim (natural log; ``-inf`` where every logit
    and the sink are ``-inf``): the log of :func:`softmax_with_sinks`' denominator.

    Args:
        logits: ``[..., heads, rows, keys]`` (masked logits at ``-inf``).
        sinks: ``[..., heads]`` broadcast against the leading dims, or ``None``.
    """
    if sinks is not None:
        sink = sinks.to(logits.dtype).reshape(*logits.shape[:-2], 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    return torch.logsumexp(logits, dim=-1)


def reference_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        query_start_loc: list[int], scale: float | None = None, *, return_lse: bool = False,
                        key_masks: list[torch.Tensor | None] | None = None, **features):
    """fp64 dense reference for a packed varlen batch, over *logical* (never paged) K/V.

    Args:
        query: ``[total_q, num_q_heads, head_dim]``.
        keys, values: one ``[seq_len_b, num_kv_heads, head_dim]`` / ``[seq_len_b, num_kv_heads, head_dim_v]``
            tensor per sequence (fp8 with scales).
        query_start_loc: ``batch + 1`` cumulative query lengths.
        return_lse: also return the natural-log LSE ``float64 [total_q, num_q_heads]`` (token-major).
        key_masks: per sequence ``bool [q_len_b, seq_len_b]`` or ``None``: attention over that part of
            the context only (:func:`attend`'s ``key_mask``; no visible key: output 0, LSE ``-inf``).
        features: ``window_left``, ``softcap``, ``alibi_slopes``, ``sinks``, ``k_scale``, ``v_scale``
            as in :func:`attend`.

    Returns:
        ``float64 [total_q, num_q_heads, head_dim_v]`` (and the LSE with ``return_lse``).
    """
    head_dim_v = values[0].shape[-1] if values else query.shape[-1]
    out = torch.empty((*query.shape[:2], head_dim_v), dtype=torch.float64, device=query.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float64, device=query.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        lo, hi = query_start_loc[b], query_start_loc[b + 1]
        mask = None if key_masks is None else key_masks[b]
        o = attend(query[lo:hi].to(torch.float64), k, v, scale, compute_dtype=torch.float64, return_lse=True,
                   key_mask=mask, **features)
        out[lo:hi], lse[lo:hi] = o
    return (out, lse) if return_lse else out


def paged_attention_by_gather(gather, query, k_cache, v_cache, args) -> torch.Tensor:
    """``paged_attention`` for a gathering backend: gather each sequence's K/V, then :func:`attend`.

    With a window, only the blocks from the one holding the first visible key of the sequence's
    first query onwards are gathered: blocks wholly outside every row's window are never read.

    Args:
        gather: the backend's ``gather(cache, block_table, seq_len, validate=False)``.
        args: :class:`pagedkv.validation.calls.AttentionArgs` from ``check_paged_attention``.

    Returns:
        ``[total_q, num_q_heads, head_dim_v]`` in ``query.dtype``; with ``args.return_lse`` also the
        natural-log LSE, ``float32 [total_q, num_q_heads]`` (token-major).
    """
    out = query.new_empty((*query.shape[:2], v_cache.shape[-1]))
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if args.return_lse else None
    block_size = k_cache.shape[1]
    features = dict(window_left=args.window_left, softcap=args.softcap, alibi_slopes=args.alibi_slopes,
                    sinks=args.sinks, k_scale=args.k_scale, v_scale=args.v_scale)
    starts = args.q_starts  # host ints (read once here when the check did not)
    for b, seq_len in enumerate(args.seq_lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        first = 0 if args.window_left < 0 else max(0, seq_len - (hi - lo) - args.window_left) // block_size
        table = args.block_tables[b, first:]
        n = seq_len - first * block_size
        key = gather(k_cache, table, n, validate=False)
        value = gather(v_cache, table, n, validate=False)
        if lse is None:
            out[lo:hi] = attend(query[lo:hi], key, value, args.scale, **features)
        else:
            out[lo:hi], lse[lo:hi] = attend(query[lo:hi], key, value, args.scale, return_lse=True, **features)
    return out if lse is None else (out, lse)


def paged_attention_sync_free(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              scale: float, *, window_left: int = -1, softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                              max_elements: int = 1 << 25, return_lse: bool = False):
    """``paged_attention`` without reading any tensor on the host (capturable in a CUDA graph).

    Each query row finds its sequence in ``query_start_loc`` and attends over its sequence's whole
    table row (``max_blocks * block_size`` keys; padding ids clamped into the pool), with keys past its
    position, past ``seq_len`` or outside its window masked, and masked values zeroed (poison there
    cannot reach the output). Rows are processed in chunks of at most ``max_elements`` gathered K
    elements. Same order of operations as :func:`attend`; float32 math.

    Args:
        block_tables: ``int32``/``int64 [batch, max_blocks]``; seq_lens ``[batch]``; query_start_loc ``[batch + 1]``.
        scale: logits multiplier. Features as in :func:`attend` (slopes/sinks ``[num_q_heads]``, scales
            ``float32 [num_kv_heads]``).

        return_lse: also return the natural-log LSE ``float32 [total_q, num_q_heads]``.

    Returns:
        ``[total_q, num_q_heads, head_dim_v]`` in ``query.dtype`` (and the LSE with ``return_lse``).
    """
    total_q, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch, width = block_tables.shape
    out = query.new_empty((total_q, num_q_heads, v_cache.shape[-1]))
    lse = torch.full((total_q, num_q_heads), float("-inf"), dtype=torch.float32, device=query.device)
    if total_q == 0 or batch == 0 or width == 0:
        return (out.zero_(), lse) if return_lse else out.zero_()
    group = num_q_heads // num_kv_heads
    dev = query.device
    rows = torch.arange(total_q, device=dev)
    seq = torch.searchsorted(query_start_loc[1:].to(torch.int64), rows, right=True).clamp_(max=batch - 1)
    first_row = query_start_loc.to(torch.int64)[seq]
    q_len = query_start_loc.to(torch.int64)[seq + 1] - first_row
    lens = seq_lens.to(torch.int64)[seq]
    pos = lens - q_len + (rows - first_row)  # [total_q] absolute position of each row
    keys = width * block_size
    k_pos = torch.arange(keys, device=dev)
    chunk = max(1, max_elements // (keys * num_kv_heads * head_dim))
    for lo in range(0, total_q, chunk):
        hi = min(total_q, lo + chunk)
        ids = block_tables[seq[lo:hi]].to(torch.int64).clamp(0, num_blocks - 1)  # [c, width]
        rel = k_pos[None, :] - pos[lo:hi, None]  # [c, L]: <= 0 where causal
        visible = (rel <= 0) & (k_pos[None, :] < lens[lo:hi, None])
        if window_left >= 0:
            visible &= rel >= -window_left
        kv = []
        for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)):
            x = _rows(cache, ids).to(torch.float32)  # [c, L, Hkv, D]
            x = x if sc is None else x * sc.to(torch.float32).view(1, 1, -1, 1)
            kv.append(x)
        key, value = kv[0], kv[1].masked_fill(~visible[:, :, None, None], 0.0)
        q = query[lo:hi].to(torch.float32).view(hi - lo, num_kv_heads, group, head_dim)
        logits = torch.einsum("ckgd,clkd->kgcl", q, key) * scale  # [Hkv, G, c, L]
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.to(torch.float32).view(num_kv_heads, group, 1, 1) * rel.to(torch.float32)
        logits = logits.masked_fill(~visible, float("-inf"))
        sink = None if sinks is None else sinks.view(num_kv_heads, group)
        probs = softmax_with_sinks(logits, sink)
        out[lo:hi] = torch.einsum("kgcl,clkd->ckgd", probs, value).reshape(hi - lo, num_q_heads, -1)
        if return_lse:
            lse[lo:hi] = log_sum_exp(logits, sink).permute(2, 0, 1).reshape(hi - lo, num_q_heads)
    return (out, lse) if return_lse else out


def _rows(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]`` flattened to ``[rows, width * block_size, H, D]`` (fp8 pools indexed as bytes)."""
    fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    x = (cache.view(torch.uint8) if fp8 else cache)[ids]
    x = x.view(cache.dtype) if fp8 else x
    return x.reshape(ids.shape[0], -1, *cache.shape[2:])
