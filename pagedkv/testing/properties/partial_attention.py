"""Partial attention: the LSE ``paged_attention`` returns, and ``merge_attn_states``, against one definition.

Attention over a context cut into disjoint parts, merged by the parts' outputs and log-sum-exps
(:mod:`pagedkv.attention.merge`), equals attention over the whole. The properties hold a candidate to
that for every cut :attr:`Case.cuts` draws (parts that are empty, or whose keys a window or
causality masks, included), in both directions: the candidate's ``paged_attention`` produces the parts
and pagedkv's fp64 merge combines them, and the fp64 reference produces the parts and the candidate's
``merge_attn_states`` combines them (both groupings of three parts: associativity). LSEs are compared
in natural log, token-major, after reading the candidate's declared layout and base
(``Capabilities.lse``, ``lse_base``).

A part of row ``r`` (at position ``p``) is its visible keys in ``[lo, hi)``. The candidate computes it
with an ordinary ``paged_attention`` call: the part's keys ``[lo, min(hi, p + 1))`` laid out in fresh
blocks of a pool of the case's layout (its unused slots poisoned), one decode row at their end. Its
query then sits ``d = p + 1 - min(hi, p + 1)`` positions early, so the call takes the window
``window_left - d`` (no key visible when negative: that part is "no keys" and not called) and an
ALiBi LSE is shifted back by ``slope * d``; the sink joins the last non-empty part only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedkv.attention.dense import reference_attention
from pagedkv.attention.merge import from_token_major_e, reference_merge, to_token_major_e
from pagedkv.backends.capabilities import capabilities_of
from pagedkv.testing.cases.case import Case, SeqSpec, reference_gather, reference_write
from pagedkv.testing.compare import Mismatch, assert_attention_close, require
from pagedkv.testing.properties.definitions import reference_output

#: LSE tolerance: ``atol = LSE_RTOL[dtype] * (1 + max |logit|)`` (the logits' own rounding, any base). A 16-bit
#: kernel computes the LSE in float32 from its inputs (products of two 16-bit values are exact in float32), so
#: bfloat16 takes float16's bound, not its own output's: an LSE 0.08 off (a denominator 8% off) passed 2e-2.
LSE_RTOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-3}


def declared_lse(backend: Any) -> tuple[str, str]:
    """``(layout, base)`` of the backend's LSE; raises :class:`~pagedkv.testing.compare.MissingOp` when it
    declares none (``Capabilities.lse``)."""
    from pagedkv.testing.compare import MissingOp

    caps = capabilities_of(backend)
    if caps.lse is None:
        raise MissingOp(f"{getattr(backend, 'name', backend)!r} declares no LSE (Capabilities.lse)")
    return caps.lse, caps.lse_base


def _rows(case: Case) -> list[tuple[int, int]]:
    """``(sequence, position)`` of every query row, in packed order."""
    return [(b, s.seq_len - s.q_len + i) for b, s in enumerate(case.seqs) for i in range(s.q_len)]


def _parts(case: Case) -> list[tuple[int, int]]:
    """Per sequence, ``[0, c_1), [c_1, c_2), ..., [c_k, inf)``: the parts its :attr:`Case.cuts` make."""
    out = []
    for b in range(len(case.seqs)):
        cuts = case.cuts[b] if b < len(case.cuts) else ()
        bounds = (0, *cuts, 1 << 62)
        out.append(list(zip(bounds[:-1], bounds[1:])))
    return out


def _check_lse(lse: torch.Tensor, expected: torch.Tensor, max_logit: float, dtype: str, what: str) -> None:
    """Natural-log LSEs equal within the tolerance; ``-inf`` exactly where expected; never NaN."""
    lse, expected = lse.double().cpu(), expected.double().cpu()
    if torch.isnan(lse).any():
        r, h = (int(x) for x in torch.nonzero(torch.isnan(lse))[0])
        raise Mismatch(f"{what}: LSE is NaN at row {r}, head {h} (expected {float(expected[r, h])!r})")
    empty = expected == float("-inf")
    if not torch.equal(lse == float("-inf"), empty):
        r, h = (int(x) for x in torch.nonzero((lse == float("-inf")) != empty)[0])
        raise Mismatch(f"{what}: row {r}, head {h}: LSE {float(lse[r, h])!r}, expected {float(expected[r, h])!r} "
                       f"(-inf: no visible key)")
    tol = LSE_RTOL[dtype] * (1.0 + max_logit)
    err = (lse - expected).abs().masked_fill(empty, 0.0)
    if err.numel() and float(err.max()) > tol:
        r, h = (int(x) for x in torch.nonzero(err == err.max())[0])
        raise Mismatch(f"{what}: row {r}, head {h}: LSE {float(lse[r, h])!r}, expected {float(expected[r, h])!r} "
                       f"(natural log; |error| {float(err[r, h]):.3g} > {tol:.3g})", {"row": r, "query_head": h})


def _call_lse(backend: Any, query, k_cache, v_cache, tables, seq_lens, qsl, scale, features, num_rows):
    """``paged_attention(..., return_lse=True)``: ``(out, lse)`` with the LSE natural-log, token-major."""
    layout, base = declared_lse(backend)
    result = backend.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale, **features,
                                     return_lse=True)
    if not isinstance(result, tuple) or len(result) != 2:
        raise Mismatch(f"paged_attention(..., return_lse=True) must return (out, lse), got {type(result).__name__}")
    out, lse = result
    heads = query.shape[1]
    want = (heads, num_rows) if layout == "head_major" else (num_rows, heads)
    if tuple(lse.shape) != want or lse.dtype != torch.float32:
        raise Mismatch(f"the LSE must be float32 {layout} {list(want)}, got {lse.dtype} {list(lse.shape)}")
    return out, to_token_major_e(lse.cpu(), layout, base)


# -- the LSE ---------------------------------------------------------------------------------------------
def lse_matches_reference(backend: Any, case: Case, device: str = "cpu") -> None:
    """``paged_attention(..., return_lse=True)`` returns the output of the contract and the fp64 reference's
    log-sum-exp of each row's visible logits (sink included) in the declared layout and base; poison in
    unused slots never reaches either; any drawn split count gives the same within the tolerance."""
    require(backend, "paged_attention")
    from pagedkv.testing.cases.ops import inputs

    a = inputs(case, device)
    out, lse = _call_lse(backend, a["query"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"],
                         a["query_start_loc"], a["scale"], a["features"], a["query"].shape[0])
    expected, max_logit, max_v = reference_output(case)
    _, ref_lse = _reference(case)
    try:
        assert_attention_close(out.cpu(), expected, max_abs_logit=max_logit, max_abs_value=max_v)
    except AssertionError as exc:
        raise Mismatch(f"paged_attention(..., return_lse=True) output vs fp64 reference: {exc}") from None
    _check_lse(lse, ref_lse, max_logit, case.geometry.dtype, "paged_attention's LSE vs fp64 reference")


def _reference(case: Case, key_masks=None, sinks: bool = True):
    """fp64 ``(out, lse)`` over the case's logical K/V (``key_masks``: per sequence, as
    :func:`~pagedkv.attention.dense.reference_attention`)."""
    k_cache, v_cache = case.caches("cpu")
    keys = [reference_gather(k_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    values = [reference_gather(v_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    features = dict(case.attention_features("cpu"))
    features.pop("num_splits", None)
    features.pop("k_scale", None), features.pop("v_scale", None)
    if case.kv_cache_dtype != "auto":
        features["k_scale"], features["v_scale"] = case.scale_vectors()
    if not sinks:
        features.pop("sinks", None)
    return reference_attention(case.query("cpu"), keys, values, case.query_start_loc_list, case.scale,
                               return_lse=True, key_masks=key_masks, **features)


def _part_masks(case: Case, j: int) -> list[torch.Tensor]:
    """Per sequence ``bool [q_len, seq_len]``: the keys of part ``j``."""
    parts = _parts(case)
    masks = []
    for b, s in enumerate(case.seqs):
        lo, hi = parts[b][j] if j < len(parts[b]) else (0, 0)
        pos = torch.arange(s.seq_len)
        masks.append(((pos >= lo) & (pos < hi)).expand(s.q_len, s.seq_len).clone())
    return masks


# -- a part computed by the candidate --------------------------------------------------------------------
def _candidate_part(backend: Any, case: Case, j: int, sink_part: list[int], device: str):
    """Part ``j`` of every row by the candidate's ``paged_attention``: ``(out, lse)`` (``float64``, lse
    natural-log token-major), ``0`` and ``-inf`` for rows where the part has no visible key."""
    g, bs = case.geometry, case.geometry.block_size
    rows, parts = _rows(case), _parts(case)
    k_pool, v_pool = case.caches("cpu")  # what the pools hold (repeated blocks: the later write)
    logical = [(reference_gather(k_pool, case.used_table(i), s.seq_len),
                reference_gather(v_pool, case.used_table(i), s.seq_len)) for i, s in enumerate(case.seqs)]
    query = case.query("cpu")
    heads = g.num_q_heads
    out = torch.zeros((len(rows), heads, g.v_dim), dtype=torch.float64)
    lse = torch.full((len(rows), heads), float("-inf"), dtype=torch.float64)
    calls: dict[tuple[int, bool], list[tuple[int, int, int, int]]] = {}  # (window, sink) -> rows
    for r, (b, p) in enumerate(rows):
        lo, hi = parts[b][j]
        end = min(hi, p + 1)
        if end <= lo:
            continue
        d = p + 1 - end
        window = -1
        if case.window_left >= 0:
            window = case.window_left - d  # the part's last key is d before the row: outside when negative
            if window < 0:
                continue
        calls.setdefault((window, sink_part[r] == j), []).append((r, b, lo, end))
    slopes = case.alibi_slopes("cpu").double() if case.alibi else None
    for (window, with_sink), members in calls.items():
        seqs, starts, total = [], [], 0
        for _, _, lo, end in members:
            n = end - lo
            need = -(-n // bs)
            seqs.append(SeqSpec(tuple(range(total, total + need)), n, 1))
            starts.append(total)
            total += need
        part_case = case.replace(geometry=dataclasses.replace(g, num_blocks=total), seqs=tuple(seqs), cuts=())
        k_cache, v_cache = part_case.empty_caches(device)
        for (_, b, lo, end), spec in zip(members, seqs):
            k, v = logical[b]
            reference_write(k_cache, spec.block_table, k[lo:end].to(device), 0)
            if case.layout != "latent":
                reference_write(v_cache, spec.block_table, v[lo:end].to(device), 0)
        features = dict(case.attention_features(device))
        features.pop("window_left", None)
        if window >= 0:
            features["window_left"] = window
        if not with_sink:
            features.pop("sinks", None)
        q = torch.stack([query[r] for r, *_ in members]).to(device)
        qsl = torch.arange(len(members) + 1, dtype=torch.int32, device=device)
        o, l_ = _call_lse(backend, q, k_cache, v_cache, part_case.block_tables(device), part_case.seq_lens(device),
                          qsl, case.scale, features, len(members))
        for i, (r, _, _, end) in enumerate(members):
            out[r] = o[i].cpu().double()
            lse[r] = l_[i]
            if slopes is not None:  # the call's query sat d positions early: its bias was slope * d higher
                lse[r] -= slopes * (rows[r][1] + 1 - end)
    return out, lse


def _sink_parts(case: Case) -> list[int]:
    """Per row, the part holding the sink: its last part with a key it sees (window and causality applied)."""
    out = []
    for b, p in _rows(case):
        first = 0 if case.window_left < 0 else max(0, p - case.window_left)
        last = 0
        for j, (lo, hi) in enumerate(_parts(case)[b]):
            if max(lo, first) < min(hi, p + 1):
                last = j
        out.append(last)
    return out


def _reference_parts(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """fp64 ``(out, lse)`` of every part; the sink joins each row's :func:`_sink_parts` part."""
    sink_part = _sink_parts(case)
    out = []
    for j in range(max(len(p) for p in _parts(case))):
        o_s, l_s = _reference(case, _part_masks(case, j), sinks=True)
        o_n, l_n = _reference(case, _part_masks(case, j), sinks=False)
        take = torch.tensor([sp == j for sp in sink_part], dtype=torch.bool).view(-1, 1)
        out.append((torch.where(take[..., None], o_s, o_n), torch.where(take, l_s, l_n)))
    return out


