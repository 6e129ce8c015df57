"""A planted manager fault, for showing the machine catches one: freeing a request drops every
reference of its blocks, so a block another request still holds (a prefix hit, a fork) goes back to the
free list and is handed out and overwritten while that request still reads it.

Specs: ``pagedkv.tools.mutants.managers:frees_shared_blocks`` (the manager's own ``self_check`` on) and
``pagedkv.tools.mutants.managers:frees_shared_blocks_unchecked`` (no self-check: only the content
oracle and the protocol's invariants can see it).
"""

from __future__ import annotations

import dataclasses
import types

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.testing.managers.own import OwnCacheManager
from pagedkv.testing.managers.protocol import ManagerConfig


class FreesSharedBlocksCache(PagedKVCache):
    """``free`` sets each held block's reference count to zero instead of dropping one reference (and
    so never sees a double free: a block already at zero is skipped)."""

    def free(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        for block in seq.held_blocks:
            while self.allocator.ref_count(block) > 0:
                self.allocator.free(block)
        del self.sequences[seq_id]
        self._finished.add(seq_id)


class FreesSharedBlocks(OwnCacheManager):
    cache_class = FreesSharedBlocksCache


class FreesSharedBlocksUnchecked(FreesSharedBlocks):
    """No fork (sharing comes from prefix hits only) and no self-check."""

    def __init__(self, config: ManagerConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, fork=False)

    def self_check(self) -> None:
        """Nothing: the manager exposes no state of its own."""


#: Candidates for ``--pagedkv-impl`` / ``load_manager`` (objects with a ``cache_manager`` factory).
frees_shared_blocks = types.SimpleNamespace(name="frees_shared_blocks", cache_manager=FreesSharedBlocks)
frees_shared_blocks_unchecked = types.SimpleNamespace(name="frees_shared_blocks_unchecked",
                                                      cache_manager=FreesSharedBlocksUnchecked)
