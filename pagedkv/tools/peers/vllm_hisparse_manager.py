"""vLLM 0.32's ``KVCacheManager`` over HiSparse groups (``vllm/v1/hisparse/``: DeepSeek-V3.2 / GLM-5 sparse MLA
served with a host tier), driven as vLLM's scheduler and its HiSparse connector drive it, the adapter playing the
worker: the layout ``hisparse`` of ``pagedkv.tools.peers:vllm_cache_manager``.

vLLM's groups (as ``make_hisparse_kv_cache_config`` in vLLM's own tests): 0 the latent source (``HISPARSE_SOURCE``,
``host_resident``: its blocks come from a host pool), 1 the indexer (``HISPARSE_INDEXER``, device), 2 the resident
pages (``HiSparseResidentSpec``: device copies of the latent pages), 3 the hot region (``HiSparseHotSpec``, 2 blocks
a request). The protocol sees two ``full`` groups, the latent one ``host_resident``
(:data:`~pagedkv.testing.managers.protocol.HYBRID_LAYOUTS` ``["hisparse"]``):

- the latent table names, page by page, where the worker reads it (vLLM's residency row): its device block while
  resident, pinned or unpinned (a clean page's reference released by ``BlockPool.unpin_blocks``: it counts as free
  and stays readable until the pool hands it out, when ``on_reuse`` drops it), else its host block, as id
  ``host_base + host block id`` (past the device pool);
- the indexer table is vLLM's indexer row.

Each ``reserve`` runs ``HiSparseConnectorScheduler.build_connector_meta``'s per-step work in its order
(``advance_scheduled``, ``build_offload_command``, ``take_host_block_copies``, ``build_row_mirrors``,
``all_context_pages_resident``, ``take_residency_updates``); each ``commit`` runs the worker's part of the steps it
completes (the row mirrors and page transfers, in the pools this adapter owns) and acknowledges every transfer at
once (``release_completed_host_copies``, ``update_spills``), as vLLM's ``_publish_hisparse_pages`` does.

``counts()`` is not reported: a page is held in two tiers, which one table entry cannot say. ``self_check``: both
pools' free queues hold exactly their unreferenced blocks, and every device block's ``ref_cnt`` is what live rows
pin (indexer rows, pinned resident pages, hot regions, spills in flight).

With ``config.connector``, vLLM's ``OffloadingConnector`` (its scheduler side, built as vLLM's HiSparse tests build
it) over the machine's store, as a HiSparse deployment pairs it with ``HiSparseConnector`` (a ``MultiConnector``).
Under HiSparse it offloads the indexer group only (``get_offloading_group_ids``) and loads no further than the host
tier's own hit (``_max_loadable_tokens``, the latent group bounding): a load restores indexer blocks evicted from
the device beneath latent pages the host tier still holds. ``allocate_slots`` keeps those host pages (HiSparse's
latent group ``retains_longer_hit``), the load leaves them as they are (``capabilities.loads_keep_held``: their
slots ``-1``), and its completion runs ``HiSparseConnectorScheduler.update_connector_output``'s
``finish_host_import``. The request is then scheduled again as vLLM's scheduler schedules a request whose load
landed (``empty_kv_cache_blocks`` passed as its computed blocks). A freed request's blocks wait for its store
(``request_finished`` delays the free to ``finished_sending``) and for a load still in flight.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities, ManagerConfig
from pagedkv.tools.peers.vllm_manager import MAX_MODEL_LEN, VllmCacheManager, _import_vllm, init_block_hashes

#: Host blocks per device block (the host tier is the larger one, as HiSparse deployments size it).
HOST_BLOCKS_PER_DEVICE_BLOCK = 2
#: Hot-region blocks per request (``HiSparseHotSpec.blocks_per_request``, as vLLM's tests build it).
HOT_BLOCKS_PER_REQUEST = 2


class _Store:
    """``OffloadingConnectorScheduler``'s lookup over the machine's store: ``stored[request_id]`` whole blocks of
    the prompt (less its last token) held externally, offered past ``num_computed_tokens`` up to
    ``max_num_new_tokens`` (the bound ``OffloadingConnector._max_loadable_tokens`` passes), loaded asynchronously;
    every finished request is stored (its free delayed to ``finished_sending``)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stored: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens, max_num_new_tokens=None):
        end = min(self.stored.pop(request.request_id, 0), request.num_tokens - 1)
        external = max(0, end - end % self.block_size - num_computed_tokens)
        if max_num_new_tokens is not None:
            external = min(external, max_num_new_tokens)
        return external, external > 0

    def request_finished(self, request):
        return True, None


