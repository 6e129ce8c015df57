"""SGLang's sliding-window radix caches (sglang 0.5.23, pure Python) through the cache-manager protocol: the
hybrid one (``UnifiedRadixCache`` with its FULL and SWA components over ``SWATokenToKVPoolAllocator``,
:class:`SglangHybridSwaRadixCache`, spec ``pagedkv.tools.peers:sglang_swa_radix_cache``, two groups) and the
all-SWA one (``PureSWARadixCache`` over ``PureSWATokenToKVPoolAllocator``, one group).

All-SWA specs: ``pagedkv.tools.peers:sglang_pure_swa_radix_cache`` (an all-SWA model as SGLang serves every one but one:
the whole prompt's window is evicted during decode) and ``:sglang_pure_swa_radix_cache_prefill_aware`` (a model
declaring ``is_prefill_aware_swa``: the prompt ``[0, extend_end)`` is never window-evicted). Both are
SGLang's choice for a model whose every layer is sliding-window attention (``registry.py``: ``is_hybrid_swa
and full_tokens_per_layer == 0``); page size 1 (the allocator refuses others), so a block is a token slot.
``window_left`` is SGLang's ``sliding_window_size``.

Each protocol call is what SGLang's scheduler does (``managers/schedule_batch.py``, ``mem_cache/common.py``,
``mem_cache/allocation.py``), on SGLang's own tree, allocator and helpers:

- ``admit``: ``match_prefix`` on the prompt's first ``len - 1`` tokens, ``lock``, the request's
  ``req_to_token`` row starts with ``path_device_indices`` (as :mod:`.sglang_manager`).
- ``reserve``: a decode token first runs ``maybe_evict_swa`` (``ScheduleBatch._swa_eviction_trigger`` with
  ``SGLANG_SWA_EVICTION_INTERVAL=1``, from the request's second decode batch on): SGLang's
  ``evict_sliding_windows`` frees the row's slots behind the window (``free_swa_out_of_window_slots``);
  then ``alloc`` (``evict`` of unlocked leaves when short, once more). A prefill chunk on a prefill-aware
  model sets ``swa_evict_floor = extend_end`` (``Scheduler``'s ``prefill_aware_swa``).
- ``commit``: a prefill chunk's end is ``checkpoint`` (``cache_unfinished_req`` of chunked prefill); decode
  tokens only advance ``kv_committed_len``.
- ``free``: ``release_kv_cache(checkpoint=True)`` (``cache_finished_req``): ``checkpoint`` up to the
  committed length, ``free_kv_row`` of the row past ``cache_protected_len`` (window-evicted positions go
  back full-side only, a no-op on one pool), ``unlock``, the unwritten over-allocation freed.
- ``block_table``: the row's slots, ``-1`` at positions the window freed; ``counts``: free slots plus
  evictable tree slots, of ``size``; ``evict`` / ``reset``: ``evict`` / ``reset`` + ``clear``.
- ``self_check``: each slot is free, in the tree, or in one row's own live part (never two of them); lock
  references; evictable leaves; evictable + protected equals the tree's size.

Scheduler state SGLang keeps on its ``Req`` (``ReqKvInfo``: ``req_pool_idx``, ``cache_protected_len``,
the SWA eviction cursor and floor) is SGLang's own class, taken from its source (:func:`_req_kv_info_class`);
the ``req_to_token`` pool is a tensor (:class:`_ReqToTokenPool`), the K/V pool a shell with no tensors
(:class:`_SwaKVPool`: the machine holds the K/V). Loading as :mod:`.sglang_manager` (whose placeholder
``memory_pool`` names ``KVCache``, the base class of SGLang's ``BaseSWAKVPool``).

The hybrid cache is driven with the same calls (:class:`SglangHybridSwaRadixCache` says how its two pools
map to block ids); it loads as described at :func:`_import_unified`. Not here: SGLang 0.5.23's Mamba radix
cache (``UnifiedRadixCache``'s MAMBA component) needs its real ``HybridReqToTokenPool`` and ``MambaPool``
and a model worker writing states (docs/peers.md).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from array import array
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities, ManagerConfig
from pagedkv.tools.peers.sglang_manager import RECIPE, _import_sglang, _pad, check_radix_tree, radix_identity

name = "sglang_pure_swa_radix_cache"
#: Longest request row (prompt and decode tokens) the machine draws, with room to spare.
MAX_ROW = 256


@functools.cache
def _import_swa():
    """SGLang's pure-SWA tree, allocator and the scheduler helpers that drive them."""
    s = _import_sglang()
    try:
        from sglang.srt.mem_cache import common
        from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
        from sglang.srt.mem_cache.pure_swa_radix_cache import PureSWARadixCache
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
    except ImportError as exc:
        raise BackendUnavailableError(f"sglang lacks its PureSWARadixCache ({type(exc).__name__}: {exc}); "
                                      f"install: {RECIPE}") from exc

    class _SwaKVPool(BaseSWAKVPool):
        """A K/V pool without tensors: what the allocator asks of one (the machine holds the K/V)."""

        swa_kv_pool = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return kv_indices

        def get_state_buf_infos(self):
            return [], [], []

    return types.SimpleNamespace(**vars(s), common=common, PureSWATokenToKVPoolAllocator=PureSWATokenToKVPoolAllocator,
                                 PureSWARadixCache=PureSWARadixCache, SWA=ComponentType.SWA, SwaKVPool=_SwaKVPool,
                                 ReqKvInfo=_req_kv_info_class(sys.modules["sglang.srt"].__path__[0]))


