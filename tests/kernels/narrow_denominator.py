"""A plain-PyTorch paged attention whose softmax denominator is a float16 running sum, key by key.

Logits, maxima and the numerator are float32; only the denominator is narrow, so the output's
relative error is the running sum's: about 0.3% at 64 keys, 0.6% at 500 and 45% past 2048 (float16's
spacing there is 2: adding a weight of at most 1 rounds to nothing). The error grows with the
context, so a search of short contexts finds it only where outputs are large, and the long contexts
(``pagedkv.testing.strategies.batches.LONG_CONTEXTS``) find it everywhere.
Declares float16 and bfloat16 only, the space of the kernels where it was seen.
"""

from __future__ import annotations

import torch

from pagedkv.backends.capabilities import Capabilities

name = "narrow_denominator"
capabilities = Capabilities(dtypes={"float16", "bfloat16"})


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
    """Causal paged attention (``query [total_q, num_q_heads, head_dim]``, NHD pools) with a float16
    softmax denominator; returns ``[total_q, num_q_heads, head_dim]`` in the query's dtype."""
    _, bs, kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo or n == 0:
            continue
        pos = torch.arange(n)
        slots = block_tables[b][pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)  # [n, H, d]
        v = v_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        q = query[lo:hi].float()                                                                # [q, H, d]
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(n - (hi - lo), n)
        logits = logits.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        p = torch.exp(logits - logits.amax(-1, keepdim=True))
        denominator = torch.zeros(p.shape[:-1], dtype=torch.float16)
        for j in range(n):  # the planted fault: a float16 running sum
            denominator = denominator + p[..., j].half()
        o = torch.einsum("hqk,khd->qhd", p, v) / denominator.float().transpose(0, 1)[..., None]
        out[lo:hi] = o.to(query.dtype)
    return out
