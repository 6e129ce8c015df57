"""Planted faults of a hybrid cache manager: the reference manager
(:class:`~pagedkv.testing.managers.reference.ReferenceManager`) with one rule changed, each after a fault
engines shipped in their hybrid, connector or speculative code. The manager machine must catch each
(``tests/gate/test_manager_groups.py`` measures the examples it takes).

Specs: ``pagedkv.tools.mutants.hybrid_managers:<name>`` for each name of :data:`HYBRID_MANAGER_MUTANTS`.
"""

from __future__ import annotations

import types

from pagedkv.testing.managers.reference import ReferenceManager


class SecondFullGroupUntruncated(ReferenceManager):
    """Only the first full-attention group is truncated to the agreed hit; a later one keeps its own
    longest hit (vllm#50457, vllm-ascend#14810): its table and references run past the agreed tokens."""

    def admit(self, request_id, token_ids, namespace=None, extra_keys=(), *, num_stored=0):
        _, hit = super().admit(request_id, token_ids, namespace, extra_keys, num_stored=num_stored)
        req = self.requests[request_id]
        fulls = [g for g, group in enumerate(self.groups) if group.kind == "full"]
        for g in fulls[1:]:  # FAULT: the later full groups keep their own hit
            bs, table = self.groups[g].block_size, req.tables[g]
            while (len(table) + 1) * bs <= len(token_ids) - 1 and self._key(req, g, len(table)) in self.index:
                block = next(iter(self.index[self._key(req, g, len(table))]))
                table.append(block)
                req.pending_hits.append((g, block))
        return tuple(list(t) for t in req.tables), hit


class AllocationEvictsHits(ReferenceManager):
    """New blocks are allocated before the hit is adopted (vllm#44409, a local hit plus connector tokens):
    an allocation may take a hit block still in the free queue, so one block serves two tables."""

    def _adopt_hits(self, req):
        pass  # FAULT: adopted after the allocation (below)

    def _allocate(self, req, wanted, zero):
        super()._allocate(req, wanted, zero)
        super()._adopt_hits(req)


class DraftsCachedBeforeVerification(ReferenceManager):
    """Draft tokens are cached when reserved, before verification: a rejected draft's block, rewritten
    by the token accepted in its place, is served to a prompt that spells the draft."""

    def reserve(self, request_id, token_ids, num_draft=0):
        slots = super().reserve(request_id, token_ids, num_draft)
        if slots is not None and num_draft:
            self.commit(request_id, self.requests[request_id].reserved)  # FAULT: drafts included
        return slots


class MambaStateAtEveryBoundary(ReferenceManager):
    """A Mamba group caches every full block as if a state were kept at each block boundary, where a
    step wrote the state only after its last token (vllm#48375's family: a cached state that is not the
    digest of its prefix)."""

    def commit(self, request_id, num_tokens):
        self.requests[request_id].states |= set(range(num_tokens + 1))  # FAULT
        super().commit(request_id, num_tokens)


class FailedLoadCached(ReferenceManager):
    """A failed connector load is recomputed, but its blocks were cached first: a request admitted
    before the recompute reads what the failed load left."""

    def load_done(self, request_id, ok):
        req = self.requests[request_id]
        if not ok:
            req.states.add(req.hit + req.external)
            self.commit(request_id, req.hit + req.external)  # FAULT: cached although invalid
        super().load_done(request_id, ok)


class LoadingBlocksCached(ReferenceManager):
    """External blocks are cached when allocated, not when the load completes (``delay_cache_blocks``
    ignored): a request admitted meanwhile hits blocks whose data has not arrived."""

    def load(self, request_id):
        slots = super().load(request_id)
        req = self.requests[request_id]
        if slots is not None:
            req.states.add(req.reserved)
            self.commit(request_id, req.reserved)  # FAULT
            req.computed = req.hit
        return slots


class StoreFreesEarly(ReferenceManager):
    """A free releases the blocks at once although the connector still stores them (vLLM's
    ``delay_free_blocks`` ignored): blocks are handed out while their store reads them."""

    def free(self, request_id):
        super().free(request_id)
        if request_id in self.requests:
            self.requests[request_id].storing = False  # FAULT
            self._settle(request_id)

    def store_done(self, request_id):
        if request_id in self.requests:  # released already
            super().store_done(request_id)


class ChunkReleasedEarly(ReferenceManager):
    """A chunked-local group releases the current chunk's blocks one token early: the last query of a
    chunk no longer reads its own chunk."""

    def _first_read(self, g, position):
        group = self.groups[g]
        return group.first_read(position + 1 if group.kind == "chunked_local" else position)  # FAULT


class LoadBlocksZeroed(ReferenceManager):
    """A connector load's new blocks are named for the worker's zeroing too (vLLM's scheduler passes the loaded
    groups as ``skip_zeroing_group_ids``; vLLM's ``allocate_slots`` misrouting a load past a one-token test): the
    zeroing races the load and wipes its data."""

    def _grow(self, req, start, end, keep_from, zero=True):
        return super()._grow(req, start, end, keep_from, zero=True)  # FAULT: a load's blocks named as well


#: ``{name: faulty manager class}``, each with the layouts where its fault lives.
HYBRID_MANAGER_MUTANTS: dict[str, type] = {
    "second_full_group_untruncated": SecondFullGroupUntruncated,
    "allocation_evicts_hits": AllocationEvictsHits,
    "drafts_cached_before_verification": DraftsCachedBeforeVerification,
    "mamba_state_at_every_boundary": MambaStateAtEveryBoundary,
    "failed_load_cached": FailedLoadCached,
    "loading_blocks_cached": LoadingBlocksCached,
    "store_frees_early": StoreFreesEarly,
    "chunk_released_early": ChunkReleasedEarly,
    "load_blocks_zeroed": LoadBlocksZeroed,
}

#: The layouts each fault needs (the machine draws one of them per program).
MUTANT_LAYOUTS: dict[str, tuple[str, ...]] = {
    "second_full_group_untruncated": ("gpt-oss-2full-sw",),
    "drafts_cached_before_verification": ("gemma3", "llama4", "gpt-oss-2full-sw"),
    "mamba_state_at_every_boundary": ("jamba", "qwen3-next"),
    "chunk_released_early": ("llama4",),
    "load_blocks_zeroed": ("jamba", "qwen3-next", "hymba"),
}

for _name, _cls in HYBRID_MANAGER_MUTANTS.items():  # candidates for --pagedkv-impl
    globals()[_name] = types.SimpleNamespace(name=_name, cache_manager=_cls,
                                             cache_manager_layouts=MUTANT_LAYOUTS.get(_name, ("gemma3", "jamba")))
