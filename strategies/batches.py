"""Batches of sequences over one pool: random, fragmented and large-pool block tables."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.allocator import BlockAllocator
from pagedkv.testing.cases import LAYOUTS, POISONS, VALUE_PATTERNS, Case, Geometry, SeqSpec
from pagedkv.config import blocks_needed

from .geometry import DTYPES, geometries, positions_in, seq_lens


@st.composite
def _lengths(draw, block_size: int, max_seqs: int, max_len: int, max_q_len: int):
    """``[(seq_len, q_len, start)]`` for 1..max_seqs sequences; q_len biased to 1 (decode) and whole prompts."""
    out = []
    for _ in range(draw(st.integers(1, max_seqs))):
        n = draw(seq_lens(block_size, max_len))
        q_cap = min(n, max_q_len)
        q_len = draw(st.one_of(st.sampled_from(sorted({min(1, n), q_cap})), st.integers(0, q_cap)))
        out.append((n, q_len, draw(positions_in(n, block_size))))
    return out


@st.composite
def _extras(draw, geometry: Geometry, seqs, *, read_only: bool) -> Case:
    return Case(
        geometry=geometry,
        seqs=tuple(seqs),
        values=draw(st.sampled_from(VALUE_PATTERNS)),
        poison=draw(st.sampled_from(POISONS)),
        pad_value=draw(st.sampled_from((-1, -1, 0, geometry.num_blocks))) if read_only else -1,
        pad_columns=draw(st.integers(0, 2)),
        table_dtype=draw(st.sampled_from(("int32", "int64"))),
        layout=draw(st.sampled_from(LAYOUTS)),
        scale=draw(st.one_of(st.none(), st.sampled_from((0.5, 1.0, 0.1)))),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def cases(draw, *, max_seqs: int = 4, max_len: int = 24, max_q_len: int = 6, repeats: bool | None = None,
          dtypes=DTYPES, **geometry_kwargs) -> Case:
    """A batch: geometry, per-sequence block tables, lengths, query lengths, scatter starts, pattern, seed.

    Tables are a random permutation of the pool split among the sequences (every block owned once,
    unused blocks left over), or, with ``repeats`` (drawn when ``None``), ids drawn independently so
    one physical block can appear several times (valid for reads; writes skip such sequences).
    """
    geometry = draw(geometries(num_blocks=1, dtypes=dtypes, **geometry_kwargs))
    bs = geometry.block_size
    lengths = draw(_lengths(bs, max_seqs, max_len, max_q_len))
    need = [blocks_needed(n, bs) for n, _, _ in lengths]
    repeats = draw(st.booleans()) if repeats is None else repeats
    if repeats:
        num_blocks = draw(st.integers(1, max(1, sum(need))))
        tables = [tuple(draw(st.lists(st.integers(0, num_blocks - 1), min_size=k, max_size=k))) for k in need]
    else:
        num_blocks = draw(st.integers(max(1, sum(need)), sum(need) + 3))
        perm = draw(st.permutations(range(num_blocks)))
        tables, at = [], 0
        for k in need:
            tables.append(tuple(perm[at:at + k]))
            at += k
    geometry = Geometry(num_blocks, bs, geometry.num_kv_heads, geometry.head_dim, geometry.num_queries_per_kv,
                        geometry.dtype)
    seqs = [SeqSpec(t, n, q, s) for t, (n, q, s) in zip(tables, lengths)]
    return draw(_extras(geometry, seqs, read_only=repeats))


@st.composite
def fragmented_cases(draw, *, max_seqs: int = 4, max_len: int = 24, max_q_len: int = 6, dtypes=DTYPES,
                     **geometry_kwargs) -> Case:
    """A batch whose block tables come from a real :class:`BlockAllocator` after a random alloc/free
    history has scrambled its free list (the layouts a long-running server produces)."""
    geometry = draw(geometries(num_blocks=1, dtypes=dtypes, **geometry_kwargs))
    bs = geometry.block_size
    lengths = draw(_lengths(bs, max_seqs, max_len, max_q_len))
    need = [blocks_needed(n, bs) for n, _, _ in lengths]
    num_blocks = draw(st.integers(max(1, sum(need)), sum(need) + 6))
    allocator = BlockAllocator(num_blocks, bs, enable_prefix_caching=False)
    held: list[int] = []
    for grab in draw(st.lists(st.integers(-3, 3), max_size=16)):
        if grab > 0 and allocator.num_free >= grab:
            held += allocator.allocate(grab)
        elif grab <= 0 and held:
            allocator.free(held.pop(draw(st.integers(0, len(held) - 1))))
    allocator.free_all(held)  # everything back, in a scrambled order
    tables = [tuple(allocator.allocate(k)) for k in need]
    geometry = Geometry(num_blocks, bs, geometry.num_kv_heads, geometry.head_dim, geometry.num_queries_per_kv,
                        geometry.dtype)
    return draw(_extras(geometry, [SeqSpec(t, n, q, s) for t, (n, q, s) in zip(tables, lengths)], read_only=False))


@st.composite
def large_pool_cases(draw, *, min_slots: int = 2**24 + 1) -> Case:
    """One or two short sequences placed at the *end* of a pool of more than ``min_slots`` slots
    (2**24 by default: past float32's exact integers), with tiny heads so the pool stays cheap
    (``num_kv_heads = head_dim = 1``, float16/bfloat16: 2 bytes a slot). Index arithmetic in float32 or
    int32 element offsets misplaces these tokens."""
    bs = draw(st.sampled_from((1, 16, 64, 256)))
    num_blocks = -(-min_slots // bs) + draw(st.integers(0, 3))
    geometry = Geometry(num_blocks, bs, 1, 1, draw(st.sampled_from((1, 2))), draw(st.sampled_from(("float16", "bfloat16"))))
    seqs = []
    top = num_blocks
    for _ in range(draw(st.integers(1, 2))):
        n = draw(seq_lens(bs, 2 * bs, min_len=1))
        k = blocks_needed(n, bs)
        table = tuple(range(top - k, top))
        top -= k
        seqs.append(SeqSpec(table, n, min(n, draw(st.integers(1, 3))), draw(positions_in(n, bs))))
    return Case(geometry, tuple(seqs), values="identity", poison="nan", seed=draw(st.integers(0, 100)))
