"""Cache geometries and sequence lengths."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv.testing.cases import Geometry

DTYPES = ("float32", "float16", "bfloat16")
BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 8, 16)  # 1 and non-powers of two on purpose
GROUP_SIZES = (1, 2, 3, 4, 5, 6, 7)  # GQA groups that are not powers of two included
HEAD_DIMS = (1, 2, 3, 4, 5, 7, 8)  # small odd head dims where the ops allow them


@st.composite
def geometries(draw, *, num_blocks: int | None = None, block_sizes=BLOCK_SIZES, dtypes=DTYPES,
               max_kv_heads: int = 3, group_sizes=GROUP_SIZES, head_dims=HEAD_DIMS) -> Geometry:
    """A :class:`Geometry`; ``num_blocks`` defaults to a draw in ``[1, 12]``."""
    return Geometry(
        num_blocks=num_blocks if num_blocks is not None else draw(st.integers(1, 12)),
        block_size=draw(st.sampled_from(block_sizes)),
        num_kv_heads=draw(st.integers(1, max_kv_heads)),
        head_dim=draw(st.sampled_from(head_dims)),
        num_queries_per_kv=draw(st.sampled_from(group_sizes)),
        dtype=draw(st.sampled_from(dtypes)),
    )


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
