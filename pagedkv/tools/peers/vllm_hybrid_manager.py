"""vLLM 0.32's ``KVCacheManager`` over its ``HybridKVCacheCoordinator``: several KV-cache groups, a
scheduler-side KV connector and speculative decoding, as vLLM's scheduler drives them.

Configurations (:data:`CONFIGURATIONS`) are real models' layouts, scaled to a few tokens:

- ``gemma3``: full attention + sliding window (Gemma 3/4, GPT-OSS: local layers with a window, global ones);
- ``llama4``: full attention + chunked local attention (Llama 4's iRoPE chunks);
- ``qwen3_next``: full attention + a Mamba/linear-attention state (Qwen3-Next/3.5, Nemotron-H, Granite 4, Jamba),
  vLLM's ``mamba_cache_mode="align"`` (a state kept at every block boundary, so a prefix hit resumes it);
- ``gemma3_eagle``: two full-attention groups (the target's and an EAGLE draft's, ``is_eagle_group``) + a
  sliding window;
- ``mixed_block_sizes``: full attention with blocks of ``b`` tokens + a sliding window with blocks of ``2b``
  (``hash_block_size`` is their gcd, ``scheduler_block_size`` their lcm, as vLLM sizes them).

Each protocol call is the scheduler's (``vllm/v1/core/sched/scheduler.py``):

- ``admit``: ``get_computed_blocks`` (the groups' agreed hit, each group's blocks), then the connector's
  ``get_num_new_matched_tokens(request, block_aligned_local)``: the external tokens it promises beyond the
  local hit, loaded synchronously or asynchronously. An asynchronous load allocates its blocks at once
  (``allocate_slots(..., num_external_computed_tokens, delay_cache_blocks=True)``, then
  ``update_state_after_alloc``): the request is not schedulable until :meth:`~VllmHybridCacheManager.loaded`
  reports the load complete (its blocks are cached then, ``cache_blocks``) or failed (vLLM's
  ``recompute_kv_load_failures``: ``num_computed_tokens = 0``, the request's blocks freed, admitted again by a
  fresh prefix lookup). A synchronous load is adopted with the first ``reserve``.
- ``reserve``: ``allocate_slots(request, n, num_lookahead_tokens=...)``; ``n`` counts draft tokens, which are
  the request's ``spec_token_ids`` (never cached until accepted); ``reject`` drops the rejected drafts
  (``num_computed_tokens`` rolled back) and appends the accepted ones as output tokens. The slots each group
  gets are **vLLM's own slot mapping**: the worker's ``MultiGroupBlockTable`` rows filled with the request's
  block ids and ``compute_slot_mapping`` (its Triton kernel, in Triton's interpreter on a CPU) for the step's
  positions. A Mamba group has no token slots (``SlotMappingMode.NONE``): its entry is the block the step's
  running state is written into (align mode: the block of the step's last token).
- ``free``: the connector's ``request_finished_all_groups`` after ``remove_skipped_blocks``; when it stores the
  request (``store_on_finish``) the free is delayed (``pop_blocks_for_free``) until :meth:`stored`, as the
  scheduler frees a finished request's blocks only when its ``finished_sending`` arrives. Steps in flight defer
  the free as in :mod:`.vllm_manager`.

The fake connector (:class:`FakeConnector`) is a ``KVConnectorBase_V1`` with ``SupportsHMA`` in the scheduler
role: it promises what the caller offers (``offer``) and remembers what it was asked to load and store; the
K/V it "loads" is whatever the caller writes into the slots :meth:`~VllmHybridCacheManager.load_slots` names.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities
from pagedkv.tools.peers.vllm_manager import MAX_MODEL_LEN, RECIPE, VllmCacheManager, _import_vllm


@dataclasses.dataclass(frozen=True)
class Group:
    """One KV-cache group: ``kind`` ``"full"``, ``"sliding_window"`` (``size`` = window_left: a query attends
    to itself and ``size`` tokens back), ``"chunked_local"`` (``size`` = chunk tokens) or ``"mamba"`` (a
    recurrent state per block boundary); ``block_size`` tokens per block; ``draft`` an EAGLE/MTP draft group."""

    kind: str
    block_size: int
    size: int | None = None
    draft: bool = False


def configuration(name: str, block_size: int = 2) -> tuple[Group, ...]:
    """The groups of a named model layout (module docstring), at ``block_size`` tokens per block.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    b = block_size
    layouts = {
        "gemma3": (Group("full", b), Group("sliding_window", b, 2 * b)),
        "llama4": (Group("full", b), Group("chunked_local", b, 2 * b)),
        "qwen3_next": (Group("full", b), Group("mamba", b)),
        "gemma3_eagle": (Group("full", b), Group("full", b, draft=True), Group("sliding_window", b, 2 * b - 1)),
        "mixed_block_sizes": (Group("full", b), Group("sliding_window", 2 * b, 3 * b)),
    }
    if name not in layouts:
        raise ValueError(f"configuration {name!r}: known are {sorted(layouts)}")
    return layouts[name]