def merged_parts_equal_attention_over_the_whole(backend: Any, case: Case, device: str = "cpu") -> None:
    """The candidate's ``paged_attention`` over each part of a cut of the context (empty parts and parts a
    window or causality masks included), merged by pagedkv's fp64 merge, equals the fp64 reference over
    the whole context, output and LSE."""
    require(backend, "paged_attention")
    declared_lse(backend)
    whole, whole_lse = _reference(case)
    _, max_logit, max_v = reference_output(case)
    sink_part = _sink_parts(case)
    n_parts = max(len(p) for p in _parts(case))
    out, lse = _candidate_part(backend, case, 0, sink_part, device)
    for j in range(1, n_parts):
        o, l_ = _candidate_part(backend, case, j, sink_part, device)
        out, lse = reference_merge(out, lse, o, l_)
    try:
        assert_attention_close(out.to(case.geometry.torch_dtype), whole, max_abs_logit=max_logit, max_abs_value=max_v)
    except AssertionError as exc:
        raise Mismatch(f"merged parts (cuts {case.cuts}) vs attention over the whole: {exc}") from None
    _check_lse(lse, whole_lse, max_logit, case.geometry.dtype, f"merged LSE (cuts {case.cuts})")


# -- the candidate's merge ---------------------------------------------------------------------------------
def _candidate_merge(backend: Any, a: tuple, b: tuple, dtype: torch.dtype, device: str):
    """The candidate's ``merge_attn_states`` on token-major natural-log states: the same back, ``float64``."""
    layout, base = declared_lse(backend)
    result = backend.merge_attn_states(a[0].to(dtype).to(device), from_token_major_e(a[1], layout, base).to(device),
                                       b[0].to(dtype).to(device), from_token_major_e(b[1], layout, base).to(device))
    if not isinstance(result, tuple) or len(result) != 2:
        raise Mismatch(f"merge_attn_states must return (out, lse), got {type(result).__name__}")
    out, lse = result
    if out.shape != a[0].shape or out.dtype != dtype:
        raise Mismatch(f"merge_attn_states returned {out.dtype} {list(out.shape)}, expected {dtype} "
                       f"{list(a[0].shape)}")
    return out.cpu().double(), to_token_major_e(lse.cpu(), layout, base)


