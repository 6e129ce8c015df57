"""Cases of the partial-attention properties: a batch as :func:`cases` draws it, V of its own width (or
MLA's latent view of K) where the space declares it, and the cuts that split each context into parts.

Cuts are key positions anywhere in ``0 .. seq_len``, biased to the interesting ones: 0 and ``seq_len``
(an empty part), block boundaries, a query's own position and its window's start (a part whose keys
a window or causality masks for some rows).
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from pagedkv.testing.cases.case import Case

from .batches import cases


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
    ``parts=()``: no cuts),
    and, where ``caps.head_dims_v`` allows one, a ``head_dim_v`` of its own; a backend declaring
    ``shared_kv_storage`` always gets the ``"latent"`` layout (V = K's first columns), others sometimes."""
    case = draw(cases(caps=caps, poisons=poisons, max_seqs=max_seqs, max_len=max_len, max_q_len=max_q_len))
    g = case.geometry
    shared = caps is not None and caps.shared_kv_storage
    latent = shared or draw(st.booleans())
    widths = caps.head_dims_v if caps is not None else None
    head_dim_v = None
    if widths is not None or caps is None:
        # A backend compiled per head_dim gets a V width of its own only where it adds few kernels to the
        # run's palette: MLA's 576 -> 512, and the tiny head dims (the interpreter's, the palette's smallest).
        compiled = caps is not None and "head_dim" in (caps.specialize_on or ())
        if compiled:
            candidates = {g.head_dim} | ({512} if g.head_dim == 576 else set()) \
                | ({max(1, g.head_dim // 2), g.head_dim + 3} if g.head_dim <= 8 else set())
        else:
            candidates = {g.head_dim, max(1, g.head_dim // 2), g.head_dim - 1, g.head_dim + 3}
        options = [w for w in candidates
                   if w >= 1 and (widths is None or widths.allows(w) or w == g.head_dim)
                   and (not latent or w <= g.head_dim)]
        head_dim_v = draw(st.sampled_from(sorted(options)))
    elif not shared:
        latent = False
    if latent:
        case = case.replace(layout="latent", kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0)
    if head_dim_v is not None and head_dim_v != g.head_dim:
        case = case.replace(geometry=dataclasses.replace(g, head_dim_v=head_dim_v))
    if not parts:  # the shapes alone (V's width, the latent view), for the properties of whole attention
        return case
    n_cuts = draw(st.sampled_from(parts)) - 1
    cuts = tuple(tuple(sorted(draw(_cut(case, b)) for _ in range(n_cuts))) for b in range(len(case.seqs)))
    return case.replace(cuts=cuts)