#: The configurations this peer is gated in (each a real model's layout, :func:`configuration`).
CONFIGURATIONS = ("gemma3", "llama4", "qwen3_next", "gemma3_eagle", "mixed_block_sizes")


def _vllm_spec(v, group: Group):
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    common = dict(block_size=group.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if group.kind == "full":
        return v.FullAttentionSpec(**common)
    if group.kind == "sliding_window":
        return v.SlidingWindowSpec(**common, sliding_window=group.size + 1)
    if group.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=group.size)
    if group.kind == "mamba":
        return MambaSpec(block_size=group.block_size, shapes=((1, 1),), dtypes=(torch.float32,),
                         mamba_cache_mode="align")
    raise ValueError(f"group kind {group.kind!r}: expected full, sliding_window, chunked_local or mamba")


def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                   SupportsHMA)

    class FakeConnector(KVConnectorBase_V1, SupportsHMA):
        """A scheduler-side connector: promises the external tokens offered for a request (capped where vLLM
        requires: the prompt minus one token, whole scheduler blocks), records its load plans and delays the
        free of requests it stores."""

        def __init__(self, kv_cache_config, block_size: int) -> None:
            import types
            config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(is_kv_producer=True))
            super().__init__(config, role=None, kv_cache_config=kv_cache_config)
            self.block_size = block_size
            self.offers: dict[str, tuple[int, bool]] = {}  # request -> (external tokens, async)
            self.load_plans: dict[str, tuple[int, int]] = {}  # request -> (first external token, count)
            self.store_on_finish: set[str] = set()
            self.storing: dict[str, tuple[list[int], ...]] = {}  # request -> block ids being stored

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            offered, load_async = self.offers.pop(request.request_id, (0, False))
            end = min(num_computed_tokens + offered, request.num_tokens - 1)
            end -= end % self.block_size
            external = max(0, end - num_computed_tokens)
            return external, load_async and external > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            if num_external_tokens:
                start = request.num_computed_tokens if request.num_computed_tokens else None
                self.load_plans.setdefault(request.request_id, (start, num_external_tokens))

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished_all_groups(self, request, block_ids):
            if request.request_id in self.store_on_finish:
                self.store_on_finish.discard(request.request_id)
                self.storing[request.request_id] = block_ids
                return True, None
            return False, None

        # worker-side methods: this connector never runs in a worker
        def start_load_kv(self, forward_context, **kwargs):
            raise NotImplementedError

        def wait_for_layer_load(self, layer_name):
            raise NotImplementedError

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise NotImplementedError

        def wait_for_save(self):
            raise NotImplementedError

    return FakeConnector


