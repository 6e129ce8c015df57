"""Invariance properties: outputs do not depend on how the same content is represented.

Each transform rewrites the backend inputs without changing what they mean (blocks renumbered with the
pool permuted, another padding value, int32 vs int64 tables, other poison in unowned slots, strided
pools, strided metadata over garbage, reversed batch order); gathers and attention must be
bit-identical. Also: a request alone equals itself in a batch, and decode token by token equals one
prefill and chunked prefill.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pagedkv.backends import backend_name
from pagedkv.backends.capabilities import capabilities_of
from pagedkv.testing.cases.case import FINITE_POISONS, Case
from pagedkv.testing.cases.ops import inputs, outputs
from pagedkv.testing.properties.definitions import reference_output, run_attention
from pagedkv.testing.compare import Mismatch, MissingOp, require
from pagedkv.testing.compare import assert_attention_close, assert_attention_identical, assert_bitwise_equal


def _owned_mask(case: Case, device) -> torch.Tensor:
    g = case.geometry
    mask = torch.zeros(g.num_blocks * g.block_size, dtype=torch.bool)
    mask[sorted(case.owned_slots())] = True
    return mask.view(g.num_blocks, g.block_size).to(device)


def _renumber(case: Case, args: dict) -> dict:
    perm = torch.randperm(case.geometry.num_blocks, generator=case._generator(4)).to(args["k_cache"].device)
    out = dict(args)
    for name in ("k_cache", "v_cache"):
        out[name] = torch.empty_like(args[name])
        out[name][perm] = args[name]
    tables = args["block_tables"].to(torch.int64)
    real = torch.zeros_like(tables, dtype=torch.bool)
    for i, s in enumerate(case.seqs):
        real[i, : len(s.block_table)] = True
    mapped = perm[torch.where(real, tables, torch.zeros_like(tables))]
    out["block_tables"] = torch.where(real, mapped, tables).to(args["block_tables"].dtype)
    return out


def _repad(case: Case, args: dict) -> dict:
    tables = args["block_tables"]
    wide = torch.full((tables.shape[0], tables.shape[1] + 2), case.geometry.num_blocks + 7, dtype=tables.dtype,
                      device=tables.device)
    for i, s in enumerate(case.seqs):
        wide[i, : len(s.block_table)] = tables[i, : len(s.block_table)]
    return {**args, "block_tables": wide}


def _repoison(case: Case, args: dict, finite: bool = False) -> dict:
    """Another poison in the unowned slots; with ``finite`` (a backend that declares
    ``finite_unused_slots``, on a case that keeps it) another finite one."""
    owned = _owned_mask(case, args["k_cache"].device)[..., None, None]
    other = {"nan": float("inf"), "inf": float("nan"), "sentinel": float("nan"), "zero": float("nan")}[case.poison]
    if finite and case.poison in FINITE_POISONS:
        other = 0.0 if case.poison == "sentinel" else torch.finfo(args["k_cache"].dtype).max
    fill = torch.tensor(other, device=args["k_cache"].device).to(args["k_cache"].dtype)  # fp8: saturating cast
    return {**args, **{n: torch.where(owned, args[n], fill) for n in ("k_cache", "v_cache")}}


def _relayout(case: Case, args: dict) -> dict:
    """Contiguous pools to views of one wider tensor (``[num_blocks, 2, block_size, H, D]`` for pools of
    one width, ``[..., H, D + D_v]`` columns side by side for two), strided pools to contiguous copies.
    MLA's latent view stays a view of K (:func:`_tie_latent`)."""
    k, v = args["k_cache"], args["v_cache"]
    if not k.is_contiguous():
        return {**args, "k_cache": k.contiguous(), "v_cache": v.contiguous()}
    if k.shape == v.shape:
        kv = torch.stack((k, v), dim=1)
        return {**args, "k_cache": kv[:, 0], "v_cache": kv[:, 1]}
    wide = torch.cat((k, v), dim=-1)
    return {**args, "k_cache": wide[..., :k.shape[-1]], "v_cache": wide[..., k.shape[-1]:]}


def _tie_latent(case: Case, args: dict) -> dict:
    """MLA's latent cache after a transform: V is again the first ``head_dim_v`` columns of K's storage
    (a transform rewrites each pool; the latent view must stay one storage)."""
    if case.layout != "latent":
        return args
    return {**args, "v_cache": args["k_cache"][..., :case.geometry.v_dim]}


def _strided_metadata(case: Case, args: dict) -> dict:
    """``block_tables``, ``seq_lens`` and ``query_start_loc`` as every-other-element views of larger
    tensors whose skipped elements hold garbage (a kernel that assumes dense metadata reads it)."""
    out = dict(args)
    for name, garbage in (("block_tables", case.geometry.num_blocks + 1000), ("seq_lens", 2**30),
                          ("query_start_loc", 2**30)):
        x = args[name]
        wide = torch.full((*x.shape[:-1], 2 * x.shape[-1]), garbage, dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        out[name] = wide[..., ::2]
    return out


def _reverse_batch(case: Case, args: dict) -> dict:
    qsl = args["query_start_loc"].tolist()
    n = len(qsl) - 1
    q_parts = [args["query"][qsl[i]:qsl[i + 1]] for i in reversed(range(n))]
    lens = [qsl[i + 1] - qsl[i] for i in reversed(range(n))]
    new_qsl = torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                           device=args["query_start_loc"].device)
    return {**args, "query": torch.cat(q_parts) if q_parts else args["query"], "query_start_loc": new_qsl,
            "block_tables": args["block_tables"].flip(0), "seq_lens": args["seq_lens"].flip(0)}