class _ReqToTokenPool:
    """SGLang's ``ReqToTokenPool``: one int32 row of slots per live request."""

    def __init__(self, torch, rows: int) -> None:
        self.req_to_token = torch.zeros((rows, MAX_ROW), dtype=torch.int32)
        self.free_rows = list(range(rows))

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values

    def free(self, req) -> None:
        self.free_rows.append(req.kv.req_pool_idx)


@dataclasses.dataclass
class _Req:
    """The fields of SGLang's ``Req`` the tree's ``checkpoint`` reads."""

    kv: object  # SGLang's ReqKvInfo
    origin_input_ids: array
    full_untruncated_fill_ids: array  # prompt and decode tokens (pads at multimodal positions)
    pads: dict
    extra_key: str | None
    cache_salt: str | None
    lock: object = None
    last_node: object = None
    priority: int | None = None
    decode_batch_idx: int = -1  # decode batches run so far, minus one (SGLang's index of the current one)
    released: set = dataclasses.field(default_factory=set)  # row positions the window freed


def extend_row(pool, r, start: int, slots, token_ids: Sequence[int]) -> None:
    """A reservation of ``slots`` (an int64 tensor) for ``token_ids`` at row position ``start`` of ``r``, as
    SGLang's scheduler records it: the request's ``req_to_token`` row, its allocated length, and its fill
    ids (image placeholders padded as :func:`~.sglang_manager.radix_identity` keys them)."""
    pool.write((r.kv.req_pool_idx, slice(start, start + len(slots))), slots.int())
    r.kv.kv_allocated_len = start + len(slots)
    for t in token_ids[len(r.full_untruncated_fill_ids) - start:]:
        p = len(r.full_untruncated_fill_ids)
        r.full_untruncated_fill_ids.append(_pad(r.pads[p], t) if p in r.pads else t)