def merge_attn_states_of_parts_equals_the_whole(backend: Any, case: Case, device: str = "cpu") -> None:
    """The candidate's ``merge_attn_states`` of the fp64 reference's parts of a cut (empty parts, parts a
    window or causality masks) equals attention over the whole, output and LSE, and grouping three parts
    either way gives the same within the tolerance (associativity)."""
    require(backend, "merge_attn_states")
    declared_lse(backend)
    whole, whole_lse = _reference(case)
    _, max_logit, max_v = reference_output(case)
    parts = _reference_parts(case)
    dtype = case.geometry.torch_dtype
    parts = [(o.to(dtype).double(), l_) for o, l_ in parts]  # what a producer in the case's dtype hands over
    groupings = {"left": parts[0]}
    for p in parts[1:]:
        groupings["left"] = _candidate_merge(backend, groupings["left"], p, dtype, device)
    if len(parts) == 3:
        groupings["right"] = _candidate_merge(backend, parts[0], _candidate_merge(backend, parts[1], parts[2], dtype,
                                                                                  device), dtype, device)
    for name, (out, lse) in groupings.items():
        try:
            assert_attention_close(out.to(dtype), whole, max_abs_logit=max_logit, max_abs_value=max_v)
        except AssertionError as exc:
            raise Mismatch(f"merge_attn_states of {len(parts)} parts (cuts {case.cuts}, {name} grouping) vs the "
                           f"whole: {exc}") from None
        _check_lse(lse, whole_lse, max_logit, case.geometry.dtype,
                   f"merge_attn_states' LSE of {len(parts)} parts ({name} grouping, cuts {case.cuts})")