def _offloading_connector(manager, block_size: int):
    """vLLM's ``OffloadingConnector`` bound to ``manager`` with :class:`_Store` as its scheduler side (as vLLM's
    ``test_connector_completes_partial_prefix_without_importing_missing_host_kv`` builds it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    connector = object.__new__(OffloadingConnector)
    connector._kv_cache_config = manager.kv_cache_config
    connector.connector_scheduler = _Store(block_size)
    connector.bind_kv_cache_manager(manager)
    return connector


class VllmHiSparseCacheManager(VllmCacheManager):
    """One ``KVCacheManager`` over HiSparse's four groups; the protocol's ``hisparse`` layout (latent, indexer).

    Raises:
        BackendUnavailableError: vLLM is not installed.
        ValueError: ``config.groups`` is not the ``hisparse`` layout (a ``host_resident`` full group, then a full
            group, of one block size).
    """

    def __init__(self, config: ManagerConfig) -> None:
        v = self.v = _import_vllm()
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
        from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec, KVCacheGroupRole

        groups = tuple(config.groups)
        if (len(groups) != 2 or [(g.kind, g.host_resident) for g in groups] != [("full", True), ("full", False)]
                or groups[0].block_size != groups[1].block_size):
            raise ValueError(f"groups {groups}: HiSparse serves a host_resident full group and a full group of one "
                             f"block size (layout 'hisparse')")
        bs = groups[0].block_size
        spec = v.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
        group = v.KVCacheGroupSpec
        num_host_blocks = HOST_BLOCKS_PER_DEVICE_BLOCK * config.num_blocks + 1
        # +1: block 0 of each pool is vLLM's null block, so the device pool offers config.num_blocks to requests
        kv_config = v.KVCacheConfig(
            num_blocks=config.num_blocks + 1, hisparse_host_num_blocks=num_host_blocks, kv_cache_tensors=[],
            kv_cache_groups=[
                group(["latent"], spec, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
                group(["indexer"], spec, enable_kv_transfer=False, role=KVCacheGroupRole.HISPARSE_INDEXER),
                group(["resident"], HiSparseResidentSpec(block_size=bs, page_size=bs * 4), enable_kv_transfer=False),
                group(["hot"], HiSparseHotSpec(block_size=bs, page_size=bs * 4,
                                               blocks_per_request=HOT_BLOCKS_PER_REQUEST), enable_kv_transfer=False)])
        init_block_hashes(v)
        self.block_hasher = v.get_request_block_hasher(bs, v.sha256)
        self.manager = v.KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=bs,
                                        hash_block_size=bs, enable_caching=True)
        self.coordinator = get_hisparse_coordinator(self.manager)  # before the first admission, as vLLM binds it
        self.pool = self.manager.block_pool
        self.host_pool = self.coordinator.get_host_block_pool()
        self.latent, self.indexer, self.resident, self.hot = self.manager.coordinator.single_type_managers
        self.block_size, self.num_blocks, self.reserved_blocks = bs, config.num_blocks + 1, 1
        self.host_base = self.num_blocks  # a host block's id in the latent table: host_base + its id
        shape = (self.host_base + num_host_blocks, bs, config.num_kv_heads, config.head_dim)
        num_layers = max(config.num_layers, *(g.num_layers for g in groups))
        self.layers = [(v.torch.full(shape, float("nan")), v.torch.full(shape, float("nan")))
                       for _ in range(num_layers)]
        self.requests: dict[int, object] = {}
        self.pending: dict[int, tuple] = {}  # admitted, hit not yet adopted: (blocks, num_cached)
        self.settled: dict[int, int] = {}  # request -> tokens whose step completed (the in-flight count's basis)
        self.steps: dict[int, list] = {}  # request -> the worker's work of its steps not yet completed
        self.full_sequence_must_fit = False
        self.connector = _offloading_connector(self.manager, bs) if config.connector else None
        self.external: dict[int, int] = {}  # request -> external tokens the connector promised
        self.loading: dict[int, int] = {}  # request -> its local hit, while its load is in flight
        self.waits: dict[int, tuple[set, object]] = {}  # freed request -> (what its free waits for, the request)
        self.landed: set[int] = set()  # loaded requests not yet scheduled again (their blocks held, none pending)
        self.capabilities = ManagerCapabilities(block_size=bs, groups=groups, extra_keys=True, owns_pools=True,
                                                connector=config.connector, loads_keep_held=config.connector,
                                                # the store reads the indexer: get_offloading_group_ids
                                                stored_groups=(1,) if config.connector else None)

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = (), *, num_stored: int = 0):
        request = self._request(request_id, token_ids, namespace, extra_keys)
        blocks, num_cached, _ = self.manager.get_computed_blocks(request)
        request.num_computed_tokens = 0
        self.requests[request_id] = request
        self.pending[request_id] = (blocks, num_cached)
        self.settled[request_id] = num_cached
        if self.connector is not None:  # hits are whole blocks here: no partial local tail to trim
            self.connector.connector_scheduler.stored[request.request_id] = num_stored
            self.external[request_id], _ = self.connector.get_num_new_matched_tokens(request, num_cached)
        return self.block_table(request_id), num_cached

    # -- the connector ----------------------------------------------------------------------------------
    def num_external(self, request_id: int) -> int:
        return self.external.get(request_id, 0)

    def load(self, request_id: int):
        """``allocate_slots`` for the local hit and the external tokens with ``delay_cache_blocks``: the indexer's
        slots of the external tokens, the latent group's ``-1`` where the host tier's hit kept the page."""
        request = self.requests[request_id]
        blocks, num_local = self.pending[request_id]
        num_external = self.external[request_id]
        got = self.manager.allocate_slots(request, 0, num_new_computed_tokens=num_local, new_computed_blocks=blocks,
                                          num_external_computed_tokens=num_external, delay_cache_blocks=True,
                                          skip_zeroing_group_ids=self.connector.get_loaded_kv_cache_group_ids(request))
        if got is None:
            return None
        host_hit = blocks.get_block_ids()[0]
        del self.pending[request_id]
        end = num_local + num_external
        request.num_computed_tokens = self.settled[request_id] = end  # no step: a load
        self.loading[request_id] = num_local
        bs = self.block_size
        host_row = self.latent.req_to_blocks[request.request_id]
        kept = {p for p in range(num_local // bs, -(-end // bs))
                if p < len(host_hit) and host_row[p].block_id == host_hit[p]}
        latent, indexer = self.block_table(request_id)
        return ([-1 if p // bs in kept else latent[p // bs] * bs + p % bs for p in range(num_local, end)],
                [indexer[p // bs] * bs + p % bs for p in range(num_local, end)])

    def load_done(self, request_id: int, ok: bool) -> int | None:
        """The load's completion as ``HiSparseConnectorScheduler.update_connector_output`` and the scheduler's
        ``_update_waiting_for_remote_kv`` take it: ``finish_host_import``, then the loaded blocks cached; a failed
        load leaves the request at its local hit (``_update_requests_with_invalid_blocks``), cached, or, where that
        hit is none, frees its blocks (vLLM's ``_update_waiting_for_remote_kv``): it starts again from token 0
        (the protocol keeps a failed load's new hit to the local one).

        Returns:
            ``0`` where the request's blocks were freed (held again from its next ``reserve``), else ``None``."""
        num_local = self.loading.pop(request_id)
        rid = str(request_id)
        self.coordinator.finish_host_import(rid, failed=not ok)
        if request_id in self.waits:  # freed while loading: finished_recving frees its blocks now
            self.waits[request_id][0].discard("load")
            self._release(request_id)
            return None
        request = self.requests[request_id]
        self.external[request_id] = 0
        if not ok:
            request.num_computed_tokens = self.settled[request_id] = num_local
        self.pending[request_id] = (self.manager.empty_kv_cache_blocks, 0)  # its next allocate_slots passes them
        if request.num_computed_tokens:
            self.manager.cache_blocks(request, request.num_computed_tokens)
            self.landed.add(request_id)
            return None
        self.manager.free(request)  # nothing valid: a new admission with no hit (the local one was none)
        return 0

    def store_done(self, request_id: int) -> None:
        if request_id in self.waits:
            self.waits[request_id][0].discard("store")
            self._release(request_id)

    def _release(self, request_id: int) -> None:
        waits, request = self.waits[request_id]
        if not waits:
            del self.waits[request_id]
            self.manager.free(request)

    def resume(self, request_id: int):
        raise NotImplementedError("resume: not declared (capabilities.resume is False)")

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        start = self._allocate(request_id, token_ids)
        if start is None:
            return None
        self.landed.discard(request_id)
        request, end = self.requests[request_id], start + len(token_ids)
        rid = str(request_id)
        scheduled = [(rid, start, len(token_ids))]
        # HiSparseConnectorScheduler.build_connector_meta, in its order
        self.coordinator.advance_scheduled([(rid, min(end, request.num_tokens))])
        command = self.coordinator.build_offload_command()
        host_copies = self.coordinator.take_host_block_copies()
        mirrors = self.coordinator.build_row_mirrors(scheduled)
        self.coordinator.all_context_pages_resident(scheduled)
        self.coordinator.take_residency_updates([rid])
        for copy in host_copies:  # the worker's host copy-on-write, before the forward
            self._copy_page(self.host_base + copy.src_block_id, self.host_base + copy.dst_block_id)
        self.steps.setdefault(request_id, []).append(
            (end, list(command.page_transfers) if command else [], mirrors, [c.dst_block_id for c in host_copies]))
        tables = self.block_table(request_id)
        return tuple([table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
                     for table in tables)

    def _copy_page(self, source: int, destination: int) -> None:
        for k, v in self.layers:
            k[destination] = k[source]
            v[destination] = v[source]

    def _copy_rows(self, source: int, destination: int, num_rows: int) -> None:
        for k, v in self.layers:
            for pool in (k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])):
                pool[destination:destination + num_rows] = pool[source:source + num_rows]

    def commit(self, request_id: int, num_tokens: int) -> None:
        """The worker's part of the steps writing tokens below ``num_tokens``: each row mirror (device rows to
        their host page) and page transfer (a spill to the host, or a restore from it) run, then every transfer is
        reported enqueued and completed at once, by its one worker."""
        steps = self.steps.pop(request_id, [])
        done = [step for step in steps if step[0] <= num_tokens]
        if later := [step for step in steps if step[0] > num_tokens]:
            self.steps[request_id] = later
        self.settled[request_id] = num_tokens
        request = self.requests.get(request_id)
        if request is not None:
            request.num_in_flight_tokens = max(0, request.num_computed_tokens - num_tokens)
        if not done:
            return
        acks, copied = {}, []
        for _, transfers, mirrors, copies in done:
            for mirror in mirrors:  # resident rows -> host rows (the first source: the latent group's)
                self._copy_rows(mirror.source_starts[0], self.host_base * self.block_size + mirror.destination_start,
                                mirror.num_rows)
            for transfer in transfers:
                device, host = transfer.resident_block_ids[0], self.host_base + transfer.host_block_id
                self._copy_page(*((host, device) if transfer.restore else (device, host)))
                acks[transfer.transfer_id] = 1
            copied += copies
        self.coordinator.release_completed_host_copies(copied)
        self.coordinator.update_spills(acks, acks)

    def free(self, request_id: int) -> None:
        request = self.requests.pop(request_id)
        self.pending.pop(request_id, None)
        self.settled.pop(request_id, None)
        self.steps.pop(request_id, None)
        self.external.pop(request_id, None)
        self.landed.discard(request_id)
        if self.connector is None:
            self.manager.free(request)
            return
        delay, _ = self.connector.request_finished_all_groups(request, self.manager.get_block_ids(request.request_id))
        waits = ({"store"} if delay else set()) | ({"load"} if request_id in self.loading else set())
        self.waits[request_id] = (waits, request)
        self._release(request_id)

    def block_table(self, request_id: int) -> tuple[list[int], list[int]]:
        rid = str(request_id)
        if request_id in self.pending and request_id not in self.landed:
            blocks, num_cached = self.pending[request_id]
            ids = blocks.get_block_ids()
            if not any(ids):
                return [], []
            # the host group keeps a longer hit for a connector's host import; allocate_slots adopts only the
            # pages the local hit covers (KVCacheManager.retained_hit_group_ids)
            host = ids[0][:-(-num_cached // self.block_size)]
            return [self.host_base + b if b else -1 for b in host], self._ids(ids[1])
        host_row = self.latent.req_to_blocks.get(rid, [])
        resident = self.resident.get_residency_row(rid)
        # a device copy not written yet is read from the host page: a load's pages until it lands, and a page whose
        # restore (host to device, before the next forward) is planned and not yet acknowledged
        unwritten = set(range(self.loading[request_id] // self.block_size, len(host_row))
                        if request_id in self.loading else ())
        state = self.coordinator.request_states.get(rid)
        if state is not None:
            spills = self.coordinator.pending_spills
            unwritten |= {page for page, spill in state.pending_pages.items()
                          if spill in spills and spills[spill].restore}
        latent = []
        for page in range(max(len(host_row), len(resident))):
            if page in unwritten and page < len(host_row) and not host_row[page].is_null:
                latent.append(self.host_base + host_row[page].block_id)
            elif page < len(resident) and not resident[page].is_null:
                latent.append(resident[page].block_id)
            elif page < len(host_row) and not host_row[page].is_null:
                latent.append(self.host_base + host_row[page].block_id)
            else:
                latent.append(-1)
        return latent, self._ids([b.block_id for b in self.indexer.req_to_blocks.get(rid, [])])

    def kv_pools(self, layer: int):
        return self.layers[layer]

    def holds(self, request_id: int) -> bool:
        return request_id in self.waits or any(
            str(request_id) in m.req_to_blocks for m in self.manager.coordinator.single_type_managers)

    def counts(self):
        return None

    @staticmethod
    def _check_free_queue(pool, tier: str) -> None:
        free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
        assert len(free) == pool.get_num_free_blocks(), \
            f"{tier} pool: the free queue holds {len(free)} blocks, its counter says {pool.get_num_free_blocks()}"
        for block in pool.blocks:
            assert block.is_null or (block.block_id in free) == (block.ref_cnt == 0), \
                f"{tier} block {block.block_id}: ref_cnt {block.ref_cnt}, in the free queue {block.block_id in free} " \
                f"(the free queue holds exactly the unreferenced blocks)"

    def self_check(self) -> None:
        """Both pools' free queues hold exactly their unreferenced blocks (and their counters say so); every
        device block's ``ref_cnt`` is what live rows pin: indexer rows, resident pages not unpinned, hot regions,
        and spills in flight."""
        self._check_free_queue(self.pool, "device")
        self._check_free_queue(self.host_pool, "host")
        refs: dict[int, int] = {}
        for rid in {rid for m in (self.indexer, self.resident, self.hot) for rid in m.req_to_blocks}:
            state = self.coordinator.request_states.get(rid)
            unpinned = state.unpinned_pages if state is not None else set()
            held = list(self.indexer.req_to_blocks.get(rid, [])) + list(self.hot.req_to_blocks.get(rid, []))
            held += [b for page, b in enumerate(self.resident.get_residency_row(rid)) if page not in unpinned]
            for block in held:
                if not block.is_null:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for spill in self.coordinator.pending_spills.values():
            for block in spill.resident_blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.is_null or block.ref_cnt == refs.get(block.block_id, 0), \
                f"device block {block.block_id}: ref_cnt {block.ref_cnt}, but live rows pin it " \
                f"{refs.get(block.block_id, 0)} times"
