"""The kind of an attention mismatch: which recognisable wrong attention the output equals.

A failing ``paged_attention`` is located at its worst element (:func:`pagedkv.testing.properties.
definitions.locate_attention`); many faults also have a *shape* a kernel writer recognises at once: a
causal mask shifted by one token, no causal mask, the default scale instead of the given one, query
heads mapped to the wrong kv head (GQA), a context that grows wrong with its length. :func:`mismatch_kind`
recomputes the case's attention in float64 under each of those hypotheses and names every one the
output matches within the usual tolerance (:func:`pagedkv.testing.compare.assert_attention_close`).

Only plain cases are classified (no window, soft-cap, ALiBi, sinks or fp8 pool): the hypotheses are
about the mask, the scale and the head mapping, which features would blur.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedkv.testing.compare import assert_attention_close


Mask = Callable[[int, int, int], torch.Tensor]


def _attend(query: torch.Tensor, keys: list, values: list, qsl: list[int], scale: float, group: int,
            visible: Mask, heads: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """float64 attention ``[total_q, num_q_heads, head_dim]`` where ``visible(q_len, n, shift)`` gives the
    ``[q_len, n]`` mask of each sequence and ``heads(num_q_heads, group)`` the kv head of each query head."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    num_q_heads = query.shape[1]
    kv_of = heads(num_q_heads, group)
    for b, (k, v) in enumerate(zip(keys, values)):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo or k.shape[0] == 0:
            continue
        q = query[lo:hi].double()
        kk, vv = k.double()[:, kv_of], v.double()[:, kv_of]                      # [n, H, d]
        logits = torch.einsum("qhd,khd->hqk", q, kk) * scale
        mask = visible(hi - lo, k.shape[0], 0)
        logits = logits.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(logits, -1).nan_to_num(0.0)                     # a row that sees nothing: 0
        out[lo:hi] = torch.einsum("hqk,khd->qhd", weights, vv)
    return out


def _causal(offset: int) -> Callable[[int, int, int], torch.Tensor]:
    def visible(q_len: int, n: int, _: int) -> torch.Tensor:
        pos = torch.arange(n - q_len, n).unsqueeze(1)
        return torch.arange(n).unsqueeze(0) <= pos + offset
    return visible


def _everything(q_len: int, n: int, _: int) -> torch.Tensor:
    return torch.ones((q_len, n), dtype=torch.bool)


def _grouped(num_q_heads: int, group: int) -> torch.Tensor:
    return torch.arange(num_q_heads) // group


def _interleaved(num_q_heads: int, group: int) -> torch.Tensor:
    return torch.arange(num_q_heads) % (num_q_heads // group)


def mismatch_kind(case: Any, actual: torch.Tensor, max_abs_logit: float, max_abs_value: float) -> str | None:
    """The recognisable wrong attention ``actual`` equals, as a phrase to follow "attention" ("with the
    causal mask shifted one token early (each query misses its own key)"), or ``None`` (none of them, or
    a case with features).

    Args:
        case: the :class:`~pagedkv.testing.cases.case.Case` that failed.
        actual: the candidate's output, ``[total_q, num_q_heads, head_dim]`` on the CPU.
        max_abs_logit, max_abs_value: the tolerance terms of the failed comparison.
    """
    from pagedkv.testing.cases.case import reference_gather

    if case.window_left >= 0 or case.softcap > 0 or case.alibi or case.sinks or case.kv_cache_dtype != "auto":
        return None
    g = case.geometry
    k_cache, v_cache = case.caches("cpu")
    keys = [reference_gather(k_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    values = [reference_gather(v_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    query, qsl = case.query("cpu"), case.query_start_loc_list
    scale = case.scale if case.scale is not None else g.head_dim ** -0.5
    group = g.num_queries_per_kv
    default = g.head_dim ** -0.5
    hypotheses = [(phrase, scale, mask, _grouped) for phrase, mask in (
        ("with the causal mask shifted one token early (each query misses its own key)", _causal(-1)),
        ("with the causal mask shifted one token late (each query also sees the next key)", _causal(1)),
        ("without the causal mask (every query sees its whole sequence)", _everything))]
    if abs(scale - default) > 1e-12:
        hypotheses.append((f"with the default scale head_dim**-0.5 = {default:.4g} instead of the given {scale:g}",
                           default, _causal(0), _grouped))
    if scale != 1.0:
        hypotheses.append(("without the scale (logits times 1.0)", 1.0, _causal(0), _grouped))
    if group > 1 and g.num_kv_heads > 1:
        hypotheses.append(("with query heads mapped to kv heads round-robin (h % num_kv_heads) instead of in "
                           "groups (h // group)", scale, _causal(0), _interleaved))
    matches = []
    for phrase, s, visible, heads in hypotheses:
        try:
            alternative = _attend(query, keys, values, qsl, s, group, visible, heads)
            assert_attention_close(actual, alternative, max_abs_logit=max_abs_logit, max_abs_value=max_abs_value)
        except AssertionError:
            continue
        matches.append(phrase)
    return " or ".join(matches) or None  # short prefills cannot tell some apart: both are named