class SglangSwaRadixCache:
    """One ``PureSWARadixCache`` over ``num_blocks`` token slots, window ``window_left``."""

    prefill_aware = False
    window_released = 0  # row positions the window freed, over every instance (what the machine reached)

    def __init__(self, config: ManagerConfig) -> None:
        s = self.s = _import_swa()
        if config.window_left is None or config.window_left < 1:
            raise ValueError(f"window_left={config.window_left}: PureSWARadixCache needs a sliding window >= 1")
        self.size, self.window = config.num_blocks * config.block_size, config.window_left
        self.allocator = s.PureSWATokenToKVPoolAllocator(self.size, 1, s.torch.float32, "cpu", s.SwaKVPool(),
                                                         need_sort=False)
        self.pool = _ReqToTokenPool(s.torch, 64)
        self.tree = s.PureSWARadixCache(s.CacheInitParams(
            disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=1,
            sliding_window_size=self.window))
        self.reserved_blocks = 1  # slot 0 is SGLang's padding slot
        self.reqs: dict[int, _Req] = {}
        self.capabilities = ManagerCapabilities(block_size=1, window=self.window, extra_keys=True, evict=True,
                                                reset=True, eviction_order="lru-leaves", defers_commit=True)

    def _row(self, r: _Req, start: int, end: int) -> list[int]:
        return self.pool.req_to_token[r.kv.req_pool_idx, start:end].tolist()

    # -- the protocol ---------------------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        s = self.s
        tokens, pads, extra_key, cache_salt = radix_identity(token_ids, namespace, extra_keys)
        tokens = array("q", tokens)
        limit = max(len(tokens) - 1, 0)
        key = s.RadixKey(tokens[:limit], extra_key, cache_salt=cache_salt)
        match = self.tree.match_prefix(s.MatchPrefixParams(key=key))
        num_cached = match.device_prefix_len
        if not self.pool.free_rows:
            return None
        kv = s.ReqKvInfo(req_pool_idx=self.pool.free_rows.pop(), cache_protected_len=num_cached,
                     kv_committed_len=num_cached, kv_allocated_len=num_cached)
        prefix = self.tree.path_device_indices(match.last_device_node)[:num_cached]
        self.pool.write((kv.req_pool_idx, slice(0, num_cached)), prefix)
        r = _Req(kv, array("q", tokens), array("q", tokens), pads, extra_key, cache_salt)
        r.last_node, r.lock = match.last_device_node, self.tree.lock(match.last_device_node)
        self.reqs[request_id] = r
        return self.block_table(request_id), num_cached

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        r, s = self.reqs[request_id], self.s
        start, n = r.kv.kv_allocated_len, len(token_ids)
        assert start + n <= MAX_ROW, f"request {request_id}: row of {start + n} tokens exceeds MAX_ROW {MAX_ROW}"
        decode = start >= len(r.origin_input_ids)
        if decode:
            r.decode_batch_idx += 1
            self._evict_window(r, seqlen=start + n)
        got = None
        for attempt in range(2):
            got = self.allocator.alloc(n)
            if got is not None or attempt:
                break
            self.tree.evict(s.EvictParams(num_tokens=max(n - self.allocator.available_size(), 1)))
        if got is None:
            if decode:
                r.decode_batch_idx -= 1
            return None
        extend_row(self.pool, r, start, got, token_ids)
        if not decode and self.prefill_aware:
            r.kv.swa_evict_floor = r.kv.kv_allocated_len  # extend_end
        return got.tolist()

    def _evict_window(self, r: _Req, seqlen: int) -> None:
        """``ScheduleBatch.maybe_evict_swa`` for one decode request (eviction interval 1)."""
        kv = r.kv
        if r.decode_batch_idx < 1 or seqlen - 1 - self.window < kv.get_evicted_seqlen(self.s.SWA) + 1:
            return
        before, dead_lo = kv.get_evicted_seqlen(self.s.SWA), kv.swa_dead_lo(1)
        self.tree.evict_sliding_windows(r, seqlen - 1, eviction_interval=1)
        freed = range(max(before, dead_lo), kv.get_evicted_seqlen(self.s.SWA))
        r.released.update(freed)
        type(self).window_released += len(freed)

    def commit(self, request_id: int, num_tokens: int) -> None:
        r = self.reqs[request_id]
        r.kv.kv_committed_len = num_tokens
        if num_tokens <= len(r.origin_input_ids):  # a prefill chunk: cache_unfinished_req
            self.tree.checkpoint(r, up_to=num_tokens)

    def free(self, request_id: int) -> None:
        r = self.reqs.pop(request_id)
        kv, owned = r.kv, r.kv.kv_committed_len
        self.tree.checkpoint(r, up_to=owned)
        self.tree.free_kv_row(kv, [(kv.cache_protected_len, owned)])
        self.tree.unlock(r.lock)
        if kv.kv_allocated_len > owned:  # a reservation never written (the request aborted)
            unwritten = self.pool.req_to_token[kv.req_pool_idx, owned:kv.kv_allocated_len]
            self.allocator.free(unwritten.to(self.s.torch.int64))
        self.pool.free(r)
        kv.req_pool_idx = None

    def block_table(self, request_id: int) -> list[int]:
        r = self.reqs[request_id]
        return [-1 if p in r.released else b for p, b in enumerate(self._row(r, 0, r.kv.kv_allocated_len))]

    def holds(self, request_id: int) -> bool:
        return request_id in self.reqs

    def counts(self) -> tuple[int, int, int]:
        free = self.allocator.available_size() + self.tree.evictable_size()
        return free, self.size - free, self.size

    def evict(self, num_blocks: int) -> None:
        self.tree.evict(self.s.EvictParams(num_tokens=num_blocks))

    def reset(self) -> bool:
        if self.reqs:
            return False
        self.tree.reset()
        self.allocator.clear()
        return True

    def self_check(self) -> None:
        tree, owner = self.tree, {}

        def claim(slots, who):
            for slot in slots:
                assert slot not in owner, f"slot {slot} is both {owner[slot]} and {who}"
                owner[slot] = who

        inner = self.allocator.swa_attn_allocator
        claim(inner.free_pages.tolist() + inner.release_pages.tolist(), "free in the allocator")
        for rid, r in self.reqs.items():
            own = range(r.kv.cache_protected_len, r.kv.kv_allocated_len)
            claim({b for p, b in zip(own, self._row(r, own.start, own.stop)) if p not in r.released},
                  f"request {rid}'s own")
        check_radix_tree(tree, [r.lock.node for r in self.reqs.values()], claim)
        missing = set(range(1, self.size + 1)) - set(owner)
        assert not missing, f"slots {sorted(missing)} are neither free, in the tree, nor held by a request (leaked)"


