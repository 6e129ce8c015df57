"""Re-express a case inside a candidate's declared space, keeping what makes the case.

A shipped regression case is written at the sizes that found it (block size 4, head_dim 2, ...); a
kernel that declares block sizes {16, 32} and head dims {64, 128} would otherwise skip all of them.
:func:`into_space` moves a :class:`~pagedkv.testing.cases.Case` (or the case of an
:class:`~pagedkv.testing.cases.InvalidCall`) to declared sizes while keeping its structure:

- every block table, its physical ids and its number of entries, the padding and the pool's size;
- each length and position by its place in its block: ``k * bs + r`` becomes ``k * bs' + r'`` with
  ``r' = r`` for ``r`` in {0, 1}, ``bs' - 1`` for ``r = bs - 1`` (the boundary), and ``r`` scaled
  between them otherwise; so a partial last block stays partial, a boundary stays a boundary and
  a query starting mid-block still does;
- the GQA group ratio, the kv-head count with per-head fp8 scales, and the features.

Head dims and dtypes carry no structure of a case (its values come from the seed) and move to a
declared one. A case whose point is a size the space excludes (a GQA group of 3 where only powers of
two are declared) has no faithful translation: :func:`into_space` says why.

A :class:`~pagedkv.testing.cases.CacheScenario` is written in tokens: its sharing, copy-on-write and
prefix hits follow from which token streams share which prefixes, block by block. It moves to a
declared block size ``bs' >= bs`` by *stretching* each sequence's token stream block by block: the
token at offset ``r`` of a block fills the new block's offsets ``place(r) .. place(r + 1) - 1`` (``place``
as above), so

- a length ``k * bs + r`` becomes ``k * bs' + place(r)``: full blocks stay full, a partial last block
  stays partial (one token short of full stays one short: ``k * bs - 1 -> k * bs' - 1``), and every
  sequence needs as many blocks as before (the pool keeps its size, so eviction and running out of
  blocks happen at the same steps);
- two streams share a prefix of ``k * bs + r`` tokens exactly when the stretched ones share
  ``k * bs' + place(r)``: a block-aligned shared prefix stays aligned, an unaligned one unaligned, equal
  blocks stay equal (the prefix cache hashes the same chains) and different ones different;
- each op's tokens are the stretched stream's new part, ``write n`` writes ``place(w + n) - place(w)``
  tokens (``w`` written before), and ids, forks, frees and cache keys are kept.

A scenario whose block size is larger than every declared one would lose tokens and is not translated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedkv.testing.cases.case import Case, Geometry, SeqSpec

_BLOCK_SIZES = (16, 32, 64, 8, 128, 4, 256, 2, 512, 1)
_HEAD_DIMS = (64, 128, 32, 16, 8, 96, 256, 4, 2, 1)
_DTYPES = ("float32", "float16", "bfloat16")


def _place(p: int, bs: int, new_bs: int) -> int:
    """Position ``p`` at block size ``bs`` moved to ``new_bs``, keeping its block and its place in it."""
    k, r = divmod(p, bs)
    if r in (0, 1) or new_bs <= 2:
        r2 = min(r, new_bs - 1)
    elif r == bs - 1:
        r2 = new_bs - 1
    else:
        r2 = max(2, min(new_bs - 2, round(r * new_bs / bs)))
    return k * new_bs + r2


def _choose(sizes: Any, keep: int, preferred: tuple[int, ...]) -> int:
    return keep if sizes.allows(keep) else sizes.choose(preferred)[0]


def _sizes(g: Geometry, caps: Any, bs: int) -> tuple[Geometry | None, str]:
    """``g`` at block size ``bs`` with a declared head dim and dtype, or ``None`` and why."""
    if not caps.gqa_groups.allows(g.num_queries_per_kv):
        return None, (f"the case is about GQA group {g.num_queries_per_kv}, outside the declared "
                      f"{caps.gqa_groups.describe()}")
    if not caps.num_kv_heads.allows(g.num_kv_heads):
        return None, f"the case needs {g.num_kv_heads} kv heads, outside the declared {caps.num_kv_heads.describe()}"
    head_dim = _choose(caps.head_dims, g.head_dim, _HEAD_DIMS)
    dtype = g.dtype if g.dtype in caps.dtypes else next((d for d in _DTYPES if d in caps.dtypes), None)
    if dtype is None:
        return None, "no float dtype declared"
    # V's own width moves with K's only where K's is kept (a V narrower or wider than a K that changed is
    # another case); caps.rejects judges the width kept
    moved = Geometry(g.num_blocks, bs, g.num_kv_heads, head_dim, g.num_queries_per_kv, dtype,
                     g.head_dim_v if head_dim == g.head_dim else None)
    reason = caps.rejects(moved)
    return (None, reason) if reason else (moved, "")


def _changes(g: Geometry, moved: Geometry) -> str:
    changed = [f"{what} {getattr(g, what)} -> {getattr(moved, what)}" for what in ("block_size", "head_dim", "dtype")
               if getattr(g, what) != getattr(moved, what)]
    return "re-expressed: " + ", ".join(changed)


def stretch(tokens: list, bs: int, new_bs: int) -> list:
    """A token stream at block size ``bs`` stretched to ``new_bs >= bs`` (see the module docstring): its
    length is ``_place(len(tokens))`` and ``stretch(t[:n]) == stretch(t)[:_place(n)]`` for every ``n``."""
    out = []
    for p, token in enumerate(tokens):
        out += [token] * (_place(p + 1, bs, new_bs) - _place(p, bs, new_bs))
    return out


def _scenario_into_space(scenario: Any, caps: Any) -> tuple[Any | None, str]:
    g = scenario.geometry
    if not caps.rejects(g):
        return scenario, ""
    larger = [b for b in caps.block_sizes.choose(_BLOCK_SIZES) if b >= g.block_size]
    bs = g.block_size if caps.block_sizes.allows(g.block_size) else (larger[0] if larger else None)
    if bs is None:
        return None, (f"a cache scenario's sharing is written in tokens at block size {g.block_size}; every declared "
                      f"block size ({caps.block_sizes.describe()}) is smaller, and stretching cannot shrink it")
    moved_geometry, why = _sizes(g, caps, bs)
    if moved_geometry is None:
        return None, why
    streams: dict = {}  # seq id -> (original stream, tokens written)
    ops = []
    for op in scenario.ops:
        kind, seq = op[0], op[1]
        if kind in ("add", "reserve", "append"):
            new = kind != "append" and seq not in streams
            if (kind == "append" and seq not in streams) or (kind == "add" and seq in streams):
                ops.append(op)  # ignored by the scenario (no such sequence / already live): kept as it is
                continue
            before, written = ([], 0) if new else streams[seq]
            after = before + list(op[2])
            tokens = stretch(after, g.block_size, bs)[_place(len(before), g.block_size, bs):]
            streams[seq] = (after, written if kind == "reserve" else len(after))
            ops.append((kind, seq, tuple(tokens), *op[3:]))
        elif kind == "write":
            n = op[2] if len(op) > 2 else None
            if seq in streams:
                stream, written = streams[seq]
                done = len(stream) if n is None else min(len(stream), written + n)
                if n is not None:
                    n = _place(done, g.block_size, bs) - _place(written, g.block_size, bs)
                streams[seq] = (stream, done)
            ops.append((kind, seq, n))
        elif kind == "fork":
            if seq in streams and op[2] not in streams:
                streams[op[2]] = streams[seq]
            ops.append(op)
        elif kind == "free":
            streams.pop(seq, None)
            ops.append(op)
        else:
            return None, f"the cache scenario has an op {kind!r} the translation does not know"
    moved = dataclasses.replace(scenario, geometry=moved_geometry, ops=tuple(ops))
    stretched = f" (each block's tokens stretched from {g.block_size} to {bs})" if bs != g.block_size else ""
    return moved, _changes(g, moved_geometry) + stretched


def into_space(case: Any, caps: Any) -> tuple[Any | None, str]:
    """``(case', how)``: ``case`` inside ``caps`` (``how`` names what moved, ``""`` when nothing had to),
    or ``(None, why)`` when it has no faithful translation.

    Args:
        case: a :class:`~pagedkv.testing.cases.Case`, :class:`~pagedkv.testing.cases.InvalidCall` or
            :class:`~pagedkv.testing.cases.CacheScenario`.
        caps: the declared :class:`~pagedkv.backends.capabilities.Capabilities`.
    """
    inner = getattr(case, "case", None)
    if inner is not None and not isinstance(case, Case):  # an InvalidCall: translate its case, keep the fault
        moved, how = into_space(inner, caps)
        if moved is None:
            return None, how
        moved = as_written_by(case.op, moved)
        from pagedkv.testing.cases.invalid_call import fault_sites

        if case.seq not in fault_sites(case.op, case.fault, moved):
            return None, f"the fault {case.fault!r} has no site in the case at the declared sizes"
        return dataclasses.replace(case, case=moved), how
    if not isinstance(case, Case):
        return _scenario_into_space(case, caps)
    g = case.geometry
    if not caps.rejects(g):
        return _storage(case, caps)
    bs = _choose(caps.block_sizes, g.block_size, _BLOCK_SIZES)
    moved_geometry, why = _sizes(g, caps, bs)
    if moved_geometry is None:
        return None, why
    seqs = []
    for s in case.seqs:
        length = _place(s.seq_len, g.block_size, bs) if s.seq_len else 0
        first_query = _place(s.seq_len - s.q_len, g.block_size, bs) if s.q_len < s.seq_len else 0
        q_len = min(length, max(length - first_query, 1 if s.q_len else 0)) if s.seq_len else s.q_len
        seqs.append(SeqSpec(s.block_table, length, q_len, min(_place(s.start, g.block_size, bs), length)))
    window = case.window_left if case.window_left < 1 else _place(case.window_left, g.block_size, bs)
    moved, stored = _storage(dataclasses.replace(case, geometry=moved_geometry, seqs=tuple(seqs), window_left=window),
                             caps)
    if moved is None:
        return None, stored
    return moved, _changes(g, moved_geometry) + (f", {stored}" if stored else "")


def as_written_by(op: str, case: Case) -> Case:
    """``case`` as ``op`` takes its pools: a write (``scatter``, ``write_kv``) takes two pools that never overlap
    (the contract), so a latent case (V a view of K's first columns, MLA) is written as two contiguous pools."""
    if op in ("scatter", "write_kv") and case.layout == "latent":
        return dataclasses.replace(case, layout="contiguous")
    return case


def _storage(case: Case, caps: Any) -> tuple[Case | None, str]:
    """``(case', how)``: ``case`` with V read from K's storage where ``caps`` declares ``shared_kv_storage`` (the
    ``"latent"`` layout, V's scale K's, as the drawn cases' ``latent_view``): a kernel reading V from K's first
    columns is never handed a V of its own; ``(None, why)`` for V wider than K, which K's storage cannot hold."""
    if not getattr(caps, "shared_kv_storage", False) or case.layout == "latent":
        return case, ""
    if case.geometry.v_dim > case.geometry.head_dim:
        return None, (f"V of width {case.geometry.v_dim} is wider than K ({case.geometry.head_dim}): the declared "
                      f"shared_kv_storage reads V from K's storage")
    return dataclasses.replace(case, layout="latent", v_scale=case.k_scale), "V read from K's storage (latent layout)"
