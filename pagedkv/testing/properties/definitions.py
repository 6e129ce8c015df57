"""The properties, as plain functions of ``(backend, case, device)``.

Each check builds the case's tensors, runs the backend and raises :class:`Mismatch` (an
``AssertionError``) on the first disagreement, naming the sequence, logical position, physical block
and slot. The pytest suite drives them with Hypothesis; ``python -m pagedkv replay`` reruns one
from a case file on any device, without Hypothesis.

What "equal" means is :mod:`pagedkv.testing.compare`: data movement bit for bit, attention within the
per-dtype tolerance of an fp64 reference.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.attention.dense import reference_attention
from pagedkv.backends import backend_name
from pagedkv.testing.cases.case import Case, reference_gather, reference_write, writable, write_slot_mapping
from pagedkv.testing.cases.ops import call_attention, inputs, run_ops
from pagedkv.testing.compare import Mismatch, MissingOp, assert_same_bits, bits, require  # noqa: F401 (re-exported)
from pagedkv.testing.properties.scenarios import (check_live_sequences, prefix_cache_transparent,  # noqa: F401 (moved)
                                       run_scenario, sharing_isolated)
from pagedkv.testing.compare import assert_attention_close, assert_bitwise_equal, target_attention_error
from pagedkv.testing.mismatch_kinds import mismatch_kind

GATHERING_BACKENDS = {"loop", "indexed"}  # attention = gather + the same dense op: bitwise equal to each other


def _locate(case: Case, seq: int, position: int) -> dict:
    bs = case.geometry.block_size
    block = case.seqs[seq].block_table[position // bs]
    return {"seq": seq, "position": position, "block": block, "slot": block * bs + position % bs}


def _compare_rows(actual: torch.Tensor, expected: torch.Tensor, case: Case, seq: int, what: str) -> None:
    """Bitwise row comparison of a gathered sequence, reporting the first bad logical position."""
    assert_same_bits(actual, expected, f"{what} of sequence {seq}", locate=lambda i: _locate(case, seq, i[0]))


def _slot_owner(case: Case, block: int, offset: int) -> dict:
    """``{"block", "slot"}`` of a pool row, plus the ``seq`` and ``position`` stored there, if any."""
    bs = case.geometry.block_size
    where = {"block": block, "slot": block * bs + offset}
    for i, s in enumerate(case.seqs):
        table = case.used_table(i)
        for p in range(offset, s.seq_len, bs):
            if table[p // bs] == block:
                return {"seq": i, "position": p, **where}
    return where


def _compare_pool(actual: torch.Tensor, expected: torch.Tensor, case: Case, what: str) -> None:
    """Bitwise pool comparison reporting the first bad slot (covers the frame condition)."""
    assert_same_bits(actual, expected, what, row_dims=2, locate=lambda i: _slot_owner(case, i[0], i[1]))


# -- data movement -------------------------------------------------------------------------------------
def gather_matches_definition(backend: Any, case: Case, device: str = "cpu") -> None:
    """Gather returns, bit for bit, ``cache[table[p // bs], p % bs]`` for every position, and writes nothing."""
    gather = require(backend, "gather")
    k_cache, _ = case.caches(device)
    before = k_cache.clone()
    tables = case.block_tables(device)
    for i, s in enumerate(case.seqs):
        out = gather(k_cache, tables[i], s.seq_len)
        _compare_rows(out, reference_gather(before, case.used_table(i), s.seq_len), case, i, "gather")
        if out.device != k_cache.device:
            raise Mismatch(f"gather returned a tensor on {out.device}, cache is on {k_cache.device}")
    _compare_pool(k_cache, before, case, "gather wrote to the pool")


def scatter_round_trip(backend: Any, case: Case, device: str = "cpu") -> None:
    """``scatter`` writes exactly positions ``start .. seq_len - 1`` of each sequence and nothing else
    (frame condition, bit for bit), and ``gather`` then returns what was written."""
    scatter, gather = require(backend, "scatter"), require(backend, "gather")
    new = case.stored_kv(1)
    tables = case.block_tables(device)
    for i in writable(case):
        s = case.seqs[i]
        k_cache, _ = case.caches(device)
        expected = k_cache.clone()
        values = new[i][0][s.start:].to(device)
        reference_write(expected, case.used_table(i), values, s.start)
        scatter(k_cache, tables[i], values, s.start)
        _compare_pool(k_cache, expected, case, f"scatter of sequence {i} (start {s.start}, n {values.shape[0]})")
        _compare_rows(gather(k_cache, tables[i], s.seq_len), reference_gather(expected, case.used_table(i), s.seq_len),
                      case, i, "gather after scatter")


def separate_pools(case: Case) -> Case:
    """``case`` with pools of their own where it is MLA's latent view: ``write_kv`` takes two pools that
    never overlap (the contract rejects one storage passed twice), so a latent cache is written through K."""
    return case.replace(layout="contiguous") if case.layout == "latent" else case


def write_kv_matches_definition(backend: Any, case: Case, device: str = "cpu") -> None:
    """``write_kv`` puts token ``t`` at ``slot_mapping[t]`` in both pools, skips negative slots and
    leaves every other slot bit-identical (fp8 pools: exactly ``pagedkv.attention.fp8.quantize`` of the token)."""
    write_kv = require(backend, "write_kv")
    case = separate_pools(case)
    slots, owners = write_slot_mapping(case)
    new = case.logical_kv(1)
    g = case.geometry
    key = torch.empty((len(slots), g.num_kv_heads, g.head_dim), dtype=g.torch_dtype)
    value = torch.empty((len(slots), g.num_kv_heads, g.v_dim), dtype=g.torch_dtype)
    for t, (i, p) in enumerate(owners):  # padding tokens carry values that must never land anywhere
        key[t] = new[i][0][p] if i >= 0 else float(t + 1000)
        value[t] = new[i][1][p] if i >= 0 else -float(t + 1000)
    k_cache, v_cache = case.caches(device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    k_stored, v_stored = case.stored(key, "k"), case.stored(value, "v")
    for t, slot in enumerate(slots):
        if slot >= 0:
            k_expected[slot // g.block_size, slot % g.block_size] = k_stored[t]
            v_expected[slot // g.block_size, slot % g.block_size] = v_stored[t]
    write_kv(k_cache, v_cache, key.to(device), value.to(device), torch.tensor(slots, dtype=torch.int64, device=device),
             **case.kv_scales(device))
    _compare_pool(k_cache, k_expected, case, "write_kv (k_cache)")
    _compare_pool(v_cache, v_expected, case, "write_kv (v_cache)")


# -- attention -----------------------------------------------------------------------------------------
def run_attention(backend: Any, case: Case, device: str = "cpu") -> torch.Tensor:
    """The backend's ``paged_attention`` on the case's caches, tables, lengths, queries and features:
    ``[total_q, num_heads, head_dim]`` on ``device``.

    Raises:
        MissingOp: the backend has no ``paged_attention``.
    """
    require(backend, "paged_attention")
    return call_attention(backend, inputs(case, device))


def reference_output(case: Case, **features) -> tuple[torch.Tensor, float, float]:
    """fp64 attention over the case's logical K/V (read by definition from the pool; an fp8 pool's
    stored bytes dequantized), with its features (``features`` override them), and the largest
    |logit| (the ALiBi bias and sinks included) and |V| (for the tolerance)."""
    k_cache, v_cache = case.caches("cpu")
    keys = [reference_gather(k_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    values = [reference_gather(v_cache, case.used_table(i), s.seq_len) for i, s in enumerate(case.seqs)]
    query = case.query("cpu")
    features = {**case.attention_features("cpu"), **features}
    features.pop("num_splits", None)  # how a kernel splits its work: the reference has one answer
    k_scale, v_scale = case.scale_vectors() if case.kv_cache_dtype != "auto" else (None, None)
    features.update(k_scale=k_scale, v_scale=v_scale)
    out = reference_attention(query, keys, values, case.query_start_loc_list, case.scale, **features)
    scale = case.scale if case.scale is not None else case.geometry.head_dim ** -0.5
    if k_scale is not None:  # the magnitudes of what attention reads
        keys = [k.double() * k_scale.double().view(-1, 1) for k in keys]
        values = [v.double() * v_scale.double().view(-1, 1) for v in values]
    q_max = float(query.double().abs().max()) if query.numel() else 0.0
    k_max = max((float(k.double().abs().max()) for k in keys if k.numel()), default=0.0)
    v_max = max((float(v.double().abs().max()) for v in values if v.numel()), default=1.0)
    logit = abs(scale) * q_max * k_max * case.geometry.head_dim
    if features.get("alibi_slopes") is not None:
        logit += float(features["alibi_slopes"].abs().max()) * max(case.seq_lens_list, default=0)
    if features.get("sinks") is not None:
        finite = features["sinks"][torch.isfinite(features["sinks"])]
        logit = max(logit, float(finite.abs().max()) if finite.numel() else 0.0)
    return out, logit, v_max


def attention_matches_reference(backend: Any, case: Case, device: str = "cpu") -> None:
    """``paged_attention`` equals the fp64 dense reference within the dtype's tolerance (NaN never passes)."""
    out = run_attention(backend, case, device)
    expected, max_logit, max_v = reference_output(case)
    if out.shape != expected.shape or out.dtype != case.geometry.torch_dtype:
        raise Mismatch(f"paged_attention returned {tuple(out.shape)} {out.dtype}, expected "
                       f"{tuple(expected.shape)} {case.geometry.torch_dtype}")
    try:
        assert_attention_close(out.cpu(), expected, max_abs_logit=max_logit, max_abs_value=max_v)
    except AssertionError as exc:
        where = locate_attention(case, out.cpu(), expected)
        kind = mismatch_kind(case, out.cpu(), max_logit, max_v)
        where.update({"kind": kind} if kind else {})
        shape = f"; the output equals attention {kind}" if kind else ""
        raise Mismatch(f"paged_attention vs fp64 reference at {describe_attention(where)}{shape}: {exc}",
                       where) from None
    target_attention_error(out.cpu(), expected, max_abs_logit=max_logit, max_abs_value=max_v)


def locate_attention(case: Case, actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Where an attention output is worst: ``{"seq", "position", "query_head", "kv_head", "dim", "blocks",
    "expected", "actual"}`` for the element of largest error (a non-finite one first).

    ``position`` is the query's position in its sequence (``seq_len - q_len + i``); ``blocks`` are the
    physical blocks its keys came from (the table entries up to that position)."""
    err = (actual.double() - expected.double()).abs()
    err = torch.where(torch.isfinite(actual), err, torch.full_like(err, float("inf")))
    row, head, dim = (int(x) for x in torch.nonzero(err == err.max())[0])
    bs = case.geometry.block_size
    seq, position = case.row_position(row)
    return {"seq": seq, "position": position, "query_head": head,
            "kv_head": head // case.geometry.num_queries_per_kv, "dim": dim,
            "blocks": list(case.used_table(seq)[: position // bs + 1]),
            "expected": [float(expected[row, head, dim])], "actual": [float(actual[row, head, dim])]}


def describe_attention(where: dict) -> str:
    """One line for :func:`locate_attention`'s dict (a long context's block list shortened to its ends)."""
    blocks = where["blocks"]
    if len(blocks) > 8:
        head, tail = ", ".join(map(str, blocks[:3])), ", ".join(map(str, blocks[-3:]))
        blocks = f"[{head}, ... {len(blocks) - 6} more ..., {tail}]"
    return (f"sequence {where['seq']}, query position {where['position']}, query head {where['query_head']} "
            f"(kv head {where['kv_head']}), dim {where['dim']}, keys from blocks {blocks}: got "
            f"{where['actual'][0]!r}, expected {where['expected'][0]!r}")


# -- agreement and invariances -----------------------------------------------------------------------
def backends_agree(backend: Any, other: Any, case: Case, device: str = "cpu") -> None:
    """Two backends agree on every op both provide: data movement bit for bit (gather, scatter, write_kv
    pools), attention bit for bit between gathering backends and within tolerance otherwise."""
    common = [op for op in ("gather", "scatter", "write_kv", "paged_attention")
              if callable(getattr(backend, op, None)) and callable(getattr(other, op, None))]
    if not common:
        raise MissingOp(f"{backend_name(backend)} and {backend_name(other)} share no op to compare")
    pair = f"{backend_name(backend)} vs {backend_name(other)}"
    a, b = run_ops(backend, case, device, tuple(common)), run_ops(other, case, device, tuple(common))
    _, max_logit, max_v = reference_output(case)
    for key in sorted(a, key=lambda k: "." in k):  # the outputs first, then the pools after the writes
        if key.startswith("gather"):
            i = int(key[key.index("[") + 1:-1])
            _compare_rows(a[key], b[key], case, i, f"{pair} gather")
        elif key == "paged_attention":
            qsl = case.query_start_loc_list
            for i in range(len(case.seqs)):
                _attention_agrees(a[key][qsl[i]:qsl[i + 1]], b[key][qsl[i]:qsl[i + 1]], backend, other,
                                  f"{pair} paged_attention[{i}]", i, max_logit, max_v)
        else:
            op, pool = key.split(".")
            _compare_pool(a[key], b[key], case, f"{pair} {op} {pool}")


def _attention_agrees(a: torch.Tensor, b: torch.Tensor, backend: Any, other: Any, what: str, seq: int,
                      max_logit: float, max_v: float) -> None:
    """One sequence's attention rows of two backends: bit for bit between gathering backends, else within
    the attention tolerance."""
    gathering = {backend_name(backend), backend_name(other)} <= GATHERING_BACKENDS
    try:
        if gathering:
            assert_bitwise_equal(a, b, f"{what}: ")
        else:
            assert_attention_close(a, b.double(), max_abs_logit=max_logit, max_abs_value=max_v)
    except AssertionError as exc:
        raise Mismatch(str(exc) if gathering else f"{what}: {exc}", {"seq": seq}) from None