class _SlotMapping:
    """vLLM's worker-side ``MultiGroupBlockTable`` for one request row: ``slots(tables, start, end)`` is each
    group's ``slot_mapping`` for positions ``start..end`` (``compute_slot_mapping``, vLLM's Triton kernel)."""

    def __init__(self, groups: Sequence[Group], max_tokens: int) -> None:
        if "TRITON_INTERPRET" not in os.environ:
            import torch
            if not torch.cuda.is_available():
                os.environ["TRITON_INTERPRET"] = "1"
        import torch

        from pagedkv.backends.interpreter import wrap_interpreted_launches
        from pagedkv.tools.peers.vllm import _real_triton_in_vllm
        try:
            _real_triton_in_vllm()
            from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode
        except ImportError as exc:
            raise BackendUnavailableError(f"vLLM's worker block table does not import ({exc}); install: "
                                          f"{RECIPE}") from exc
        wrap_interpreted_launches()
        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.modes = [SlotMappingMode.NONE if g.kind == "mamba" else SlotMappingMode.TOKEN_TO_KV_SLOT
                      for g in groups]
        self.table = MultiGroupBlockTable(
            max_num_reqs=1, max_num_batched_tokens=max_tokens, pin_memory=False, device=self.device,
            block_sizes=[g.block_size for g in groups],
            max_num_blocks=[math.ceil(MAX_MODEL_LEN / g.block_size) + 1 for g in groups],
            slot_mapping_modes=self.modes)

    def slots(self, tables: Sequence[Sequence[int]], start: int, end: int) -> list[list[int] | None]:
        """Each group's slots of positions ``start..end`` (``None`` for a state group)."""
        torch, n = self.torch, end - start
        self.table.add_row(tuple(list(t) for t in tables), 0)
        self.table.commit_block_table(1)
        self.table.compute_slot_mapping(1, torch.tensor([0, n], dtype=torch.int32, device=self.device),
                                        torch.arange(start, end, dtype=torch.int64, device=self.device))
        self.table.clear_row(0)
        return [None if mode.value == "none" else bt.slot_mapping.gpu[:n].tolist()
                for bt, mode in zip(self.table.block_tables, self.modes)]


