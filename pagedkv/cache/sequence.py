"""What the cache records per sequence: its block table, its tokens, how much is committed and released.

:class:`SequenceState` is the row of :class:`pagedkv.cache.paged_cache.PagedKVCache`'s bookkeeping that a
scheduler reasons about (vLLM's per-request block table), kept apart from the cache's operations so
the sliding-window rules (:mod:`pagedkv.cache.window`) and reference models can read it without the pools.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedkv.errors import ArgumentTypeError


@dataclass
class SequenceState:
    """One sequence's block table, the token ids it holds slots for, how many leading tokens' K/V is
    written (``num_written``: committed by ``mark_written``, or served by the prefix cache), its
    prefix-cache namespace ``cache_key`` and how many leading table entries the sliding window
    released (``num_released``: they hold ``-1``)."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_written: int = 0
    cache_key: Hashable = None
    num_released: int = 0

    @property
    def held_blocks(self) -> list[int]:
        """The table's entries past the released ones: the blocks this sequence holds a reference on."""
        return self.block_table[self.num_released:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def check_seq_id(name: str, seq_id: object) -> None:
    """Refuse a sequence id that is not a Python int (a bool, a float, a tensor).

    Raises:
        ArgumentTypeError (a ``TypeError``): naming ``name`` and the value.
    """
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(seq_id).__name__} {seq_id!r}")