def merge_with_no_keys_is_exact(backend: Any, case: Case, device: str = "cpu") -> None:
    """Merging a state with "no keys" (``out = 0, lse = -inf``), on either side, returns that state bit for
    bit, output and LSE; two empty states give ``out = 0, lse = -inf``, never NaN."""
    require(backend, "merge_attn_states")
    layout, base = declared_lse(backend)
    out, lse = _reference(case, _part_masks(case, 0), sinks=True)  # the first part: empty for some cuts
    state = (out.to(case.geometry.torch_dtype).to(device), from_token_major_e(lse, layout, base).to(device))
    empty = (torch.zeros_like(state[0]), torch.full_like(state[1], float("-inf")))
    for name, a, b in (("state + empty", state, empty), ("empty + state", empty, state)):
        got_out, got_lse = backend.merge_attn_states(a[0], a[1], b[0], b[1])
        for what, got, want in (("output", got_out, state[0]), ("LSE", got_lse, state[1])):
            if got.shape != want.shape or not torch.equal(got.cpu(), want.cpu()):
                bad = torch.nonzero(got.cpu() != want.cpu()) if got.shape == want.shape else torch.zeros(1, 1)
                at = [int(x) for x in bad[0]] if bad.numel() else []
                raise Mismatch(f"merge_attn_states({name}) changed the state's {what} at {at}: "
                               f"{float(got.cpu()[tuple(at)]) if at else got.shape!r}, expected "
                               f"{float(want.cpu()[tuple(at)]) if at else want.shape!r} (a part of no keys must "
                               f"return the other part exactly)")
    got_out, got_lse = backend.merge_attn_states(empty[0], empty[1], empty[0].clone(), empty[1].clone())
    if torch.isnan(got_out).any() or not bool((got_out.cpu() == 0).all()):
        raise Mismatch("merge_attn_states of two empty parts (lse -inf) must give out = 0, got "
                       f"{'NaN' if torch.isnan(got_out).any() else 'non-zero values'}")
    if not bool((got_lse.cpu() == float("-inf")).all()):
        raise Mismatch(f"merge_attn_states of two empty parts must give lse = -inf, got "
                       f"{got_lse.flatten()[:4].tolist()}")


def lse_requires(caps: Any) -> str | None:
    """Why the LSE properties cannot run in ``caps``: no declared LSE (an optional output the backend does
    not declare: not covered, and outside the judged share's denominator, as an undeclared feature)."""
    if caps is not None and caps.lse is None:
        from pagedkv.testing.verdict import Skip, SkipReason

        return Skip("no LSE declared (Capabilities.lse / an LSE attribute): the LSE properties are not drawn",
                    SkipReason.FEATURE_NOT_DECLARED)
    return None


__all__ = ["lse_matches_reference", "merged_parts_equal_attention_over_the_whole",
           "merge_attn_states_of_parts_equals_the_whole", "merge_with_no_keys_is_exact"]
