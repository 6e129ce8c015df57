"""The one-line case notation of reports and tables (``nb=8 bs=4 kvh=1 d=2 g=1 float32 seqs [2, 3]:5/1@4``).

``repr(case)`` stays the exact, replayable form; this is the form a person reads in a table.
"""

from __future__ import annotations

from typing import Any


def brief(case: Any) -> str:
    """A one-line summary of a :class:`~pagedkv.testing.cases.Case` or :class:`~pagedkv.testing.cases.CacheScenario`:
    geometry as ``nb/bs/kvh/d/g dtype``, then sequences (``table:len/q_len@start``) or ops, then the
    non-default fields. ``repr(case)`` remains the exact, replayable form."""
    from pagedkv.testing.cases.case import CacheScenario, Case

    if not isinstance(case, (Case, CacheScenario)):
        return repr(case)
    g = case.geometry
    dims = f"{g.head_dim}/{g.head_dim_v}" if getattr(g, "head_dim_v", None) is not None else f"{g.head_dim}"
    text = (f"nb={g.num_blocks} bs={g.block_size} kvh={g.num_kv_heads} d={dims} "
            f"g={g.num_queries_per_kv} {g.dtype}")
    if isinstance(case, Case):
        seqs = " ".join(f"{list(s.block_table)}:{s.seq_len}/{s.q_len}@{s.start}" for s in case.seqs)
        defaults = Case(g, ())
        extras = [f"{f}={getattr(case, f)!r}" for f in ("values", "poison", "pad_value", "pad_columns", "table_dtype",
                                                          "layout", "scale", "seed", "window_left", "softcap", "alibi",
                                                          "sinks", "kv_cache_dtype", "k_scale", "v_scale", "cuts")
                  if getattr(case, f) != getattr(defaults, f)]
        return f"{text} seqs {seqs} " + " ".join(extras)
    ops = "; ".join(" ".join(str(list(x)) if isinstance(x, tuple) else str(x) for x in op) for op in case.ops)
    return f"{text} ops {ops} prefix_caching={case.enable_prefix_caching} constant_hash={case.constant_hash}"