# name -> transform of the backend inputs (same pool content, same queries, other representation)
TRANSFORMS: dict[str, Callable[[Case, dict], dict]] = {
    "renumber_blocks": _renumber,
    "pad_value": _repad,
    "table_dtype": lambda case, a: {**a, "block_tables": a["block_tables"].to(
        torch.int64 if a["block_tables"].dtype == torch.int32 else torch.int32)},
    "poison": _repoison,
    "layout": _relayout,
    "strided_metadata": _strided_metadata,
    "batch_order": _reverse_batch,
}


def invariant_under(backend: Any, case: Case, device: str = "cpu", *, transform: str) -> None:
    """Outputs (gathers and attention) are bit-identical after ``transform`` of the inputs: physical
    blocks renumbered (pool permuted, tables mapped), another padding value, int32 vs int64 tables,
    other poison in unowned slots, strided pools, strided metadata, reversed batch order."""
    args = inputs(case, device)
    a = outputs(backend, args)
    if not a:
        raise MissingOp(f"{backend_name(backend)} provides neither gather nor paged_attention")
    change = TRANSFORMS[transform]
    if transform == "poison" and "finite_unused_slots" in capabilities_of(backend).preconditions:
        change = partial(_repoison, finite=True)  # stay inside the declared precondition (NaN/inf: a finding)
    b = outputs(backend, _tie_latent(case, change(case, args)))
    n = len(case.seqs)
    if transform == "batch_order":
        b = {re.sub(r"\[(\d+)\]", lambda m: f"[{n - 1 - int(m.group(1))}]", k): v for k, v in b.items()}
    for key in a:
        same = assert_attention_identical if key.startswith("paged_attention") else assert_bitwise_equal
        try:
            same(b[key], a[key], f"{key} changed under {transform}: ")
        except AssertionError as exc:
            raise Mismatch(str(exc)) from None


def alone_equals_in_batch(backend: Any, case: Case, device: str = "cpu") -> None:
    """Each request's attention alone (a batch of one over the same pool) equals, bit for bit, its rows
    in the batch."""
    attn = require(backend, "paged_attention")
    args = inputs(case, device)
    full = outputs(backend, args)
    qsl = case.query_start_loc_list
    for i, s in enumerate(case.seqs):
        alone = attn(args["query"][qsl[i]:qsl[i + 1]], args["k_cache"], args["v_cache"], args["block_tables"][i:i + 1],
                     args["seq_lens"][i:i + 1], torch.tensor([0, s.q_len], dtype=torch.int32, device=device),
                     case.scale, **args["features"]).cpu()
        try:
            assert_attention_identical(alone, full[f"paged_attention[{i}]"], f"sequence {i} alone vs in batch: ")
        except AssertionError as exc:
            raise Mismatch(str(exc), {"seq": i}) from None


def decode_matches_prefill(backend: Any, case: Case, device: str = "cpu") -> None:
    """Attention of ``q_len`` new tokens in one prefill call equals decoding them one call per token,
    and chunked prefill (two calls), within the dtype tolerance."""
    attn = require(backend, "paged_attention")
    k_cache, v_cache = case.caches(device)
    q = case.query(device)
    features = case.attention_features(device)
    qsl = case.query_start_loc_list
    one_shot = run_attention(backend, case, device).cpu()
    _, max_logit, max_v = reference_output(case)
    tables = case.block_tables(device)
    for i, s in enumerate(case.seqs):
        chunks = [(j, j + 1) for j in range(s.q_len)] if s.q_len <= 8 else []
        half = s.q_len // 2
        for lo, hi in chunks + ([(0, half), (half, s.q_len)] if s.q_len > 1 else []):
            ctx = s.seq_len - s.q_len + hi
            out = attn(q[qsl[i] + lo: qsl[i] + hi], k_cache, v_cache, tables[i:i + 1],
                       torch.tensor([ctx], dtype=torch.int32, device=device),
                       torch.tensor([0, hi - lo], dtype=torch.int32, device=device), case.scale, **features).cpu()
            try:
                assert_attention_close(out, one_shot[qsl[i] + lo: qsl[i] + hi].double(), max_abs_logit=max_logit,
                                       max_abs_value=max_v)
            except AssertionError as exc:
                raise Mismatch(f"sequence {i}: rows {lo}..{hi - 1} computed alone (seq_len {ctx}) differ from "
                               f"one prefill: {exc}", {"seq": i}) from None
