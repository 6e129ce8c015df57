"""Cases of the partial-attention properties: a batch as :func:`cases` draws it, V of its own width (or
MLA's latent view of K) where the space declares it, and the cuts that split each context into parts.

Cuts are key positions anywhere in ``0 .. seq_len``, biased to the interesting ones: 0 and ``seq_len``
(an empty part), block boundaries, a query's own position and its window's start (a part whose keys
a window or causality masks for some rows). In half the cases one sequence's first cut lies strictly inside
the keys a query row sees, so both parts hold keys: a merge's arithmetic (two non-empty parts weighted by
their LSEs) runs only there, an empty part weighing 0 whatever the weighting.
"""

from __future__ import annotations

import dataclasses

from hypothesis import assume
from hypothesis import strategies as st

from pagedkv.testing.cases.case import Case

from .batches import cases
from .geometry import run_palette
from .palette import declares_v_widths, v_width_options


def _inner_cuts(case: Case, b: int) -> st.SearchStrategy[int] | None:
    """Cuts of sequence ``b`` strictly inside the keys its first query row sees (a whole prefill: its last
    row's), so both parts hold keys for that row; ``None`` where no row sees two keys."""
    s = case.seqs[b]
    first_q = s.seq_len - s.q_len
    seen = first_q + 1 if first_q else s.seq_len
    return st.integers(1, seen - 1) if s.q_len and seen > 1 else None


@st.composite
def _cut(draw, case: Case, b: int) -> int:
    s, bs = case.seqs[b], case.geometry.block_size
    first_q = s.seq_len - s.q_len
    near = [0, s.seq_len, first_q, first_q + 1, (first_q // bs) * bs]
    if case.window_left >= 0:
        near.append(max(0, first_q - case.window_left))
    return draw(st.sampled_from([min(max(n, 0), s.seq_len) for n in near]) | st.integers(0, s.seq_len))


@st.composite
def partial_cases(draw, *, caps=None, poisons=None, parts: tuple[int, ...] = (2, 3), max_seqs: int = 3,
                  max_len: int = 20, max_q_len: int = 3) -> Case:
    """A :class:`Case` with :attr:`Case.cuts` (``parts - 1`` cuts a sequence, a count drawn from ``parts``;
    ``parts=()``: no cuts, and the feature sets of whole attention). V's width and MLA's latent view are
    drawn as :func:`cases` draws them for ``caps`` (the palette's V widths where the run has one);
    ``caps=None`` draws any width and the latent view half the time. With ``parts``, a batch has a query row."""
    case = draw(cases(caps=caps, poisons=poisons, max_seqs=max_seqs, max_len=max_len, max_q_len=max_q_len,
                      lse=bool(parts)))
    if parts:  # a row to judge (an LSE, a merge): an empty batch is the whole-attention properties' to draw
        assume(any(s.q_len for s in case.seqs))
    if caps is None:  # the undeclared space: every width and the latent view
        g = case.geometry
        head_dim_v = draw(st.sampled_from(v_width_options(g.head_dim, None)))
        if head_dim_v != g.head_dim:
            case = case.replace(geometry=dataclasses.replace(g, head_dim_v=head_dim_v))
        if head_dim_v <= g.head_dim and draw(st.booleans()):
            case = case.replace(layout="latent", kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    elif case.geometry.head_dim_v is None and run_palette(caps) is None and declares_v_widths(caps) \
            and draw(st.booleans()):  # MLA's shape half the time where no palette fixes widths: V narrower, K's view
        g = case.geometry
        narrower = [w for w in v_width_options(g.head_dim, caps) if w < g.head_dim]
        if narrower and case.kv_cache_dtype == "auto":
            case = case.replace(geometry=dataclasses.replace(g, head_dim_v=draw(st.sampled_from(narrower))),
                                layout="latent", v_scale=case.k_scale)
    if not parts:  # the shapes alone (V's width, the latent view), for the properties of whole attention
        return case
    n_cuts = draw(st.sampled_from(parts)) - 1
    keyed = [b for b in range(len(case.seqs)) if _inner_cuts(case, b) is not None]
    # half the cases (the simplest first): one sequence's first cut leaves keys in both parts
    both = keyed[draw(st.integers(0, len(keyed) - 1))] if n_cuts and keyed and draw(st.sampled_from((True, False))) \
        else None
    cuts = tuple(tuple(sorted(draw(_inner_cuts(case, b) if b == both and i == 0 else _cut(case, b))
                              for i in range(n_cuts))) for b in range(len(case.seqs)))
    return case.replace(cuts=cuts)
