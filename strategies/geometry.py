"""Cache geometries and sequence lengths."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.testing.cases.case import Geometry

DTYPES = ("float32", "float16", "bfloat16")
BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 8, 16)  # 1 and non-powers of two on purpose; small: fast to shrink
GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7)  # GQA groups that are not powers of two included
HEAD_DIMS = (1, 2, 3, 4, 5, 7, 8)  # small odd head dims where the ops allow them
# What production kernels run (drawn about half the time): vLLM/FlashInfer head dims incl. odd ones,
# block sizes up to a non-power of two past 512, and GQA groups past a kernel's tile (71 over 1 kv head).
REALISTIC_BLOCK_SIZES = (32, 64, 128, 256, 544)
REALISTIC_HEAD_DIMS = (32, 40, 64, 72, 80, 96, 112, 128, 192, 256, 576)
REALISTIC_GROUP_SIZES = (8, 16, 17, 48, 64, 71)
#: KV-head counts of production models past the small ones (Llama 3 8B / 70B, Qwen, Mistral: 8), drawn at GQA groups
#: up to 7 and head dims up to theirs (a kernel's head tile or head stride wrong from the fourth head on shows at
#: small head dims; one wrong only at production widths, 8 kv heads of 128, needs both drawn together)
REALISTIC_KV_HEADS = (4, 8)
#: The widest head_dim drawn beside :data:`REALISTIC_KV_HEADS` (the wider ones are MLA's latent 576 and
#: Gemma's 256, models of one or few kv heads).
REALISTIC_KV_HEADS_MAX_HEAD_DIM = 128
#: Every value the geometry strategies draw, per specialising parameter (what a palette picks from).
UNIVERSE = {"block_size": BLOCK_SIZES + REALISTIC_BLOCK_SIZES, "head_dim": HEAD_DIMS + REALISTIC_HEAD_DIMS,
            "gqa_group": GROUP_SIZES + REALISTIC_GROUP_SIZES, "dtype": DTYPES}


def sized(small, realistic, allowed=None) -> st.SearchStrategy[int]:
    """One of ``small`` (listed first, so a failure shrinks toward them) or, one draw in four,
    ``realistic``, restricted to ``allowed`` (a :class:`pagedkv.backends.capabilities.Sizes`) when given.

    Realistic sizes cost far more per example (a 544-token block, 71 query heads, head_dim 576), so
    they are drawn often enough to reach every one in a run of the ``ci`` profile, not half the time.
    """
    if allowed is not None:
        small = tuple(n for n in small if allowed.allows(n))
        realistic = tuple(n for n in realistic if allowed.allows(n))
        if not small and not realistic:
            small = allowed.choose(())
    if small and realistic:
        return st.one_of(st.sampled_from(small), st.sampled_from(small), st.sampled_from(small),
                         st.sampled_from(realistic))
    return st.sampled_from(small or realistic)


def allowed_dtypes(dtypes, caps=None) -> tuple[str, ...]:
    """``dtypes`` restricted to the declared ones (the declared ones when none is left)."""
    if caps is None:
        return tuple(dtypes)
    kept = tuple(d for d in dtypes if d in caps.dtypes)
    return kept or tuple(sorted(caps.dtypes))


@st.composite
def geometries(draw, *, num_blocks: int | None = None, block_sizes=BLOCK_SIZES, dtypes=DTYPES,
               max_kv_heads: int = 3, group_sizes=GROUP_SIZES, head_dims=HEAD_DIMS, realistic: bool = True,
               caps=None) -> Geometry:
    """A :class:`Geometry`; ``num_blocks`` defaults to a draw in ``[1, 12]``.

    With ``realistic`` (the default), block sizes, head dims and GQA groups are drawn about half the
    time from what production kernels run (:data:`REALISTIC_BLOCK_SIZES`, ...). ``caps`` (a
    :class:`pagedkv.backends.capabilities.Capabilities`) keeps every draw inside a backend's declared space;
    a declared compile budget (``caps.specialize_on``) draws the specialising parameters from the run's
    palette (:mod:`pagedkv.testing.strategies.palette`). V's width (``head_dim_v``) is drawn where ``caps``
    declares widths of its own (:func:`v_widths`).
    """
    shape = _palette_shape(draw, caps, realistic, block_size=block_sizes, head_dim=head_dims,
                           gqa_group=group_sizes, dtype=dtypes) or {}  # the run's compile budget, if any

    def pick(name, small, real, allowed):
        return shape[name] if name in shape else draw(sized(small, real if realistic else (), allowed))

    group = pick("gqa_group", group_sizes, REALISTIC_GROUP_SIZES, caps.gqa_groups if caps else None)
    head_dim = pick("head_dim", head_dims, REALISTIC_HEAD_DIMS, caps.head_dims if caps else None)
    production_heads = realistic and group <= 7 and head_dim <= REALISTIC_KV_HEADS_MAX_HEAD_DIM
    kv_heads = draw(sized(tuple(range(1, (1 if group > 7 else max_kv_heads) + 1)),
                          REALISTIC_KV_HEADS if production_heads else (), caps.num_kv_heads if caps else None))
    # many kv heads of a production width in blocks of hundreds of slots: pools of 100 MB an example, no new code
    # path; such heads take the small block sizes
    wide_heads = REALISTIC_KV_HEADS[0] <= kv_heads and kv_heads > max_kv_heads and head_dim > max(HEAD_DIMS)
    return Geometry(
        num_blocks=num_blocks if num_blocks is not None else draw(st.integers(1, 12)),
        block_size=pick("block_size", block_sizes, () if wide_heads else REALISTIC_BLOCK_SIZES,
                        caps.block_sizes if caps else None),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_queries_per_kv=group,
        dtype=shape["dtype"] if "dtype" in shape else draw(st.sampled_from(allowed_dtypes(dtypes, caps))),
        head_dim_v=draw(v_widths(head_dim, caps, shape)),
    )


def v_widths(head_dim: int, caps, shape: dict | None = None) -> st.SearchStrategy[int | None]:
    """``Geometry.head_dim_v`` for K of width ``head_dim``: ``None`` (V as wide as K) unless ``caps``
    declares V widths of their own (``head_dims_v``) or K's latent view (``shared_kv_storage``); then the
    palette shape's width when the run has one (a compiled kernel: no extra specialisation), else one of
    :func:`~pagedkv.testing.strategies.palette.v_width_options` (K's own width first: shrinks there)."""
    from pagedkv.testing.strategies.palette import declares_v_widths, v_width_options

    if not declares_v_widths(caps):
        return st.none()
    if shape and "head_dim_v" in shape and shape.get("head_dim") == head_dim:
        width = shape["head_dim_v"]
    else:
        return st.sampled_from(v_width_options(head_dim, caps)).map(lambda w: None if w == head_dim else w)
    return st.just(None if width == head_dim else width)


def run_palette(caps):
    """The run's palette for the declared space ``caps`` (:func:`pagedkv.testing.strategies.palette.palette_for`
    over :data:`UNIVERSE`), or ``None`` when it declares no specialising parameter."""
    from pagedkv.testing.strategies.palette import palette_for

    return palette_for(caps, UNIVERSE)


def _palette_shape(draw, caps, realistic: bool, **lists) -> dict | None:
    """A shape of the run's palette (:mod:`pagedkv.testing.strategies.palette`) inside the lists this
    draw allows, or ``None`` (no palette, or none of its shapes fits: then the parameters are drawn freely)."""
    from pagedkv.testing.strategies.palette import declares_v_widths, is_mla_shape, shape_fits

    palette = run_palette(caps)
    if palette is None:
        return None
    extra = {"block_size": REALISTIC_BLOCK_SIZES, "head_dim": REALISTIC_HEAD_DIMS, "gqa_group": REALISTIC_GROUP_SIZES}
    lists = {n: tuple(v) + (extra.get(n, ()) if realistic else ()) for n, v in lists.items()}
    fits = [s for s in palette.shapes if shape_fits(s, **lists)]
    if not fits:
        return None
    mla = [s for s in fits if is_mla_shape(s)] if declares_v_widths(caps) else []
    rest = [s for s in fits if s not in mla]
    if mla and rest:  # a candidate that runs MLA: its deployed width one case in three, the other shapes as often
        return draw(st.sampled_from(rest) | st.sampled_from(rest) | st.sampled_from(mla))
    return draw(st.sampled_from(fits))


def seq_lens(block_size: int, max_len: int, *, min_len: int = 0) -> st.SearchStrategy[int]:
    """Lengths in ``[min_len, max_len]`` biased to ``0, 1, bs-1, bs, bs+1, k*bs`` and ``k*bs +- 1``."""
    edges = {0, 1, block_size - 1, block_size, block_size + 1}
    for k in range(2, max_len // block_size + 2):
        edges |= {k * block_size - 1, k * block_size, k * block_size + 1}
    edges = sorted(e for e in edges if min_len <= e <= max_len)
    return st.one_of(st.sampled_from(edges), st.integers(min_len, max_len)) if edges else st.integers(min_len, max_len)


def positions_in(seq_len: int, block_size: int) -> st.SearchStrategy[int]:
    """A position in ``[0, seq_len]`` biased to block boundaries (a scatter start or a fork point)."""
    edges = sorted({p for k in range(seq_len // block_size + 2) for p in (k * block_size - 1, k * block_size,
                                                                        k * block_size + 1) if 0 <= p <= seq_len})
    return st.one_of(st.sampled_from(edges), st.integers(0, seq_len))
