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
two are declared), and a cache scenario (its sharing is written in tokens at one block size), has
no faithful translation: :func:`into_space` says why.
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
        from pagedkv.testing.cases.invalid_call import fault_sites

        if case.seq not in fault_sites(case.op, case.fault, moved):
            return None, f"the fault {case.fault!r} has no site in the case at the declared sizes"
        return dataclasses.replace(case, case=moved), how
    if not isinstance(case, Case):
        g = case.geometry
        reason = caps.rejects(g)
        return (case, "") if not reason else (None, f"a cache scenario's sharing is written in tokens at block size "
                                                    f"{g.block_size}; {reason}")
    g = case.geometry
    if not caps.rejects(g):
        return case, ""
    if not caps.gqa_groups.allows(g.num_queries_per_kv):
        return None, (f"the case is about GQA group {g.num_queries_per_kv}, outside the declared "
                      f"{caps.gqa_groups.describe()}")
    if not caps.num_kv_heads.allows(g.num_kv_heads):
        return None, f"the case needs {g.num_kv_heads} kv heads, outside the declared {caps.num_kv_heads.describe()}"
    bs = _choose(caps.block_sizes, g.block_size, _BLOCK_SIZES)
    head_dim = _choose(caps.head_dims, g.head_dim, _HEAD_DIMS)
    dtype = g.dtype if g.dtype in caps.dtypes else next((d for d in _DTYPES if d in caps.dtypes), None)
    if dtype is None:
        return None, "no float dtype declared"
    seqs = []
    for s in case.seqs:
        length = _place(s.seq_len, g.block_size, bs) if s.seq_len else 0
        first_query = _place(s.seq_len - s.q_len, g.block_size, bs) if s.q_len < s.seq_len else 0
        q_len = min(length, max(length - first_query, 1 if s.q_len else 0)) if s.seq_len else s.q_len
        seqs.append(SeqSpec(s.block_table, length, q_len, min(_place(s.start, g.block_size, bs), length)))
    window = case.window_left if case.window_left < 1 else _place(case.window_left, g.block_size, bs)
    moved = dataclasses.replace(case, geometry=Geometry(g.num_blocks, bs, g.num_kv_heads, head_dim,
                                                        g.num_queries_per_kv, dtype),
                                seqs=tuple(seqs), window_left=window)
    reason = caps.rejects(moved.geometry)
    if reason:
        return None, reason
    changed = [f"{what} {a} -> {b}" for what, a, b in (("block_size", g.block_size, bs),
                                                       ("head_dim", g.head_dim, head_dim), ("dtype", g.dtype, dtype))
               if a != b]
    return moved, "re-expressed: " + ", ".join(changed)