class VllmHybridCacheManager(VllmCacheManager):
    """``KVCacheManager`` with several KV-cache groups in one block pool, a :class:`FakeConnector` and
    speculative decoding (module docstring). ``num_blocks`` blocks are offered (block 0 is vLLM's null block)."""

    def __init__(self, groups: Sequence[Group], num_blocks: int, *, num_lookahead: int = 0) -> None:
        v = self.v = _import_vllm()
        self.groups = tuple(groups)
        specs = [_vllm_spec(v, g) for g in self.groups]
        kv_config = v.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[
            v.KVCacheGroupSpec([f"layer{i}"], spec, is_eagle_group=g.draft)
            for i, (g, spec) in enumerate(zip(self.groups, specs))])
        sizes = [g.block_size for g in self.groups]
        self.hash_block_size, self.block_size = math.gcd(*sizes), math.lcm(*sizes)
        v.init_none_hash(v.sha256)
        self.block_hasher = v.get_request_block_hasher(self.hash_block_size, v.sha256)
        self.manager = v.KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=self.block_size,
                                        hash_block_size=self.hash_block_size, enable_caching=True,
                                        use_eagle=any(g.draft for g in self.groups))
        self.pool = self.manager.block_pool
        self.num_blocks, self.reserved_blocks, self.num_lookahead = num_blocks + 1, 1, num_lookahead
        self.connector = _connector_class()(kv_config, self.block_size)
        self.slot_mapping = _SlotMapping(self.groups, MAX_MODEL_LEN)
        self.requests, self.pending, self.settled, self.deferred = {}, {}, {}, {}
        self.loading: dict[int, int] = {}  # request -> tokens computed once its asynchronous load completes
        self.drafts: dict[int, list[int]] = {}  # request -> draft tokens of its last step
        self.capabilities = ManagerCapabilities(block_size=self.block_size, extra_keys=True, evict=True, reset=True,
                                                async_steps=True)

    # -- admission, the connector -----------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = (), external: int = 0, load_async: bool = False):
        """The scheduler's admission: ``(each group's hit block ids, num_cached_tokens)``; ``num_cached_tokens``
        counts the connector's external tokens (``external`` offered, :meth:`load_slots` where they go).
        An asynchronous load that does not fit is ``None`` (nothing changed)."""
        request = self._request(request_id, token_ids, namespace, extra_keys)
        blocks, num_local, _ = self.manager.get_computed_blocks(request)
        self.connector.offers[str(request_id)] = (external, load_async)
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        request.num_computed_tokens = 0
        self.requests[request_id] = request
        self.settled[request_id] = num_local + num_external
        if load_async:
            got = self.manager.allocate_slots(request, 0, num_new_computed_tokens=num_local,
                                              new_computed_blocks=blocks, num_external_computed_tokens=num_external,
                                              delay_cache_blocks=True)
            if got is None:
                del self.requests[request_id], self.settled[request_id]
                return None
            request.num_computed_tokens = num_local + num_external
            self.connector.update_state_after_alloc(request, self.manager.get_blocks(str(request_id)), num_external)
            self.connector.load_plans[str(request_id)] = (num_local, num_external)
            self.loading[request_id] = num_local + num_external
        else:
            self.pending[request_id] = (blocks, num_local, num_external)
            if num_external:
                self.connector.load_plans[str(request_id)] = (num_local, num_external)
        return [list(t) for t in self.block_tables(request_id)], num_local + num_external

    def load_slots(self, request_id: int) -> tuple[int, int, list]:
        """``(first, count, slots)``: the external tokens ``first..first+count`` the connector loads and each
        group's slots for them (vLLM's slot mapping; known once their blocks are allocated)."""
        first, count = self.connector.load_plans.get(str(request_id), (0, 0))
        if not count:
            return 0, 0, [[] for _ in self.groups]
        tables = self._raw_tables(request_id)
        null = self.pool.null_block.block_id
        slots = self.slot_mapping.slots(tables, first, first + count)
        for g, group in enumerate(self.groups):  # a block the group released (outside its window) is not loaded
            if slots[g] is not None:
                slots[g] = [-1 if tables[g][p // group.block_size] == null else s
                            for p, s in zip(range(first, first + count), slots[g])]
        return first, count, slots

    def loaded(self, request_id: int, ok: bool = True):
        """The asynchronous load of ``request_id`` completed (``ok``) or failed. Completed: its blocks are
        cached (``cache_blocks``); failed: recompute (``num_computed_tokens = 0``, its blocks freed, a fresh
        prefix lookup): returns ``admit``'s answer for the recompute, or ``None`` after a success."""
        request = self.requests[request_id]
        self.loading.pop(request_id)
        self.connector.load_plans.pop(str(request_id), None)
        if ok:
            self.manager.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                request.num_computed_tokens = request.num_tokens - 1
            self.settled[request_id] = request.num_computed_tokens
            return None
        request.num_computed_tokens = 0
        self.manager.free(request)
        del self.requests[request_id], self.settled[request_id]
        return self.admit(request_id, request.prompt_token_ids, request.cache_salt, ())

    def stored(self, request_id: int) -> None:
        """The connector's store of a finished request completed (``finished_sending``): its blocks are freed."""
        blocks = self.deferred.pop(("store", request_id))
        self.pool.free_blocks(reversed(blocks))

    # -- steps, speculative decoding ------------------------------------------------------------------
    def reserve(self, request_id: int, token_ids: Sequence[int], num_draft: int = 0):
        """Each group's slots for the request's next tokens, the last ``num_draft`` of them draft tokens
        (speculative decoding: never cached until accepted, see :meth:`reject`); ``None``: refused (out of
        blocks, or the request waits for its load)."""
        if request_id in self.loading:
            return None
        request = self.requests[request_id]
        blocks, num_local, num_external = self.pending.get(request_id, (None, 0, 0))
        start = request.num_computed_tokens + num_local + num_external
        verified = list(token_ids[:len(token_ids) - num_draft])
        extra = start + len(verified) - request.num_tokens
        if extra > 0:
            request.append_output_token_ids(verified[len(verified) - extra:])
        request.spec_token_ids = list(token_ids[len(verified):])
        request.num_in_flight_tokens = max(0, start - self.settled[request_id])
        got = self.manager.allocate_slots(request, len(token_ids), num_new_computed_tokens=num_local,
                                          new_computed_blocks=blocks, num_external_computed_tokens=num_external,
                                          num_lookahead_tokens=self.num_lookahead)
        if got is None:
            if extra > 0:
                del request._output_token_ids[-extra:]
                del request._all_token_ids[-extra:]
            request.spec_token_ids = []
            return None
        self.pending.pop(request_id, None)
        request.num_computed_tokens = start + len(token_ids)
        self.drafts[request_id] = list(request.spec_token_ids)
        end = start + len(token_ids)
        slots = self.slot_mapping.slots(self._raw_tables(request_id), start, end)
        tables = self._raw_tables(request_id)
        for g, group in enumerate(self.groups):
            if group.kind == "mamba":
                slots[g] = [tables[g][(end - 1) // group.block_size]]
        return slots

    def reject(self, request_id: int, num_rejected: int) -> None:
        """Verification of the last step's drafts: the first ``len(drafts) - num_rejected`` are accepted (output
        tokens now), the rest dropped (``num_computed_tokens`` rolled back, as the scheduler does)."""
        request = self.requests[request_id]
        drafts = self.drafts.pop(request_id, [])
        if not 0 <= num_rejected <= len(drafts):
            raise ValueError(f"num_rejected {num_rejected}: the last step had {len(drafts)} draft tokens")
        accepted = drafts[:len(drafts) - num_rejected]
        request.spec_token_ids = []
        request.num_computed_tokens -= num_rejected
        if accepted:
            request.append_output_token_ids(accepted)
        self.settled[request_id] = min(self.settled[request_id], request.num_computed_tokens)

    # -- release -------------------------------------------------------------------------------------
    def free(self, request_id: int, store: bool = False) -> None:
        """Finish or abort; ``store``: the connector stores the request, its blocks freed by :meth:`stored`."""
        request = self.requests.pop(request_id)
        self.pending.pop(request_id, None)
        self.loading.pop(request_id, None)
        self.drafts.pop(request_id, None)
        self.connector.load_plans.pop(str(request_id), None)
        if store:
            self.connector.store_on_finish.add(str(request_id))
        self.manager.remove_skipped_blocks(str(request_id), max(0, request.num_computed_tokens
                                                                - request.num_in_flight_tokens),
                                           num_prompt_tokens=request.num_prompt_tokens)
        ids = self.manager.get_block_ids_for_computed_tokens(str(request_id), request.num_computed_tokens)
        delay, _ = self.connector.request_finished_all_groups(request, ids)
        if delay:
            self.deferred[("store", request_id)] = self.manager.pop_blocks_for_free(request)
            self.settled.pop(request_id, None)
        elif request.num_computed_tokens > self.settled[request_id]:
            self.deferred[request_id] = (self.manager.pop_blocks_for_free(request), request.num_computed_tokens)
        else:
            self.settled.pop(request_id, None)
            self.manager.free(request)

    # -- what the machine reads -------------------------------------------------------------------------
    def _raw_tables(self, request_id: int) -> tuple[list[int], ...]:
        if request_id in self.pending:
            blocks = self.pending[request_id][0]
            return tuple(blocks.get_block_ids()) if blocks.blocks else tuple([] for _ in self.groups)
        return self.manager.get_block_ids(str(request_id))

    def block_tables(self, request_id: int) -> tuple[list[int], ...]:
        """Each group's block ids in order, ``-1`` where the group released (or never needed) a block."""
        return tuple(self._ids(t) for t in self._raw_tables(request_id))

    def block_table(self, request_id: int) -> list[int]:
        """The first group's table (the one-group view)."""
        return self.block_tables(request_id)[0]

    def self_check(self) -> None:
        refs: dict[int, int] = {}
        for request_id in self.requests:
            if request_id in self.pending:
                continue
            for table in self.block_tables(request_id):
                for b in set(table) - {-1}:
                    refs[b] = refs.get(b, 0) + 1
        for entry in self.deferred.values():
            blocks = entry[0] if isinstance(entry, tuple) else entry
            for b in {b.block_id for b in blocks if not b.is_null}:
                refs[b] = refs.get(b, 0) + 1
        owners: dict[int, list] = {}
        for request_id in self.requests:
            if request_id not in self.pending:
                for g, table in enumerate(self.block_tables(request_id)):
                    for b in set(table) - {-1}:
                        owners.setdefault(b, []).append((request_id, g))
        for b, holders in owners.items():
            assert len({g for _, g in holders}) == 1, \
                f"block {b} is held by more than one KV-cache group: (request, group) {holders}"
        free_ids = {b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()}
        assert len(free_ids) == self.pool.get_num_free_blocks(), \
            f"free queue holds {len(free_ids)} blocks, its counter says {self.pool.get_num_free_blocks()}"
        for block in self.pool.blocks:
            if block.is_null:
                continue
            want = refs.get(block.block_id, 0)
            assert block.ref_cnt == want, \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, but {want} live block tables hold it"
            assert (block.block_id in free_ids) == (want == 0), \
                f"block {block.block_id}: in the free queue {block.block_id in free_ids}, held by {want} tables"


def hybrid_cache_manager(name: str, num_blocks: int, block_size: int = 2, num_lookahead: int = 0):
    """A :class:`VllmHybridCacheManager` in configuration ``name`` (:data:`CONFIGURATIONS`).

    Raises:
        BackendUnavailableError: vLLM is not installed (the message gives the install command).
        ValueError: an unknown configuration.
    """
    return VllmHybridCacheManager(configuration(name, block_size), num_blocks, num_lookahead=num_lookahead)