class SglangSwaRadixCachePrefillAware(SglangSwaRadixCache):
    """The same on a model with ``is_prefill_aware_swa`` (SGLang's ``unlimited_ocr``)."""

    prefill_aware = True


def cache_manager(config: ManagerConfig) -> SglangSwaRadixCache:
    """The manager factory (``--pagedkv-impl pagedkv.tools.peers:sglang_pure_swa_radix_cache``).

    Raises:
        BackendUnavailableError: sglang is not installed (the message gives the install command).
        ValueError: ``config.window_left`` is ``None`` or below 1 (every layer is sliding-window).
    """
    return SglangSwaRadixCache(config)


def cache_manager_prefill_aware(config: ManagerConfig) -> SglangSwaRadixCachePrefillAware:
    """The factory of ``:sglang_pure_swa_radix_cache_prefill_aware`` (errors as :func:`cache_manager`)."""
    return SglangSwaRadixCachePrefillAware(config)


#: The windows (``window_left``) and block sizes the suite draws for these managers, and its program length:
#: a window eviction needs a request's third decode step (30 steps seldom get there).
cache_manager_windows = (1, 2)
cache_manager_block_sizes = (1,)
cache_manager_steps = 100


def peer(prefill_aware: bool = False):
    """A suite candidate whose ``cache_manager`` is SGLang's pure-SWA radix cache; it has no kernels.

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_swa()
    factory = cache_manager_prefill_aware if prefill_aware else cache_manager
    return types.SimpleNamespace(__name__=f"{__name__}:{'prefill_aware' if prefill_aware else 'plain'}",
                                 name=name + ("_prefill_aware" if prefill_aware else ""), cache_manager=factory,
                                 cache_manager_windows=cache_manager_windows,
                                 cache_manager_block_sizes=cache_manager_block_sizes,
                                 cache_manager_steps=cache_manager_steps, module=sys.modules[__name__])


def prefill_aware_peer():
    """:func:`peer` on a prefill-aware model (``pagedkv.tools.peers:sglang_pure_swa_radix_cache_prefill_aware``)."""
    return peer(prefill_aware=True)


# -- the hybrid (full + sliding window) radix cache: UnifiedRadixCache with its FULL and SWA components --------
#: memory_pool names the unified cache's modules import only as type names (isinstance checks of pools
#: not used here); the placeholder memory_pool gets them as empty classes.
_POOL_TYPE_NAMES = ("MHATokenToKVPool", "MLATokenToKVPool", "MHATokenToKOnlyPool", "DSATokenToKVPool",
                    "HybridLinearKVPool", "HybridReqToTokenPool", "MambaPool", "KvBufferDesc", "KVWriteLoc",
                    "RadixAttention", "GPU_MEMORY_TYPE_KV_CACHE", "unwrap_write_loc", "write_loc_is_physical")


def _placeholder(name: str, names) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    for n in names:
        if not hasattr(module, n):
            setattr(module, n, type(n, (), {"__doc__": "Placeholder: a type name only."}))
    sys.modules[name] = module
    return module


def _req_kv_info_class(root: str):
    """SGLang's ``ReqKvInfo``, its class body taken from ``managers/schedule_batch.py`` (that module imports
    the serving stack): the module ``sglang.srt.managers.schedule_batch`` holds it and nothing else."""
    import ast
    import os

    import torch
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.utils.common import ceil_align

    if "sglang.srt.managers" not in sys.modules:  # the package, without its __init__
        package = types.ModuleType("sglang.srt.managers")
        package.__path__ = [os.path.join(root, "managers")]
        sys.modules[package.__name__] = package
    path = os.path.join(root, "managers", "schedule_batch.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ReqKvInfo"]
    future = ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)
    module = sys.modules.get("sglang.srt.managers.schedule_batch") or types.ModuleType(
        "sglang.srt.managers.schedule_batch")
    sys.modules[module.__name__] = module
    module.__dict__.update(dataclasses=dataclasses, Optional=__import__("typing").Optional, torch=torch,
                           ComponentType=ComponentType, ceil_align=ceil_align)
    code = compile(ast.fix_missing_locations(ast.Module(body=[future, *body], type_ignores=[])), path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - SGLang's own class source, nothing else
    return module.ReqKvInfo


@functools.cache
def _import_unified():
    """SGLang's ``UnifiedRadixCache`` (FULL + SWA components) and ``SWATokenToKVPoolAllocator``, without the
    serving stack: placeholder type names for pools, metrics and DeepSeek V4's HiSparse allocator (named
    only in ``isinstance`` checks), SGLang's ``ReqKvInfo`` from its class source; ``StreamingSession``, the
    tree core, its components and the allocators are SGLang's."""
    s = _import_swa()
    try:
        _placeholder("sglang.srt.mem_cache.memory_pool", _POOL_TYPE_NAMES)
        _placeholder("sglang.srt.observability.metrics_collector",
                     ("STAT_LOGGER_ROLE_STORAGE", "StorageMetricsCollector", "StorageMetrics"))
        # DeepSeek V4's allocator, named only in an isinstance check of the SWA component
        _placeholder("sglang.srt.mem_cache.allocator.hisparse", ("DeepSeekV4HiSparseTokenToKVPoolAllocator",))
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError as exc:
        raise BackendUnavailableError(f"sglang lacks its UnifiedRadixCache ({type(exc).__name__}: {exc}); "
                                      f"install: {RECIPE}") from exc

    class _HybridKVPool(s.SwaKVPool):
        """The full -> SWA slot mapping the allocator registers (``SWAKVPool``'s), no tensors."""

        full_kv_pool = None
        full_to_swa_index_mapping = None

        def register_mapping(self, full_to_swa_index_mapping):
            self.full_to_swa_index_mapping = full_to_swa_index_mapping

        def translate_loc_from_full_to_swa(self, kv_indices):
            return self.full_to_swa_index_mapping[kv_indices]

    return types.SimpleNamespace(**vars(s), UnifiedRadixCache=UnifiedRadixCache,
                                 SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator, FULL=ComponentType.FULL,
                                 HybridKVPool=_HybridKVPool)


