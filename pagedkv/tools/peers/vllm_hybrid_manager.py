"""vLLM 0.32's ``KVCacheManager`` over its ``HybridKVCacheCoordinator`` in the grouped cache-manager
protocol: several KV-cache groups in one block pool, a scheduler-side KV connector and speculative drafts,
driven as vLLM's scheduler drives them (``vllm/v1/core/sched/scheduler.py``).

The layouts are the protocol's real-model layouts (:data:`~pagedkv.testing.managers.protocol.HYBRID_LAYOUTS`):
full + sliding window (Gemma 3), full + chunked local (Llama 4), full + Mamba (Jamba, Qwen3-Next: vLLM's
``mamba_cache_mode="align"``, a state kept at every block boundary so that a hit resumes it), two full groups
+ sliding window (GPT-OSS as vLLM splits it), groups of different block sizes (``hash_block_size`` their
gcd, ``scheduler_block_size`` their lcm, as vLLM sizes them), and three attention types (Hymba's full +
sliding window + Mamba, DeepSeek-V4's full + two windows, two windows of different block sizes: the
coordinator's fixed-point hit loop and its spec groups of one manager class), and Gemma 3 under sparse
prefix-cache retention (``gemma3-sparse``: vLLM 0.32's engine default ``--prefix-cache-retention-interval 0``,
a window group keeping only the blocks a hit at the replay boundary or a shared-prefix junction needs;
``gemma3-interval``: also one boundary every 3 scheduler blocks, as ``deepseek-v4-interval`` serves DeepSeek-V4's
two windows; ``qwen3-next-sparse``: a Mamba group keeping
only those boundaries' states; ``KVCacheConfig.prefix_cache_retention_interval``, declared so the hit promise
and the eviction model follow it), and Qwen3-Next served with fine-grained partial hash hits (``qwen3-next-fine``:
``--prefix-match-unit`` finer than the Mamba block, so hits land inside a block; the peer holds the pools, runs the
scheduler's copy-on-write copies in them as vLLM's worker does and keeps one state per Mamba block:
:class:`_StatePools`; ``nemotron-h-fine`` the same for Mamba2 layers, whose prompt's last chunk exports the state at
its replay boundary into a block vLLM reserved for it, ``MambaSpec.num_prefill_checkpoint_blocks``), Mamba2 layers
at the block granularity (``nemotron-h``: every prefill chunk exports the state one block before its end;
``nemotron-h-interval``: under a retention interval, kept only on the interval's boundaries; ``nemotron-h-sparse``:
under sparse retention, only the prefill's last chunk exports), and
DeepSeek-V3.2's sparse MLA served with a host tier (``hisparse``: vLLM's HiSparse,
:mod:`.vllm_hisparse_manager`). vLLM's LRU eviction order is
declared where the machine knows what vLLM caches (no Mamba group, no EAGLE), and the lookahead slots
(``num_lookahead_tokens``) where drafts are on.

- ``admit``: ``get_computed_blocks`` (one hit every group agrees on, each group's blocks); with a connector,
  its ``get_num_new_matched_tokens(request, block_aligned_local_hit)`` names the external tokens past it.
- ``load``: ``allocate_slots(..., num_external_computed_tokens, delay_cache_blocks=True,
  skip_zeroing_group_ids=connector.get_loaded_kv_cache_group_ids(request))`` and ``update_state_after_alloc``, as
  for an asynchronous load (``WAITING_FOR_REMOTE_KVS``). Where the peer holds the pools, a block the load writes
  that vLLM still recorded for the worker's zeroing (``new_block_ids_to_zero``: Mamba layers) is zeroed after the
  load's data, an order the race between the two allows. ``load_done(ok)``:
  ``cache_blocks`` of the loaded tokens, or, failed, vLLM's ``recompute_kv_load_failures``:
  ``num_computed_tokens = 0``, the request's blocks freed and its prefix looked up afresh (the coordinator's
  lookup capped at the local hit it had) and allocated at once, as the scheduler's waiting-queue pass does.
- ``reserve``: ``allocate_slots(request, n, num_lookahead_tokens=num_speculative_tokens)``; draft tokens are
  the request's ``spec_token_ids`` (never cached: ``allocate_slots`` caches up to ``request.num_tokens``);
  ``drop`` rolls ``num_computed_tokens`` back over the rejected drafts and appends the accepted ones as output
  tokens. The slots are **vLLM's own slot mapping**: the worker's ``MultiGroupBlockTable`` row filled with the
  request's block ids and ``compute_slot_mapping`` (vLLM's Triton kernel, in Triton's interpreter on a CPU)
  for the step's positions. A Mamba group has no slot mapping in vLLM (``SlotMappingMode.NONE``: the worker
  indexes states by block id), so its slots are ``block_id * block_size + offset`` of the request's table,
  ``-1`` where the group holds no block.
- ``commit``: a step completed, the scheduler's next one starts (``new_step_starts``).
- ``resume``: vLLM's preemption (``Scheduler._preempt_request``): the request's blocks freed, the same ``Request``
  looked up again with its output, its prompt the admitted one (the prefill's end, ``num_tokens - 1``, past it).
- ``free``: the connector's ``request_finished_all_groups`` (without the ``remove_skipped_blocks`` vLLM's
  scheduler calls first: the protocol holds every block of a stored request until its store completes, so
  a window's out-of-window blocks are stored too); the fake connector stores every finished request, so the
  blocks are popped (``pop_blocks_for_free``) and freed at ``store_done`` (vLLM's ``finished_sending``) through
  the scheduler's own deferred-free drain (``Scheduler._drain_deferred_frees``: tail first); a request freed
  while its load is in flight keeps its blocks until ``load_done``
  (``finished_recving``); steps in flight defer the free as in :mod:`.vllm_manager`.

The drafter's prefill lookahead (``num_prefill_lookahead``) is vLLM's: 1 under EAGLE, ``num_speculative_tokens``
under a multi-module MTP drafter (the ``mtp-multi-module`` layout); the coordinator leaves that many less one tokens
of each step uncached (declared as ``capabilities.reprefill``, which the hit promise follows). The scheduler's clip
of a prefill chunk ending within the lookahead of the prompt's end (``Scheduler._reserve_prefill_lookahead``) is not
applied: the machine chooses the chunks.

Speculative decoding is on in the layouts without chunked local attention (vLLM refuses EAGLE there) and
without a Mamba group (vLLM keeps draft states in ``num_speculative_blocks`` scratch blocks addressed from
the last state block, not at the drafts' positions that the protocol's state slots name). Beside a Mamba group
EAGLE's server runs without drafts: the lookup's dropped block, the checkpoints at its replay boundary and the
Mamba group's scratch blocks (``num_speculative_tokens`` of them, as vLLM's ``MambaBase.get_kv_cache_spec``
declares them) are vLLM's.

The fake connector (``FakeConnector``) is a ``KVConnectorBase_V1`` with ``SupportsHMA`` in the scheduler role:
it promises what the store (the machine) holds, capped as vLLM requires (the prompt less one token, whole
scheduler blocks), and records the loads and stores it was asked for.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import sys
import types
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.protocol import ExtraKey, GroupSpec, ManagerCapabilities, ManagerConfig
from pagedkv.tools.peers import vllm_manager
from pagedkv.tools.peers.vllm_manager import MAX_MODEL_LEN, RECIPE, VllmCacheManager, _import_vllm


#: The peer's name (what the summary and the peers table call it).
name = "vllm_cache_manager"

def _vllm_spec(v, group: GroupSpec, num_speculative_blocks: int = 0):
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    common = dict(block_size=group.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if group.kind == "full":
        return v.FullAttentionSpec(**common)
    if group.kind == "sliding_window":
        return v.SlidingWindowSpec(**common, sliding_window=group.window + 1)
    if group.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=group.chunk)
    if group.kind == "mamba":
        # Mamba2 layers export the prompt's checkpoint state from inside a chunk (MambaMixer2.get_kv_cache_spec)
        checkpoints = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1) \
            if group.prefill_checkpoints else {}
        # a drafter's per-draft-token states: num_speculative_tokens scratch blocks (MambaBase.get_kv_cache_spec)
        return MambaSpec(block_size=group.block_size, shapes=((1, 1),), dtypes=(torch.float32,),
                         mamba_cache_mode="align", num_speculative_blocks=num_speculative_blocks, **checkpoints)
    raise ValueError(f"group kind {group.kind!r}: expected full, sliding_window, chunked_local or mamba")


def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                   SupportsHMA)

    class FakeConnector(KVConnectorBase_V1, SupportsHMA):
        """A scheduler-side connector over the machine's store: ``stored[request_id]`` tokens of the prompt are
        held externally; it promises those past the local hit (capped: the prompt less one token, whole scheduler
        blocks, or as it is with ``token_loads``: a P/D prefiller's store, ``NixlConnector``'s remote prefill),
        records each load plan, and keeps every finished request's blocks for a store
        (``request_finished_all_groups`` returns ``True``: freed at ``finished_sending``)."""

        def __init__(self, kv_cache_config, block_size: int, token_loads: bool = False) -> None:
            import types
            config = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(is_kv_producer=True))
            super().__init__(config, role=None, kv_cache_config=kv_cache_config)
            self.block_size = block_size
            self.token_loads = token_loads  # the store is a P/D prefiller's (any prefix), not whole blocks
            self.stored: dict[str, int] = {}  # request -> prompt tokens the external store holds
            self.load_plans: dict[str, int] = {}  # request -> external tokens allocated for its load
            self.storing: dict[str, tuple[list[int], ...]] = {}  # request -> block ids being stored

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            # the store holds every group's state of the prompt (a Mamba one with its tokens); claimed for the
            # models vLLM's per-group lookup is written for, full attention and Mamba groups only
            specs = [g.kv_cache_spec for g in self._kv_cache_config.kv_cache_groups]
            return all(type(spec).__name__ in ("FullAttentionSpec", "MambaSpec") for spec in specs)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            end = min(self.stored.pop(request.request_id, 0), request.num_tokens - 1)
            if not self.token_loads:  # an offloading store's whole blocks
                end -= end % self.block_size
            external = max(0, end - num_computed_tokens)
            return external, external > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            if num_external_tokens:
                self.load_plans[request.request_id] = num_external_tokens

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished_all_groups(self, request, block_ids):
            self.load_plans.pop(request.request_id, None)
            self.storing[request.request_id] = block_ids
            return True, None

        # the worker side: this connector never runs in a worker
        def start_load_kv(self, forward_context, **kwargs):
            raise NotImplementedError

        def wait_for_layer_load(self, layer_name):
            raise NotImplementedError

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise NotImplementedError

        def wait_for_save(self):
            raise NotImplementedError

    return FakeConnector


#: Slot mappings kept over every manager of a process (the least recently used dropped first).
SLOT_MEMO_SIZE = 8192


@functools.lru_cache(maxsize=256)
def _block_table(block_sizes: tuple[int, ...], modes: tuple, num_tokens: int, device):
    """vLLM's worker-side ``MultiGroupBlockTable`` for one request row and steps of ``num_tokens`` tokens (a full
    batch: ``max_num_batched_tokens`` is the step's tokens, so the kernel's last program pads no slot)."""
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    return MultiGroupBlockTable(max_num_reqs=1, max_num_batched_tokens=max(num_tokens, 1), pin_memory=False,
                                device=device, block_sizes=list(block_sizes),
                                max_num_blocks=[math.ceil(MAX_MODEL_LEN / bs) + 1 for bs in block_sizes],
                                slot_mapping_modes=list(modes))


@functools.lru_cache(maxsize=SLOT_MEMO_SIZE)
def _vllm_slots(block_sizes: tuple[int, ...], modes: tuple, device, start: int, end: int,
                entries: tuple[tuple[int, ...] | None, ...]) -> tuple[tuple[int, ...] | None, ...]:
    """Each group's slots of positions ``start..end`` from vLLM's ``compute_slot_mapping`` (its Triton kernel),
    ``entries`` each group's table entries up to the block of position ``end - 1``: all the kernel reads (``None``
    for a state group, which has no slot mapping)."""
    import torch

    n = end - start
    table = _block_table(block_sizes, modes, n, device)
    table.add_row(tuple(list(e or ()) for e in entries), 0)
    table.commit_block_table(1)
    table.compute_slot_mapping(1, torch.tensor([0, n], dtype=torch.int32, device=device),
                               torch.arange(start, end, dtype=torch.int64, device=device))
    table.clear_row(0)
    return tuple(None if e is None else tuple(bt.slot_mapping.gpu[:n].tolist())
                 for bt, e in zip(table.block_tables, entries))


class _SlotMapping:
    """vLLM's worker-side block table for one request row: ``slots(tables, start, end)`` is each group's
    ``slot_mapping`` for positions ``start..end`` (``compute_slot_mapping``, vLLM's Triton kernel).

    The table is built per step size with ``max_num_batched_tokens`` equal to the step's tokens
    (:func:`_block_table`): the kernel's last program pads the slot mapping from the step's tokens to
    ``max_num_batched_tokens``, which nothing here reads, and in Triton's interpreter a 4,096-token pad cost more
    than the slots themselves. The kernel reads only the positions and the table entries they fall in, so its
    answer is kept per those (:func:`_vllm_slots`, shared by the managers a search builds): a search asks the same
    ones again and again (two of three launches in a ``qwen3-next-fine`` search), and the machine judges every slot
    returned either way."""

    def __init__(self, groups: Sequence[GroupSpec], max_tokens: int) -> None:
        import torch

        if not torch.cuda.is_available():  # vLLM's kernel runs in Triton's interpreter on a CPU
            os.environ.setdefault("TRITON_INTERPRET", "1")

        from pagedkv.backends.interpreter import wrap_interpreted_launches
        from pagedkv.tools.peers.vllm import _real_triton_in_vllm
        try:
            _real_triton_in_vllm()
            from vllm.v1.worker.block_table import SlotMappingMode
        except ImportError as exc:
            raise BackendUnavailableError(f"vLLM's worker block table does not import ({exc}); install: "
                                          f"{RECIPE}") from exc
        wrap_interpreted_launches()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.modes = tuple(SlotMappingMode.NONE if g.kind == "mamba" else SlotMappingMode.TOKEN_TO_KV_SLOT
                           for g in groups)
        self.block_sizes = tuple(g.block_size for g in groups)
        self.max_tokens = max_tokens

    def slots(self, tables: Sequence[Sequence[int]], start: int, end: int) -> list[list[int] | None]:
        """Each group's slots of positions ``start..end`` (``None`` for a state group)."""
        n = end - start
        if not 0 <= n <= self.max_tokens:
            raise ValueError(f"a step of {n} tokens (positions {start}..{end}): 0 to {self.max_tokens} fit")
        entries = tuple(None if mode.value == "none" else tuple(t[:-(-end // bs)])
                        for t, mode, bs in zip(tables, self.modes, self.block_sizes))
        return [None if slots is None else list(slots)
                for slots in _vllm_slots(self.block_sizes, self.modes, self.device, start, end, entries)]


def _scheduler_class():
    """vLLM's ``Scheduler`` class (its methods run here on the few attributes they read)."""
    package = sys.modules.get("vllm.v1.structured_output")
    if package is not None and not hasattr(package, "StructuredOutputManager"):
        # the package entered without its __init__ (vllm_manager._import_vllm): the scheduler module
        # names the class at import and never calls it here
        package.StructuredOutputManager = None
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _drain_deferred_free(manager, blocks) -> None:
    """Return a deferred free's ``blocks`` (``pop_blocks_for_free``'s, allocation order) to the pool as vLLM's
    scheduler does once the step fencing them completed: its own ``Scheduler._drain_deferred_frees`` (tail
    blocks evicted first) on the one fenced entry."""
    state = types.SimpleNamespace(deferred_frees=collections.deque([(0, blocks)]), processed_step_seq=0,
                                  kv_cache_manager=manager)
    _scheduler_class()._drain_deferred_frees(state)


class _MambaSplit:
    """The scheduler's clip of a prefill chunk to where a Mamba state must be cached ("align" mode: a state is
    written at a step's end, so a chunk ends on a block boundary): vLLM's own
    ``Scheduler._mamba_block_aligned_split`` on the scheduler state it reads, as ``Scheduler.__init__`` sets
    it for this layout (no EAGLE, a token budget of ``MAX_MODEL_LEN``). ``split(request, n, num_local)``:
    how many of ``n`` tokens the step takes (0: none this step)."""

    def __init__(self, manager, block_size: int, hash_block_size: int) -> None:
        import types

        from vllm.v1.kv_cache_interface import MambaSpec

        self.method = _scheduler_class()._mamba_block_aligned_split
        specs = [g.kv_cache_spec for g in manager.kv_cache_config.kv_cache_groups]
        mamba = [spec for spec in specs if isinstance(spec, MambaSpec)]
        partial = hash_block_size < block_size and manager.coordinator.enable_partial_hash_hits
        self.state = types.SimpleNamespace(
            cache_config=types.SimpleNamespace(block_size=block_size), block_size=block_size,
            hash_block_size=hash_block_size, mamba_partial_cache_hit=partial,
            use_eagle_block_drop=bool(manager.coordinator.eagle_group_ids),
            mamba_has_prefill_checkpoint_blocks=all(spec.num_prefill_checkpoint_blocks > 0 for spec in mamba),
            mamba_prefill_checkpoint_alignment=mamba[0].prefill_checkpoint_alignment,
            max_num_scheduled_tokens=MAX_MODEL_LEN,
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
            mamba_shared_prefix_checkpoint=partial and manager.mamba_shared_prefix_checkpoint)

    def __call__(self, request, num_new_tokens: int, num_local: int) -> int:
        return self.method(self.state, request, num_new_tokens, num_local)


@dataclasses.dataclass(eq=False)
class _Forward:
    """A copy-on-write (:meth:`_StatePools.copy`) run again as the uncompleted steps it ``waits`` on complete:
    ``content`` is the source's first ``tokens`` offsets in every pool tensor as the copy read them (refreshed where
    a completing step wrote the source, or from ``after``, the earlier such copy that filled the source), written
    into ``dst`` while it ``delivers`` (until ``dst`` is handed out afresh)."""

    src: int
    dst: int
    tokens: int
    waits: set
    content: list
    after: _Forward | None = None
    delivers: bool = True


class _StatePools:
    """The pools of a fine-grained layout, held as vLLM's worker holds them: per layer slot a K and a V tensor of
    ``[num_blocks, max block_size, num_kv_heads, head_dim]`` float32 (layer ``i`` of every group on one page; NaN
    until written), which the machine writes and reads.

    - ``copy(copies)``: the scheduler's copy-on-write pairs ``(src, dst, tokens)`` as the worker runs them before
      the step's forward (``copy_kv_cache_blocks_inplace`` in ``vllm/v1/worker/utils.py``: ``blocks[dst] =
      blocks[src]`` in every KV cache tensor; its module does not import without the worker's dependencies, so the
      one line is here). The worker runs a step's copies after every earlier step's forward (one stream); the
      machine completes in-flight steps later, so a copy whose source an in-flight step still writes is run again
      as that step completes (``settle``), for the source's first ``tokens`` offsets only: what the partial hit
      covers (the destination's owner writes past them). It delivers the source as the copy read it (a
      :class:`_Forward` keeps that content), with the offsets the step or an earlier such copy fills: the source
      may be handed out and written again before the step completes, which the worker's copy never sees.
    - One state per Mamba block: a Mamba "align" block holds one recurrent state, overwritten in place by each
      step ending in it (``MambaManager.allocate_new_blocks``: the running state lives in the last state block);
      the protocol names the state after token ``p`` at offset ``p % block_size`` of its block, so a state written
      at one offset voids the block's others as its step completes (``settle``), and a partly hit block whose copy
      was never made reads as the overwritten block it is.
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int, config: ManagerConfig) -> None:
        import torch

        self.torch, self.groups = torch, tuple(groups)
        shape = (num_blocks, max(g.block_size for g in groups), config.num_kv_heads, config.head_dim)
        num_layers = max(config.num_layers, *(g.num_layers for g in groups))
        self.layers = [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(num_layers)]
        # request -> its uncompleted steps: (end, blocks written, Mamba states written as (group, block, offset))
        self.writes: dict[int, list[tuple[int, set[int], list[tuple[int, int, int]]]]] = {}
        # copies whose source an uncompleted step (or such a copy) still fills, in the order they were run
        self.forwards: list[_Forward] = []

    def _tensors(self):
        return [tensor for pair in self.layers for tensor in pair]

    def copy(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Run copy-on-write pairs ``(src, dst, tokens)`` (whole blocks); one whose ``src`` an uncompleted step
        writes (or a copy from one fills) is run again, ``tokens`` offsets, as that step completes (in order)."""
        for src, dst, tokens in copies:
            for tensor in self._tensors():
                tensor[dst] = tensor[src]
            steps = {(r, end) for r, steps in self.writes.items() for end, blocks, _ in steps if src in blocks}
            filled_by = [f for f in self.forwards if f.dst == src and f.delivers]  # a copy of a copy
            steps |= {step for f in filled_by for step in f.waits}
            if steps:
                read = [t[src, :tokens].clone() for t in self._tensors()]
                self.forwards.append(_Forward(src, dst, tokens, steps, read, filled_by[-1] if filled_by else None))

    def record(self, request_id: int, end: int, slots: Sequence[Sequence[int]], checkpoints=()) -> None:
        """A reservation (or load) of tokens up to ``end`` writes ``slots`` (per group; each Mamba group's state
        at its last slot, and at each exported checkpoint of ``checkpoints``: ``(group, block, offset)``)."""
        blocks, states = set(), list(checkpoints)
        for g, group in enumerate(self.groups):
            bs = group.block_size
            blocks |= {slot // bs for slot in slots[g] if slot >= 0}
            if group.kind == "mamba" and slots[g] and slots[g][-1] >= 0:
                states.append((g, *divmod(slots[g][-1], bs)))
        self.writes.setdefault(request_id, []).append((end, blocks, states))

    def settle(self, request_id: int, num_tokens: int) -> None:
        """The request's steps below ``num_tokens`` are written: each state they wrote is its block's one state,
        and copies from the blocks they wrote run again."""
        steps = self.writes.pop(request_id, [])
        if later := [w for w in steps if w[0] > num_tokens]:
            self.writes[request_id] = later
        done = [w for w in steps if w[0] <= num_tokens]
        for _, _, states in done:
            for g, block, offset in states:
                bs = self.groups[g].block_size
                for layer in range(self.groups[g].num_layers):
                    for tensor in self.layers[layer]:
                        state = tensor[block, offset].clone()
                        tensor[block, :bs] = float("nan")
                        tensor[block, offset] = state
        completed = {(request_id, end) for end, _, _ in done}
        written = {block for _, blocks, _ in done for block in blocks}
        for forward in self.forwards:  # in the order the copies ran, as the worker runs them after the steps
            if not forward.waits & completed:
                continue
            if forward.src in written:  # the step wrote the source: read it now
                forward.content = [t[forward.src, :forward.tokens].clone() for t in self._tensors()]
            elif forward.after is not None:  # the source is a copy's destination: take what that copy delivers
                n = min(forward.tokens, forward.after.tokens)
                for mine, theirs in zip(forward.content, forward.after.content):
                    mine[:n] = theirs[:n]
            if forward.delivers:
                for tensor, content in zip(self._tensors(), forward.content):
                    tensor[forward.dst, :forward.tokens] = content
            forward.waits -= completed
        self.forwards = [f for f in self.forwards if f.waits]

    def zero(self, blocks: set[int]) -> None:
        """The worker zeroes ``blocks`` in every KV cache tensor (``GPUModelRunner._zero_block_ids``, for vLLM's
        ``new_block_ids_to_zero``: Mamba layers or mixed precision)."""
        for block in blocks:
            for tensor in self._tensors():
                tensor[block] = 0.0

    def handed_out(self, blocks: set[int]) -> None:
        """``blocks`` are handed out afresh: a copy into one of them is not run into it again (it ran before the step
        that wrote them last, in the worker's order; its block now holds another's K/V), but a later copy from that
        block still takes what it delivered."""
        for forward in self.forwards:
            if forward.dst in blocks:
                forward.delivers = False

    def forget(self, request_id: int) -> None:
        """The request's uncompleted steps are dropped unwritten."""
        for end, _, _ in self.writes.pop(request_id, []):
            for forward in self.forwards:
                forward.waits.discard((request_id, end))
        self.forwards = [f for f in self.forwards if f.waits]


class VllmHybridCacheManager(VllmCacheManager):
    """``KVCacheManager`` with the KV-cache groups of ``config.groups`` in one pool of ``config.num_blocks``
    blocks (plus vLLM's null block 0), a fake connector where ``config.connector`` and EAGLE-style drafts
    with ``num_lookahead_tokens`` where ``config.num_speculative_tokens`` (module docstring)."""

    def __init__(self, config: ManagerConfig) -> None:
        v = self.v = _import_vllm()
        self.groups = tuple(config.groups)
        # Speculative decoding is left off where it cannot be judged: vLLM refuses EAGLE with chunked local
        # attention ("Hybrid KV cache is not supported for eagle + chunked local attention"), and a Mamba
        # group keeps its draft states in num_speculative_blocks scratch blocks addressed from the last
        # state block (relocated after verification), not at the drafts' positions the protocol's state
        # slots name
        speculative = config.num_speculative_tokens > 0 and all(g.kind not in ("chunked_local", "mamba")
                                                                for g in self.groups)
        # EAGLE runs beside a Mamba group all the same (Qwen3-Next, Nemotron-H serve with EAGLE / MTP drafters):
        # the coordinator's lookup drops a hit's last block and the Mamba checkpoints move to that replay boundary
        # (``drop_eagle_checkpoint_block``, ``get_mamba_prefill_checkpoint_position``); the machine then draws no
        # drafts (``speculative`` off), so each step is one the drafter proposed nothing in or had all rejected; the
        # Mamba group holds the drafter's scratch blocks all the same (``_vllm_spec``), relocated as a prefill goes on
        self.eagle = config.num_speculative_tokens > 0 and all(g.kind != "chunked_local" for g in self.groups)
        kv_config = v.KVCacheConfig(num_blocks=config.num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=[
            v.KVCacheGroupSpec([f"layer{i}"], _vllm_spec(v, g, config.num_speculative_tokens if self.eagle else 0))
            for i, g in enumerate(self.groups)],
            prefix_cache_retention_interval=config.retention_interval)  # engine: --prefix-cache-retention-interval
        sizes = [g.block_size for g in self.groups]
        # vLLM's resolve_kv_cache_block_sizes (kv_cache_utils.py): the scheduler block the groups' lcm, the hash
        # block --prefix-match-unit (CacheConfig.prefix_match_unit) where given, else the groups' gcd
        self.hash_block_size, self.scheduler_block_size = config.prefix_match_unit or math.gcd(*sizes), math.lcm(*sizes)
        if any(size % self.hash_block_size for size in sizes):
            raise ValueError(f"prefix_match_unit {config.prefix_match_unit}: every group's block size {sizes} must be "
                             f"a multiple of it (vLLM's resolve_kv_cache_block_sizes)")
        # the prefill tokens past a step the drafter reads (VllmConfig.num_prefill_lookahead_tokens): every MTP module
        # of a multi-module drafter one further (num_speculative_tokens), an EAGLE-family drafter the next one; the
        # coordinator leaves that many less one uncached (num_reprefillable_tokens)
        self.num_prefill_lookahead = ((config.num_speculative_tokens if config.multi_module_mtp else 1)
                                      if self.eagle else 0)
        vllm_manager.init_block_hashes(v)
        self.block_hasher = v.get_request_block_hasher(self.hash_block_size, v.sha256)
        self.manager = v.KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN,
                                        scheduler_block_size=self.scheduler_block_size,
                                        hash_block_size=self.hash_block_size, enable_caching=True,
                                        use_eagle=self.eagle, enable_kv_cache_events=True,
                                        num_prefill_lookahead=self.num_prefill_lookahead)
        self.pool = self.manager.block_pool
        self.block_size, self.num_blocks, self.reserved_blocks = self.hash_block_size, config.num_blocks + 1, 1
        # fine-grained partial hash hits (HybridKVCacheCoordinator.enable_partial_hash_hits: a Mamba "align" group
        # wider than the hash block): a hit lands on a hash block inside a block, whose copy-on-write vLLM's worker
        # runs (copy_kv_cache_blocks_inplace): the pools are the peer's, so that it runs those copies in them
        self.fine_grained = self.manager.coordinator.enable_partial_hash_hits
        self.pools = _StatePools(self.groups, self.num_blocks, config) if self.fine_grained else None
        if self.pools is not None:  # blocks handed out again end what a copy into them still owed
            get_new_blocks = self.pool.get_new_blocks

            def handed_out(num_blocks):
                blocks = get_new_blocks(num_blocks)
                self.pools.handed_out({b.block_id for b in blocks})
                return blocks

            self.pool.get_new_blocks = handed_out
        self.num_lookahead = config.num_speculative_tokens if speculative else 0
        self.connector = (_connector_class()(kv_config, self.scheduler_block_size, config.token_loads)
                          if config.connector else None)
        self.slot_mapping = _SlotMapping(self.groups, MAX_MODEL_LEN)
        self.split = (_MambaSplit(self.manager, self.scheduler_block_size, self.hash_block_size)
                      if any(g.kind == "mamba" for g in self.groups) else None)
        self.requests, self.pending, self.settled, self.deferred = {}, {}, {}, {}
        self.admitted: dict[int, tuple] = {}  # request -> admit's arguments (a failed load looks up again)
        self.external: dict[int, int] = {}  # request -> external tokens the connector promised
        self.loading: dict[int, int] = {}  # request -> its local hit, while its load is in flight
        # request -> blocks its load writes that vLLM also asked the worker to zero (new_block_ids_to_zero)
        self.zeroed_under_load: dict[int, set[int]] = {}
        self.waits: dict[int, set] = {}  # freed request -> what its free waits for ("store", "load", "steps")
        self.drafts: dict[int, list[int]] = {}  # request -> the draft tokens of its last reservation
        # The hit promise (committed blocks hit) holds except where vLLM hits less on purpose: a one-token
        # window (sliding_window 1) caches no block, and vLLM's window finder then hits nothing (it wants one
        # cached block even where a hit needs none), as in one group; with EAGLE every hit drops its last
        # block (the draft model's K/V there is written with the next token): declared as eagle_drop, the
        # machine's model of the coordinator's lookup (pagedkv.testing.managers.lookup) then re-aligns a popped
        # hit to the groups' common multiple and redoes each group's drop where another shrinks the candidate
        eagle_drop = self.eagle
        caches = all(g.kind != "sliding_window" or g.window >= 1 for g in self.groups)
        # vLLM's LRU order (FreeKVCacheBlockQueue: uncached blocks first, cached ones in release order, each
        # group's blocks tail first) is judged where the machine knows what is cached: not where a Mamba
        # group caches states at boundaries of its own choosing, nor where EAGLE caches one block less
        lru = caches and not speculative and all(g.kind != "mamba" for g in self.groups)
        # the admission promise where every group needs the blocks its tokens reach: not beside a Mamba group
        # (its "align" mode holds checkpoint and draft scratch blocks, and the scheduler may clip a chunk to
        # nothing); a waiting request's allocation checks its whole prompt where the scheduler reserves it
        self.full_sequence_must_fit = config.full_sequence_must_fit
        admission = None if self.split is not None else "sequence" if config.full_sequence_must_fit else "chunk"
        self.capabilities = ManagerCapabilities(block_size=self.hash_block_size, extra_keys=True, evict=True,
                                                reset=True, async_steps=True, hit_promise=caches, groups=self.groups,
                                                connector=config.connector, speculative=speculative,
                                                lookahead=self.num_lookahead, eviction_order="lru" if lru else None,
                                                admission=admission, window_release=True,
                                                retention_interval=config.retention_interval,
                                                eagle_drop=eagle_drop, coordinated_lookup=True,
                                                chunk_checkpoints=any(g.prefill_checkpoints for g in self.groups),
                                                # fine-grained: partial entries' events (cache_partial_block: a run
                                                # of any length chained from a hash-block key never announced) are
                                                # not what the event index models
                                                prompt_embeds=True, kv_events=not self.fine_grained,
                                                reprefill=max(0, self.num_prefill_lookahead - 1),
                                                # one group: vLLM's unitary coordinator looks no block past the cap
                                                eagle_margin=len(self.groups) > 1, owns_pools=self.fine_grained,
                                                hit_alignment=self.hash_block_size if self.fine_grained else None,
                                                cached_prompt=True, resume=True,
                                                # the machine's pools: it zeroes what vLLM names (the peer's own
                                                # pools zero under a load only, where the race is)
                                                zeroes_new_blocks=kv_config.needs_kv_cache_zeroing
                                                and not self.fine_grained,
                                                # the scheduler takes a connector's count as it is (NIXL's
                                                # remote prefill: the prompt less its backoff)
                                                token_loads=config.connector and config.token_loads)

    # -- admission and the connector --------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = (), *, num_stored: int = 0):
        """The local hit and the connector's external tokens as the scheduler's waiting-request step finds
        them (``Scheduler.schedule``): ``_get_local_prefix_cache_hit`` (the connector's path,
        ``get_computed_blocks_for_connector``, where it ``supports_divergent_local_hybrid_hits``), then
        ``get_num_new_matched_tokens`` on the block-aligned local hit, and back to ``get_computed_blocks``
        where the local hit ran deeper than a lagging group and no external tokens back it."""
        request = self._request(request_id, token_ids, namespace, extra_keys)
        diverged = False
        if self.connector is not None and self.connector.supports_divergent_local_hybrid_hits:
            blocks, num_local, boundary, diverged = self.manager.get_computed_blocks_for_connector(request)
        else:
            blocks, num_local, boundary = self.manager.get_computed_blocks(request)
        num_external = 0
        if self.connector is not None:
            self.connector.stored[request.request_id] = num_stored
            partial_tail = num_local % self.scheduler_block_size
            aligned = num_local - partial_tail
            num_external, _ = self.connector.get_num_new_matched_tokens(request, aligned)
            if partial_tail and num_external > partial_tail:  # the load covers the local hit's partial block
                blocks, num_local = self.manager.truncate_computed_blocks(blocks, aligned), aligned
            elif partial_tail:
                num_external = 0
            if diverged and num_external == 0:  # no external state backs the deeper hit: the agreed one
                blocks, num_local, boundary = self.manager.get_computed_blocks(request)
        request.num_computed_tokens = 0
        request.shared_prefix_boundary = boundary
        self.requests[request_id] = request
        self.admitted[request_id] = (list(token_ids), namespace, list(extra_keys))
        self.pending[request_id] = (blocks, num_local)
        self.settled[request_id] = num_local
        self.external[request_id] = num_external
        return self.block_table(request_id), num_local

    def resume(self, request_id: int):
        """Preempt as vLLM's scheduler does (``Scheduler._preempt_request``: every group's blocks freed,
        ``num_computed_tokens`` 0, no draft tokens) and look the same ``Request`` up again as a waiting one: every
        token so far, its prompt still the one it was admitted with, so the scheduler's and the manager's
        ``prefill_end`` (``max(num_prompt_tokens, num_tokens - 1)``) reaches past the prompt, and a Mamba2 group
        exports the checkpoint of that resumed prefill, not the prompt's. Nothing is stored for it: the connector
        promises no external tokens, so the lookup is the local one every group agrees on."""
        request = self.requests[request_id]
        self.manager.free(request)
        if self.pools is not None:
            self.pools.forget(request_id)
        request.status = self.v.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        blocks, num_local, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        self.pending[request_id] = (blocks, num_local)
        self.settled[request_id] = num_local
        self.external[request_id] = 0
        return self.block_table(request_id), num_local

    def num_external(self, request_id: int) -> int:
        return self.external.get(request_id, 0)

    def load(self, request_id: int):
        """``allocate_slots`` for the local hit and the external tokens with ``delay_cache_blocks`` (an
        asynchronous load): each group's slots for the external tokens (vLLM's slot mapping; ``-1`` where the
        group holds no block: outside its window or chunk, a Mamba group's skipped states)."""
        request = self.requests[request_id]
        blocks, num_local = self.pending[request_id]
        num_external = self.external[request_id]
        if self.pools is not None:  # earlier steps' blocks the worker zeroed before their writes
            self.manager.take_new_block_ids()
        # the groups the load restores are not zeroed (Scheduler.schedule passes the connector's
        # get_loaded_kv_cache_group_ids): the worker's zeroing would race the load's writes
        got = self.manager.allocate_slots(request, 0, num_new_computed_tokens=num_local, new_computed_blocks=blocks,
                                          num_external_computed_tokens=num_external, delay_cache_blocks=True,
                                          full_sequence_must_fit=self.full_sequence_must_fit,
                                          skip_zeroing_group_ids=self.connector.get_loaded_kv_cache_group_ids(request))
        if got is None:
            return None
        self._copy_on_write()
        del self.pending[request_id]
        request.num_computed_tokens = self.settled[request_id] = num_local + num_external  # no step: a load
        self.connector.update_state_after_alloc(request, self.manager.get_blocks(request.request_id), num_external)
        self.loading[request_id] = num_local
        slots = self._slots(request_id, num_local, num_local + num_external)
        if self.pools is not None:  # a block the load writes and the worker zeroes: the zero may land after the data
            loaded = {slot // g.block_size for g, group_slots in zip(self.groups, slots) for slot in group_slots
                      if slot >= 0}
            self.zeroed_under_load[request_id] = loaded & set(self.manager.take_new_block_ids())  # attention only
        return self._written(request_id, num_local + num_external, slots)

    def take_zeroed(self) -> list[int]:
        """The blocks vLLM asks the worker to zero (``take_new_block_ids``: attention groups' new blocks beside
        Mamba layers or under mixed precision), named since the last call."""
        return self.manager.take_new_block_ids()

    def load_done(self, request_id: int, ok: bool) -> int | None:
        num_local = self.loading.pop(request_id)
        if self.pools is not None:  # the load's state is written (or its garbage)
            self.pools.settle(request_id, MAX_MODEL_LEN)
            self.pools.zero(self.zeroed_under_load.pop(request_id, set()))
        self.connector.load_plans.pop(str(request_id), None)
        waits = self.waits.get(request_id)
        if waits is not None:  # freed while loading: finished_recving frees its blocks now
            waits.discard("load")
            self._release(request_id)
            return None
        request = self.requests[request_id]
        self.external[request_id] = 0
        if ok:
            self.manager.cache_blocks(request, request.num_computed_tokens)
            self.settled[request_id] = request.num_computed_tokens
            return None
        # recompute_kv_load_failures: the request's blocks are freed, its prefix looked up again
        request.num_computed_tokens = 0
        self.manager.free(request)
        blocks, num_hit, _ = self.manager.get_computed_blocks(request)
        if num_hit > num_local:
            # the protocol keeps the hit to the local one: the coordinator's own lookup capped there, not the longer
            # hit cut (``truncate_computed_blocks`` keeps a Mamba group short of the cut only where a load supplies
            # its state there; cut, a Mamba hit past the local one left no state block at it)
            hit_blocks, num_hit, _ = self.manager.coordinator.find_longest_cache_hit(request.block_hashes, num_local)
            blocks = self.manager.create_kv_cache_blocks(hit_blocks)
        # the scheduler frees, looks up and allocates in one waiting-queue pass (_handle_blocked_waiting_request
        # then allocate_slots): the hit is taken now, never left as a lookup that a reset, an eviction or
        # another request's allocation makes stale before the request's next step; refused, nothing is hit
        if num_hit and self.manager.allocate_slots(request, 0, num_new_computed_tokens=num_hit,
                                                   new_computed_blocks=blocks,
                                                   full_sequence_must_fit=self.full_sequence_must_fit) is not None:
            request.num_computed_tokens = num_hit
            self._copy_on_write()
        else:
            num_hit = 0
            self.pending[request_id] = (self.manager.empty_kv_cache_blocks, 0)
        self.settled[request_id] = num_hit
        return num_hit

    def store_done(self, request_id: int) -> None:
        waits = self.waits.get(request_id)
        if waits is not None:
            waits.discard("store")
            self.connector.storing.pop(str(request_id), None)
            self._release(request_id)

    # -- steps and speculative decoding ---------------------------------------------------------------
    def reserve(self, request_id: int, token_ids: Sequence[int], num_draft: int = 0):
        if request_id in self.loading:
            return None
        request = self.requests[request_id]
        blocks, num_local = self.pending.get(request_id, (None, 0))
        start = request.num_computed_tokens + num_local
        if self.split is not None and not num_draft:  # the scheduler clips a prefill chunk (Mamba "align")
            token_ids = token_ids[:self.split(request, len(token_ids), num_local)]
            if not token_ids:
                return None
        verified = list(token_ids[:len(token_ids) - num_draft])
        extra = start + len(verified) - request.num_tokens
        if extra > 0:
            request.append_output_token_ids(verified[len(verified) - extra:])
        request.spec_token_ids = list(token_ids[len(verified):])
        request.num_in_flight_tokens = max(0, start - self.settled[request_id])
        got = self.manager.allocate_slots(request, len(token_ids), num_new_computed_tokens=num_local,
                                          new_computed_blocks=blocks, num_lookahead_tokens=self.num_lookahead,
                                          full_sequence_must_fit=self.full_sequence_must_fit and blocks is not None)
        if got is None:
            if extra > 0:
                self._take_back_tokens(request, extra)  # self.block_size is the hash block size here
            request.spec_token_ids = []
            return None
        self._copy_on_write()
        self.pending.pop(request_id, None)
        request.num_computed_tokens = start + len(token_ids)
        self.drafts[request_id] = list(request.spec_token_ids)
        return self._written(request_id, start + len(token_ids), self._slots(request_id, start, start + len(token_ids)))

    def drop(self, request_id: int, num_rejected: int) -> None:
        request = self.requests[request_id]
        drafts = self.drafts.get(request_id, [])
        if not 0 <= num_rejected <= len(drafts):
            raise ValueError(f"num_rejected {num_rejected}: the last reservation had {len(drafts)} draft tokens")
        del self.drafts[request_id]
        request.spec_token_ids = []
        request.num_computed_tokens -= num_rejected
        accepted = drafts[:len(drafts) - num_rejected]
        if accepted:
            request.append_output_token_ids(accepted)
        self.settled[request_id] = min(self.settled[request_id], request.num_computed_tokens)

    def commit(self, request_id: int, num_tokens: int) -> None:
        """A step completed: the scheduler's next step starts (``new_step_starts``: a Mamba state cached by
        another request in the step before may be hit now) and in-flight tokens settle."""
        self.manager.new_step_starts()
        if self.pools is not None:
            self.pools.settle(request_id, num_tokens)
        self.settled[request_id] = num_tokens
        request = self.requests.get(request_id)
        if request is not None:
            request.num_in_flight_tokens = max(0, request.num_computed_tokens - num_tokens)
        elif request_id in self.waits and num_tokens >= self.deferred[request_id][1]:
            self.waits[request_id].discard("steps")
            self._release(request_id)

    # -- release -------------------------------------------------------------------------------------
    def free(self, request_id: int) -> None:
        request = self.requests.pop(request_id)
        self.pending.pop(request_id, None)
        self.drafts.pop(request_id, None)
        self.admitted.pop(request_id, None)
        self.external.pop(request_id, None)
        # the tokens of steps not yet completed: a window frees on the processed-token basis
        request.num_in_flight_tokens = max(0, request.num_computed_tokens - self.settled[request_id])
        waits = set()
        if request.num_computed_tokens > self.settled[request_id]:
            waits.add("steps")
        if request_id in self.loading:
            waits.add("load")
        if self.connector is not None:
            # vLLM's scheduler releases the window's skipped blocks first (``_connector_finished`` calls
            # ``remove_skipped_blocks``); the protocol holds every block of a stored request until
            # ``store_done``, so that release is left out here and the store is handed them all
            ids = self.manager.get_block_ids_for_computed_tokens(request.request_id, request.num_computed_tokens)
            delay, _ = self.connector.request_finished_all_groups(request, ids)
            if delay:
                waits.add("store")
        if waits:
            self.waits[request_id] = waits
            self.deferred[request_id] = (self.manager.pop_blocks_for_free(request), request.num_computed_tokens)
        else:
            self.settled.pop(request_id, None)
            self.manager.free(request)
            if self.pools is not None:  # an unwritten reservation writes nothing
                self.pools.forget(request_id)

    def _release(self, request_id: int) -> None:
        """Free a deferred request's blocks (tail first) once nothing it waits for is pending."""
        if not self.waits[request_id]:
            del self.waits[request_id]
            blocks, _ = self.deferred.pop(request_id)
            self.settled.pop(request_id, None)
            _drain_deferred_free(self.manager, blocks)
            if self.pools is not None:
                self.pools.forget(request_id)

    def holds(self, request_id: int) -> bool:
        managers = self.manager.coordinator.single_type_managers
        return request_id in self.waits or any(str(request_id) in m.req_to_blocks for m in managers)

    # -- fine-grained partial hits: the pools the machine writes ------------------------------------------
    def kv_pools(self, layer: int):
        """Layer slot ``layer``'s ``(K, V)`` pools (``owns_pools``: fine-grained layouts only), each
        ``[num_blocks, max block_size, num_kv_heads, head_dim]`` float32.

        Raises:
            ValueError: the layout has no fine-grained hits (the machine holds the pools) or no such layer slot."""
        if self.pools is None or not 0 <= layer < len(self.pools.layers):
            raise ValueError(f"layer {layer}: the peer holds pools only for fine-grained layouts, layer slots "
                             f"0..{len(self.pools.layers) - 1 if self.pools else -1}")
        return self.pools.layers[layer]

    def _copy_on_write(self) -> None:
        """The step's copy-on-write of partly hit blocks, run as vLLM's worker runs it before the forward
        (``KVCacheManager.take_kv_cache_block_copies``, then the scheduler's ``_free_cow_retained_blocks``: the
        copy has run here at once, so the retained endpoints are released at once)."""
        if self.pools is None:
            return
        copies, retained = self.manager.take_kv_cache_block_copies()
        if copies:
            self.pools.copy([(c.src_block_id, c.dst_block_id, self._copied_tokens(c.dst_block_id)) for c in copies])
            self.pool.free_blocks(retained)

    def in_flight_pages(self) -> set[int]:
        """Pages (``block * page + offset`` of :meth:`kv_pools`) a copy-on-write filled from a block an in-flight
        step still writes: their content comes with that step (the worker copies after it), as the source's does."""
        if self.pools is None:
            return set()
        page = self.pools.layers[0][0].shape[1]
        return {f.dst * page + o for f in self.pools.forwards if f.delivers for o in range(f.tokens)}

    def _copied_tokens(self, dst: int) -> int:
        """The offsets of a copy's destination the partial hit covers: a request's private copy of its hit's last
        block (``_apply_cow``) up to the hit, a moved cache entry (a producer's Mamba tail) up to its boundary."""
        for request_id, request in self.requests.items():
            hit = self.pending.get(request_id, (None, request.num_computed_tokens))[1]
            for group, table in zip(self.groups, self.manager.get_block_ids(str(request_id))):
                if dst in table:
                    return min(group.block_size, hit - table.index(dst) * group.block_size)
        block = self.pool.blocks[dst]
        size = max(g.block_size for g in self.groups)
        return (block.block_hash_num_tokens - 1) % size + 1 if block.block_hash_num_tokens else size

    def _written(self, request_id: int, end: int, slots):
        """``slots`` returned, the Mamba states they write recorded (:class:`_StatePools`): each group's at its last
        slot and, exporting prefill checkpoints, at its checkpoint's, the one other slot :meth:`_slots` names there."""
        if self.pools is not None:
            checkpoints = [(g, *divmod(slot, group.block_size)) for g, group in enumerate(self.groups)
                           if group.prefill_checkpoints for slot in slots[g][:-1] if slot >= 0]
            self.pools.record(request_id, end, slots, checkpoints)
        return slots

    def _checkpoint(self, request_id: int, g: int, start: int, end: int) -> tuple[int, int] | None:
        """Where among positions ``start..end`` group ``g``'s worker exports the state the request's last allocation
        reserved a block for (``MambaManager._checkpoints``: the state after token ``position - 1``): ``(its index
        from start, the table index of the reserved block)``; ``None`` for none there."""
        if not self.groups[g].prefill_checkpoints:
            return None
        manager = self.manager.coordinator.single_type_managers[g]
        checkpoint = getattr(manager, "_checkpoints", {}).get(str(request_id))
        if checkpoint is None or not start <= checkpoint[0] - 1 < end:
            return None
        return checkpoint[0] - 1 - start, checkpoint[1]

    # -- what the machine reads -------------------------------------------------------------------------
    def _raw_tables(self, request_id: int) -> tuple[list[int], ...]:
        if request_id in self.pending:
            blocks = self.pending[request_id][0]
            return tuple(blocks.get_block_ids()) if any(blocks.blocks) else tuple([] for _ in self.groups)
        return self.manager.get_block_ids(str(request_id))

    def block_table(self, request_id: int) -> tuple[list[int], ...]:
        """Each group's block ids in order, ``-1`` where the group released (or never needed) a block."""
        return tuple(self._ids(t) for t in self._raw_tables(request_id))

    def _slots(self, request_id: int, start: int, end: int) -> tuple[list[int], ...]:
        """Each group's slots of positions ``start..end``: vLLM's slot mapping (attention groups) or the
        table's (Mamba groups); ``-1`` at a position whose block the group does not hold."""
        tables = self._raw_tables(request_id)
        null = self.pool.null_block.block_id
        mapped = self.slot_mapping.slots(tables, start, end)
        out = []
        for group, table, slots in zip(self.groups, tables, mapped):
            bs = group.block_size
            if slots is None:
                slots = [table[p // bs] * bs + p % bs if p // bs < len(table) else -1 for p in range(start, end)]
            slots = [-1 if p // bs >= len(table) or table[p // bs] == null else s for p, s in zip(range(start, end),
                                                                                                 slots)]
            if group.prefill_checkpoints:  # a state only where the step writes one: its end and its checkpoint,
                # the latter in the block vLLM reserved for it (MambaManager._checkpoints: its table index), which
                # need not be the block its position falls in (that one may be null: under EAGLE the checkpoint
                # sits a block below the reserved one)
                exported = self._checkpoint(request_id, len(out), start, end)
                slots = [s if i == end - start - 1 else -1 for i, s in enumerate(slots)]
                if exported is not None:
                    at, index = exported
                    slots[at] = table[index] * bs + (start + at) % bs
            out.append(slots)
        return tuple(out)

    def self_check(self) -> None:
        """Reference counts equal the live tables (and deferred frees) holding each block, the free queue is
        exactly the unreferenced blocks and its length its counter, no block is in two groups' tables."""
        refs: dict[int, int] = {}
        owners: dict[int, set] = {}
        for request_id in self.requests:
            if request_id in self.pending:
                continue
            for g, table in enumerate(self.block_table(request_id)):
                for b in set(table) - {-1}:
                    refs[b] = refs.get(b, 0) + 1
                    owners.setdefault(b, set()).add(g)
        for blocks, _ in self.deferred.values():
            for b in {b.block_id for b in blocks if not b.is_null}:
                refs[b] = refs.get(b, 0) + 1
        shared = {b: sorted(g) for b, g in owners.items() if len(g) > 1}
        assert not shared, f"blocks held by more than one KV-cache group (block: groups): {shared}"
        free_ids = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == self.pool.get_num_free_blocks(), \
            f"the free queue holds {len(free_ids)} blocks, its counter says {self.pool.get_num_free_blocks()}"
        self._check_pool(refs, set(free_ids))


def cache_manager(config: ManagerConfig):
    """The manager factory (``--pagedkv-impl pagedkv.tools.peers:vllm_cache_manager``): the hybrid
    coordinator over ``config.groups`` (:class:`VllmHybridCacheManager`; HiSparse's host tier where a group is
    ``host_resident``: :class:`~pagedkv.tools.peers.vllm_hisparse_manager.VllmHiSparseCacheManager`), or one group
    (:class:`~pagedkv.tools.peers.vllm_manager.VllmCacheManager`) where it has none.

    Raises:
        BackendUnavailableError: vLLM is not installed (the message gives the install command).
        ValueError: a group kind vLLM has no manager for here.
    """
    if any(g.host_resident for g in config.groups):  # the host tier: layout hisparse
        from pagedkv.tools.peers.vllm_hisparse_manager import VllmHiSparseCacheManager

        return VllmHiSparseCacheManager(config)
    return VllmHybridCacheManager(config) if config.groups else VllmCacheManager(config)


#: The windows the suite draws for this manager: full attention and sliding windows of 1, 2 and 5 tokens.
cache_manager_windows = vllm_manager.cache_manager_windows

#: The layouts the suite draws for this manager: one group, and the hybrid coordinator in every real-model layout.
cache_manager_layouts = ("one-group", "gemma3", "llama4", "jamba", "qwen3-next", "gpt-oss-2full-sw",
                         "mixed-block-sizes", "hymba", "deepseek-v4", "two-window-block-sizes", "gemma3-sparse",
                         "gemma3-interval", "qwen3-next-sparse", "mtp-multi-module", "qwen3-next-fine",
                         "deepseek-v4-interval", "hisparse", "nemotron-h-fine", "nemotron-h",
                         "nemotron-h-interval", "nemotron-h-sparse")


def peer():
    """This module as a suite candidate (``pagedkv.tools.peers:vllm_cache_manager``): its ``cache_manager`` is what
    the suite judges, in every layout above; it has no kernels.

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_vllm()
    return sys.modules[__name__]
