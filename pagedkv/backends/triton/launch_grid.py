"""Launch grids of the Triton kernels and the split-K decision, as pure functions (no Triton, no device).

CUDA limits a grid to ``2**31 - 1`` programs on axis 0 and 65,535 on axes 1 and 2. The attention
kernel puts query tiles on axis 0, kv heads on axis 1 and context splits on axis 2:

- when every sequence's query fits in one tile (decode, short chunks) axis 0 is the batch: program
  ``b`` serves sequence ``b``;
- otherwise axis 0 enumerates the packed query tiles, ``total_q // BLOCK_Q + batch`` programs (vLLM's
  unified attention): sequence ``s`` owns programs ``query_start_loc[s] // BLOCK_Q + s`` onwards, and
  a program finds its sequence by binary search over ``query_start_loc``. The grid then grows with
  the tokens actually queried, never with ``batch x`` the longest query.

Split-K (flash-decoding): when ``batch x kv_heads`` programs would leave most SMs idle, the context
is split across ``num_splits`` programs and a second kernel merges their partial (max, sum,
accumulator) triples. :func:`choose_num_splits` picks the count from the batch, kv heads, context
bound and SM count; on CPU (and in tests) the count is explicit: the launcher's ``num_splits``
keyword, else :func:`fixed_num_splits` / ``$PAGEDKV_NUM_SPLITS``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from pagedkv.errors import ArgumentValueError

#: CUDA grid limits per axis
MAX_GRID = (2**31 - 1, 65535, 65535)
#: most splits of one query tile's context
MAX_SPLITS = 64
#: fewest keys a split is given (below, the merge costs more than the parallelism gains)
MIN_KEYS_PER_SPLIT = 256
#: environment variable that fixes the split count (tests, CPU runs)
SPLITS_ENV = "PAGEDKV_NUM_SPLITS"

_FIXED: contextvars.ContextVar[int | None] = contextvars.ContextVar("pagedkv_num_splits", default=None)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_grid(grid: tuple[int, ...], what: str = "kernel") -> tuple[int, ...]:
    """``grid`` unchanged if every axis is within CUDA's limits, else ``ValueError`` naming the axis."""
    for axis, (n, limit) in enumerate(zip(grid, MAX_GRID)):
        if not 0 <= n <= limit:
            raise ValueError(f"{what} grid {grid}: axis {axis} has {n} programs, over CUDA's limit of {limit}")
    return grid


def attention_grid(batch: int, total_q: int, num_kv_heads: int, max_q_len: int, block_q: int,
                   num_splits: int = 1) -> tuple[tuple[int, int, int], bool]:
    """``(grid, search)`` of the attention kernel; ``search``: programs find their sequence by binary search.

    Args:
        batch: sequences; total_q: packed query tokens (``query_start_loc[-1]``).
        max_q_len: an upper bound of every sequence's ``q_len``; block_q: query tokens per tile.
        num_splits: context splits per query tile (axis 2).
    """
    search = max_q_len > block_q
    programs = total_q // block_q + batch if search else batch
    return check_grid((programs, num_kv_heads, num_splits), "attention"), search


def merge_grid(total_q: int, num_q_heads: int, block_h: int = 1) -> tuple[int, int]:
    """One program per query token and ``block_h`` query heads of a merge (one head a program by default)."""
    return check_grid((total_q, cdiv(num_q_heads, block_h)), "split-K merge")


def copy_grid(num_tokens: int, num_kv_heads: int, block_t: int, block_h: int) -> tuple[int, int]:
    """Token tiles on axis 0, head tiles on axis 1, of the copy kernels."""
    return check_grid((cdiv(num_tokens, block_t), cdiv(num_kv_heads, block_h)), "copy")


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, q_tiles: int = 1) -> int:
    """Context splits so that ``batch x kv_heads x splits`` programs fill about two waves of ``num_sms``.

    No split when the programs already fill the SMs or the context is short (each split keeps at least
    :data:`MIN_KEYS_PER_SPLIT` keys); at most :data:`MAX_SPLITS`.
    """
    programs = max(1, batch * num_kv_heads * q_tiles)
    if num_sms <= 0 or programs >= num_sms:
        return 1
    return max(1, min(cdiv(2 * num_sms, programs), max_context // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def fixed_num_splits() -> int | None:
    """The split count fixed by :func:`splits` or ``$PAGEDKV_NUM_SPLITS`` (``None``: choose)."""
    n = _FIXED.get()
    if n is None and os.environ.get(SPLITS_ENV):
        text = os.environ[SPLITS_ENV]
        try:
            n = int(text)
        except ValueError:
            raise ArgumentValueError(f"${SPLITS_ENV} must be an int in 1 .. {MAX_GRID[2]}, got {text!r}") from None
        if not 1 <= n <= MAX_GRID[2]:
            raise ArgumentValueError(f"${SPLITS_ENV} must be in 1 .. {MAX_GRID[2]}, got {n}")
    if n is not None and not 1 <= n <= MAX_GRID[2]:
        raise ArgumentValueError(f"num_splits must be in 1 .. {MAX_GRID[2]}, got {n}")
    return n


@contextlib.contextmanager
def splits(n: int | None):
    """Within the block, every fused attention launch splits the context into ``n`` parts (``None``: choose)."""
    token = _FIXED.set(n)
    try:
        yield
    finally:
        _FIXED.reset(token)