class _UnifiedReq:
    """The fields of SGLang's ``Req`` the unified tree reads when matching and checkpointing."""

    def __init__(self, rid: int, kv, tokens: array, pads: dict, extra_key, cache_salt) -> None:
        self.rid, self.kv, self.pads, self.extra_key, self.cache_salt = str(rid), kv, pads, extra_key, cache_salt
        self.origin_input_ids, self.full_untruncated_fill_ids = array("q", tokens), array("q", tokens)
        self.priority = self.session_id = self.session = self.kv_rotation_base = None
        self.lock = self.last_node = self.swa_branching_seqlen = None
        self.prefix_len, self.decode_batch_idx, self.is_finished = 0, -1, False
        self.extend_end = None  # the end of the current prefill round
        self.released: set = set()

    def finished(self) -> bool:
        return self.is_finished

    def get_fill_ids(self) -> array:
        return self.full_untruncated_fill_ids[: self.extend_end]


class SglangHybridSwaRadixCache:
    """``UnifiedRadixCache`` with FULL and SWA components over a ``SWATokenToKVPoolAllocator`` (a Gemma-style
    model: full-attention and sliding-window layers), as the two groups ``(full, sliding_window)``.

    SGLang keeps two pools (full and SWA slots, each with padding slot 0) and a full -> SWA slot mapping;
    the protocol's one block id space holds both: full page ``p`` is block ``p``, SWA page ``q`` is block
    ``num_blocks + 1 + q``. ``window_left`` 0 is served with SGLang's ``sliding_window_size`` 1 (it takes
    no smaller; keeping one more token is conservative)."""

    window_released = 0  # row positions the window freed, over every instance (what the machine reached)

    def __init__(self, config: ManagerConfig) -> None:
        s = self.s = _import_unified()
        kinds = tuple(g.kind for g in config.groups)
        if kinds != ("full", "sliding_window") or len({g.block_size for g in config.groups}) != 1:
            raise ValueError(f"groups {config.groups!r}: the unified SWA cache serves one full-attention and one "
                             f"sliding-window group of one page size")
        self.groups = config.groups
        ps = self.page_size = config.groups[0].block_size
        self.window = max(config.groups[1].window, 1)
        self.num_pages = config.num_blocks
        size = self.num_pages * ps
        self.kv_pool = s.HybridKVPool()
        self.allocator = s.SWATokenToKVPoolAllocator(size, size, ps, s.torch.float32, "cpu", self.kv_pool,
                                                     need_sort=False)
        self.pool = _ReqToTokenPool(s.torch, 64)
        params = s.CacheInitParams(disable=False, req_to_token_pool=self.pool, page_size=ps,
                                   token_to_kv_pool_allocator=self.allocator, sliding_window_size=self.window)
        params.tree_components = (s.FULL, s.SWA)
        self.tree = s.UnifiedRadixCache(params)
        self.reserved_blocks = 2  # each pool's padding page
        self.reqs: dict[int, _UnifiedReq] = {}
        self.capabilities = ManagerCapabilities(block_size=ps, extra_keys=True, evict=True, reset=True,
                                                eviction_order="lru-leaves", defers_commit=True, groups=config.groups)

    # -- ids -------------------------------------------------------------------------------------------
    def _swa_slot(self, full_slot: int) -> int:
        swa = int(self.kv_pool.full_to_swa_index_mapping[full_slot])
        return -1 if swa <= 0 else (self.num_pages + 1) * self.page_size + swa

    def _row(self, r, start: int, end: int) -> list[int]:
        return self.pool.req_to_token[r.kv.req_pool_idx, start:end].tolist()

    # -- the protocol ---------------------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        s = self.s
        tokens, pads, extra_key, cache_salt = radix_identity(token_ids, namespace, extra_keys)
        tokens = array("q", tokens)
        if not self.pool.free_rows:
            return None
        r = _UnifiedReq(request_id, s.ReqKvInfo(), tokens, pads, extra_key, cache_salt)
        key = s.RadixKey(tokens[:max(len(tokens) - 1, 0)], extra_key, cache_salt=cache_salt)
        match = self.tree.match_prefix(s.MatchPrefixParams(key=key, req=r))  # common.match_kv_cache
        n = match.device_prefix_len
        r.prefix_len, r.last_node, r.swa_branching_seqlen = n, match.last_device_node, match.swa_branching_seqlen
        r.kv.req_pool_idx = self.pool.free_rows.pop()
        r.kv.cache_protected_len = r.kv.kv_committed_len = r.kv.kv_allocated_len = n
        self.pool.write((r.kv.req_pool_idx, slice(0, n)), self.tree.path_device_indices(match.last_device_node)[:n])
        r.lock = self.tree.lock(match.last_device_node)
        self.reqs[request_id] = r
        tables = self.block_table(request_id)
        pages = n // self.page_size
        return (tables[0][:pages], tables[1][:pages]), n

    def _alloc(self, r, n: int):
        torch, ps = self.s.torch, self.page_size
        if ps == 1:
            return self.allocator.alloc(n)
        length = r.kv.kv_allocated_len
        last = int(self.pool.req_to_token[r.kv.req_pool_idx, length - 1]) if length else -1
        return self.allocator.alloc_extend(torch.tensor([length]), torch.tensor([length]), torch.tensor([length + n]),
                                           torch.tensor([length + n]), torch.tensor([last]), n)

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        r, s = self.reqs[request_id], self.s
        start, n = r.kv.kv_allocated_len, len(token_ids)
        assert start + n <= MAX_ROW, f"request {request_id}: row of {start + n} tokens exceeds MAX_ROW {MAX_ROW}"
        decode = start >= len(r.origin_input_ids)
        if decode:
            r.decode_batch_idx += 1
            self._evict_window(r, seqlen=start + n)
        got = None
        for attempt in range(2):
            got = self._alloc(r, n)
            if got is not None or attempt:
                break
            need = n + self.page_size
            self.tree.evict(s.EvictParams(num_tokens=max(need - self.allocator.full_available_size(), 1),
                                          swa_num_tokens=max(need - self.allocator.swa_available_size(), 1)))
        if got is None:
            if decode:
                r.decode_batch_idx -= 1
            return None
        extend_row(self.pool, r, start, got, token_ids)
        if not decode:
            r.extend_end = r.kv.kv_allocated_len
        full = got.tolist()
        return full, [self._swa_slot(f) for f in full]

    _evict_window = SglangSwaRadixCache._evict_window

    def commit(self, request_id: int, num_tokens: int) -> None:
        r = self.reqs[request_id]
        r.kv.kv_committed_len = num_tokens
        if num_tokens <= len(r.origin_input_ids):  # a prefill chunk: cache_unfinished_req
            self.tree.checkpoint(r, up_to=num_tokens)

    def free(self, request_id: int) -> None:
        """``release_kv_cache(checkpoint=True)`` of a finished request."""
        r = self.reqs.pop(request_id)
        kv, owned = r.kv, r.kv.kv_committed_len
        r.is_finished = True
        self.tree.checkpoint(r, up_to=owned)
        self.tree.free_kv_row(kv, [(kv.cache_protected_len, owned)])
        self.tree.unlock(r.lock)
        if kv.kv_allocated_len > owned:  # a reservation never written (the request aborted)
            unwritten = self.pool.req_to_token[kv.req_pool_idx, owned:kv.kv_allocated_len]
            if self.page_size > 1:  # whole pages only: the row's pages past the last owned one
                unwritten = unwritten[(-owned) % self.page_size:]
            self.allocator.free(unwritten.to(self.s.torch.int64))
        self.tree.on_release(r, checkpointed=True)
        self.pool.free(r)
        kv.mark_kv_released()
        kv.req_pool_idx = None

    def block_table(self, request_id: int):
        r, ps = self.reqs[request_id], self.page_size
        row = self._row(r, 0, r.kv.kv_allocated_len)
        full = [row[i] // ps for i in range(0, len(row), ps)]
        swa = []
        for i in range(0, len(row), ps):
            slot = -1 if i in r.released else self._swa_slot(row[i])
            swa.append(-1 if slot < 0 else slot // ps)
        return full, swa

    def holds(self, request_id: int) -> bool:
        return request_id in self.reqs

    def counts(self) -> tuple[int, int, int] | None:
        """Only while no request is live: SGLang's SWA lock leaves a live request's slots behind its window
        evictable (counted free) while its row still maps them, which the protocol's ``used == held`` does
        not model; idle, every slot must be free or evictable (a leak shows)."""
        if self.reqs:
            return None
        a, t, ps = self.allocator, self.tree, self.page_size
        free = (a.full_available_size() + t.full_evictable_size() + a.swa_available_size()
                + t.swa_evictable_size()) // ps
        return free, 2 * self.num_pages - free, 2 * self.num_pages

    def evict(self, num_blocks: int) -> None:
        n = num_blocks * self.page_size
        self.tree.evict(self.s.EvictParams(num_tokens=n, swa_num_tokens=n))

    def reset(self) -> bool:
        if self.reqs:
            return False
        self.tree.reset()
        self.allocator.clear()
        return True

    def self_check(self) -> None:
        if not self.reqs:  # SGLang's own tree invariants (it asserts every node unlocked: an idle tree)
            self.tree.sanity_check()


def hybrid_cache_manager(config: ManagerConfig) -> SglangHybridSwaRadixCache:
    """The factory of ``:sglang_swa_radix_cache`` (SGLang's hybrid full + sliding-window radix cache).

    Raises:
        BackendUnavailableError: sglang is not installed (the message gives the install command).
        ValueError: ``config.groups`` is not one full-attention and one sliding-window group of one block size.
    """
    return SglangHybridSwaRadixCache(config)


def hybrid_peer():
    """A suite candidate over :func:`hybrid_cache_manager` in the Gemma layout (``gemma3``).

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_unified()
    return types.SimpleNamespace(__name__=f"{__name__}:hybrid", name="sglang_swa_radix_cache",
                                 cache_manager=hybrid_cache_manager, cache_manager_layouts=("gemma3",),
                                 cache_manager_steps=cache_manager_steps, module=sys.modules[__name__])
