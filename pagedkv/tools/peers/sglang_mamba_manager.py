"""SGLang's Mamba radix cache (sglang 0.5.23, on a CPU) through the cache-manager protocol: the
``UnifiedRadixCache`` with its ``FULL`` and ``MAMBA`` components over SGLang's own ``HybridReqToTokenPool``
(its ``MambaPool`` and ``MambaSlotAllocator``) and a ``TokenToKVPoolAllocator``, for a hybrid model of
full-attention and Mamba layers (the ``jamba`` and ``qwen3-next`` layouts of ``HYBRID_LAYOUTS``).

Spec ``pagedkv.tools.peers:sglang_mamba_radix_cache``. SGLang 0.5.23 has no ``MambaRadixCache`` module any
more: the Mamba radix cache is this component. Its strategy here is ``no_buffer`` (what ``auto`` resolves to
with overlap scheduling off, or where the model has no extra buffer; ``extra_buffer``, ``auto``'s choice
with overlap scheduling, tracks states in ping-pong slots at chunk boundaries that ``ScheduleBatch``
computes per batch, and is not driven here). ``no_buffer`` needs page size 1, so a block is a token slot.
Each request holds one Mamba state slot (``req.kv.mamba_pool_idx``) that its steps overwrite; the tree
caches a state where a request was checkpointed, and a hit hands the request a copy (copy-on-write).
The tree core is SGLang's default, its Rust ``RustUnifiedTreeCore`` (``tree_core_backend`` picks the
Python one); ``:sglang_mamba_radix_cache_path_cap`` runs with ``--mamba-max-states-per-path 1``.

Each protocol call is what SGLang's scheduler does (``managers/schedule_batch.py``, ``mem_cache/common.py``):

- ``admit``: ``match_prefix`` on the prompt's first ``len - 1`` tokens with ``cow_mamba=True``
  (``init_next_round_input``): the hit ends at the deepest node holding a state, and a hit with a state
  allocates the request's own slot and records the node's slot as ``mamba_cow_src_index``; ``lock``; the
  row (``HybridReqToTokenPool.alloc``: a fresh slot marked ``mamba_needs_clear`` where the hit had no
  state). Refused (the scheduler keeps the request waiting) without a free row: SGLang sizes
  ``max_running_requests`` (the rows) to a third of the Mamba slots with ``no_buffer``, here
  ``num_blocks`` rows and ``3 * num_blocks`` slots; a full Mamba pool is first relieved by
  ``evict_for_alloc`` of one state, and still full refuses too.
- ``reserve``: the request's first forward runs the deferred copy-on-write (``copy_mamba_state`` from
  the node's slot into the request's) or clear (``_collect_deferred_mamba_cow_and_clear`` and the model
  runner); then ``alloc`` of token slots (``evict`` when short, once more). The Mamba slots returned are
  ``-1`` but for the step's last token: the request's own state slot, which the step overwrites.
- ``commit``: a prefill chunk's end is ``checkpoint`` (``cache_unfinished_req``): the tree gets a copy of
  the request's state in a fresh slot (``prepare_for_caching_req``, unfinished) at the written length;
  decode tokens only advance ``kv_committed_len``.
- ``free``: ``release_kv_cache(checkpoint=True)`` of a finished request: the request's own state slot is
  donated to the tree at the committed length (freed where the node already holds one), the row past
  ``cache_protected_len`` freed, ``unlock``.
- ``block_table``: the full group's slots; the Mamba group ``-1`` but where the request's state lives: the
  node's slot at the hit's last token while the copy-on-write is pending, else the request's own slot at
  its last committed and its last reserved token. ``counts``: only while no request is live (as the SWA
  cache): every full and Mamba slot free or evictable. ``evict``: states first (``mamba_num``), then
  full K/V.
- ``self_check``: each full slot and each Mamba slot is in exactly one of the allocator's free list, the
  tree, or one live request's own part; SGLang's ``sanity_check`` while idle.

Block ids: full slot ``p`` is block ``p``; Mamba slot ``q`` is block ``num_blocks + 1 + q`` (slot 0 of each
pool is SGLang's padding slot). The manager owns the pools (``kv_pools``) because SGLang copies states:
one storage per K and V, whose Mamba rows are the ``MambaPool``'s own ``temporal`` and ``conv`` state
tensors (``[num_mamba_layers, mamba slots + 1, 1, num_kv_heads, head_dim]`` and the same without the
page axis), so SGLang's ``copy_from`` moves what the machine wrote.

Loading (no serving stack, no torchvision): as :mod:`.sglang_hybrid_manager`, plus SGLang's
``memory_pool.py`` itself, which needs :func:`_load_memory_pool`'s two guards. Its imports reach
``sglang.srt.configs`` (whose ``__init__`` imports every model config, three of them torchvision for
image preprocessing: ``deepseek_ocr``, ``deepseekvl2``, ``nano_nemotron_vl``); the package is entered
without its ``__init__``, each config imported from its own module when first named. And two layer
modules imported for names the Mamba pools do not use (``RadixAttention``, an annotation of the K/V pools'
methods; ``UnquantizedKVCacheMethod``, the MHA pool's default quantizer), whose imports pull the model
layers, MoE runners and, through them, the same configs: empty stand-ins while ``memory_pool.py`` loads,
removed after. PyPI's torchvision 0.28.0 (torch 2.13's) is built against CUDA torch (``_C.so`` needs
``libc10_cuda.so``) and does not import beside torch 2.13.0+cpu, so installing it is no way out.
SGLang's runtime config is set from ``ServerArgs(model_path="dummy")`` without resolving it
(``get_context().set_server_args``), the Mamba cache chunk pre-seeded as SGLang's fixtures do: no model
config is read.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from array import array
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities, ManagerConfig
from pagedkv.tools.peers.sglang_hybrid_manager import (MAX_ROW, SglangHybridSwaRadixCache, _import_unified,
                                                       _UnifiedReq, extend_row)
from pagedkv.tools.peers.sglang_manager import RECIPE, radix_identity

name = "sglang_mamba_radix_cache"
#: SGLang's Mamba cache chunk without a model config (FLA's ``CHUNK_SIZE``; only the extra-buffer
#: strategy reads it).
MAMBA_CACHE_CHUNK = 64
#: Mamba state slots per running request with ``no_buffer`` (``_calculate_mamba_ratio`` of SGLang's
#: ``kv_cache_configurator.py``: ``max_running_requests = max_mamba_cache_size // 3``).
MAMBA_SLOTS_PER_REQUEST = 3


def _lazy_configs(root: str) -> None:
    """``sglang.srt.configs`` without its ``__init__``: a name the package exports is imported from its
    own module when first asked for (the ``__init__``'s imports, read from its source)."""
    name = "sglang.srt.configs"
    if name in sys.modules:
        return
    path = os.path.join(root, "configs")
    with open(os.path.join(path, "__init__.py")) as f:
        where = {alias.asname or alias.name: node.module for node in ast.parse(f.read()).body
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(name + ".")
                 for alias in node.names}
    package = types.ModuleType(name)
    package.__path__ = [path]
    package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    package.__spec__.submodule_search_locations = package.__path__

    def __getattr__(attr):
        if attr in where:
            return getattr(importlib.import_module(where[attr]), attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    package.__getattr__ = __getattr__
    sys.modules[name] = package


def _load_memory_pool(root: str) -> types.ModuleType:
    """SGLang's ``mem_cache/memory_pool.py``, loaded from its source (see the module docstring). Where
    another adapter put a placeholder of that name in ``sys.modules`` it stays there (those adapters'
    pools are shells the real base classes would reject), given the real ``HybridReqToTokenPool`` that
    the Mamba component looks up when it is built."""
    name = "sglang.srt.mem_cache.memory_pool"
    current = sys.modules.get(name)
    if current is not None and getattr(current, "__file__", None):
        return current
    _lazy_configs(root)
    stand_ins = {"sglang.srt.layers.quantization.fp4_kv_cache_quant_method": "UnquantizedKVCacheMethod",
                 "sglang.srt.layers.radix_attention": "RadixAttention"}
    added = [n for n in stand_ins if n not in sys.modules]
    for n in added:
        module = types.ModuleType(n)
        setattr(module, stand_ins[n], type(stand_ins[n], (), {"__doc__": "Stand-in: a name only."}))
        sys.modules[n] = module
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "mem_cache", "memory_pool.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        for n in added:
            sys.modules.pop(n, None)
        if current is not None:
            sys.modules[name] = current
            current.HybridReqToTokenPool = module.HybridReqToTokenPool
        else:
            sys.modules.pop(name, None)
    return module


@functools.cache
def _import_mamba():
    """The unified cache's Mamba component and SGLang's real Mamba pools, its runtime config published."""
    s = _import_unified()
    root = sys.modules["sglang.srt"].__path__[0]
    try:
        memory_pool = _load_memory_pool(root)
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.runtime_context import get_context, get_exec
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise BackendUnavailableError(f"sglang lacks its Mamba pools or component ({type(exc).__name__}: {exc}); "
                                      f"install: {RECIPE}") from exc
    if not get_context().is_config_namespace_published("exec"):
        args = ServerArgs(model_path="dummy")
        args._mamba_cache_chunk_size = MAMBA_CACHE_CHUNK
        get_context().set_server_args(args)  # the config bags, without resolving a model
    return types.SimpleNamespace(**vars(s), memory_pool=memory_pool, MAMBA=ComponentType.MAMBA, get_exec=get_exec,
                                 Mamba2CacheParams=Mamba2CacheParams, Mamba2StateDType=Mamba2StateDType,
                                 Mamba2StateShape=Mamba2StateShape)


class SglangMambaRadixCache:
    """``UnifiedRadixCache`` with FULL and MAMBA components (a Jamba-style model: full-attention and Mamba
    layers), as the two groups ``(full, mamba)`` of block size 1; see the module docstring."""

    #: ``--mamba-max-states-per-path`` (-1: unlimited, SGLang's default): after an insert, the shallowest
    #: interior states beyond the cap are evicted, their full K/V kept.
    max_states_per_path = -1
    #: SGLang's tree core (``CacheInitParams.tree_core_backend``): ``None`` its default, the Rust core;
    #: ``"python"`` the Python one.
    tree_core_backend = None
    #: one token a page: the ``no_buffer`` strategy takes no other (``free`` reads it)
    page_size = 1

    def __init__(self, config: ManagerConfig) -> None:
        s = self.s = _import_mamba()
        torch = s.torch
        kinds = tuple(g.kind for g in config.groups)
        if kinds != ("full", "mamba") or any(g.block_size != 1 for g in config.groups):
            raise ValueError(f"groups {config.groups!r}: the Mamba radix cache (no_buffer) serves one full-attention "
                             f"and one Mamba group of block size 1")
        self.groups = config.groups
        n = self.num_blocks = config.num_blocks
        # SGLang's sizing: max_running_requests = max_mamba_cache_size // 3 with no_buffer (a state per
        # running request, the one its last node keeps, a checkpoint's copy), the rows bounding admission
        m = self.mamba_size = MAMBA_SLOTS_PER_REQUEST * n
        self.mamba_base = n + 1  # block id of Mamba slot 0
        num_layers = max(config.num_layers, 1)
        mamba_layers = config.groups[1].num_layers
        heads, head_dim = config.num_kv_heads, config.head_dim
        shape = s.Mamba2StateShape(conv=[(heads, head_dim)], temporal=(1, heads, head_dim), intermediate_size=1,
                                   conv_dim=1, ssm_state_size=head_dim, num_heads=1, head_dim=head_dim,
                                   state_size=head_dim, conv_kernel=head_dim + 1)
        params = s.Mamba2CacheParams(shape=shape, layers=list(range(mamba_layers)),
                                     dtype=s.Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
        self.pool = s.memory_pool.HybridReqToTokenPool(
            size=n, mamba_size=m, mamba_spec_state_size=n, max_context_len=MAX_ROW,
            device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=list(range(mamba_layers)),
            enable_mamba_extra_buffer=False)
        # the machine's pools: one storage per K and V; the Mamba rows are the MambaPool's state tensors
        total = self.mamba_base + m + 1
        self.k_all = torch.full((num_layers, total, 1, heads, head_dim), float("nan"))
        self.v_all = torch.full((num_layers, total, 1, heads, head_dim), float("nan"))
        mamba_pool = self.pool.mamba_pool
        mamba_pool.mamba_cache = type(mamba_pool.mamba_cache)(conv=[self.v_all[:mamba_layers, self.mamba_base:, 0]],
                                                              temporal=self.k_all[:mamba_layers, self.mamba_base:])
        self.allocator = s.TokenToKVPoolAllocator(n, torch.float32, "cpu", None, need_sort=False)
        params = s.CacheInitParams(disable=False, req_to_token_pool=self.pool, page_size=self.page_size,
                                   token_to_kv_pool_allocator=self.allocator, enable_mamba_extra_buffer=False)
        params.tree_components = (s.FULL, s.MAMBA)
        params.tree_core_backend = self.tree_core_backend
        with s.get_exec().mamba.override(mamba_max_states_per_path=self.max_states_per_path):  # read when built
            self.tree = s.UnifiedRadixCache(params)
        self.reqs: dict[int, _UnifiedReq] = {}
        self.capabilities = ManagerCapabilities(block_size=1, extra_keys=True, evict=True, reset=True,
                                                eviction_order="lru-leaves", defers_commit=True, owns_pools=True,
                                                groups=config.groups)

    def kv_pools(self, layer: int):
        """Layer slot ``layer``'s ``(K, V)`` pools, ``[total blocks, 1, num_kv_heads, head_dim]`` float32."""
        return self.k_all[layer], self.v_all[layer]

    # -- ids -------------------------------------------------------------------------------------------
    def _mamba_block(self, slot) -> int:
        return self.mamba_base + int(slot)

    def _row(self, r, start: int, end: int) -> list[int]:
        return self.pool.req_to_token[r.kv.req_pool_idx, start:end].tolist()

    # -- the protocol ---------------------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        s = self.s
        tokens, pads, extra_key, cache_salt = radix_identity(token_ids, namespace, extra_keys)
        tokens = array("q", tokens)
        mamba = self.pool.mamba_allocator
        if not self.pool.available_size():
            return None
        if not mamba.available_size():  # the scheduler admits a request only with a state slot for it
            self.tree.evict_for_alloc(s.EvictParams(num_tokens=0, mamba_num=1))
            if not mamba.available_size():
                return None
        r = _UnifiedReq(request_id, s.ReqKvInfo(), tokens, pads, extra_key, cache_salt)
        key = s.RadixKey(tokens[:max(len(tokens) - 1, 0)], extra_key, cache_salt=cache_salt)
        match = self.tree.match_prefix(s.MatchPrefixParams(key=key, req=r, cow_mamba=True))
        n = match.device_prefix_len
        r.prefix_len, r.last_node = n, match.last_device_node
        r.lock = self.tree.lock(match.last_device_node)
        r.kv.cache_protected_len = r.kv.kv_committed_len = r.kv.kv_allocated_len = n
        self.pool.alloc([r])  # the row; a fresh state slot where the hit brought none
        self.pool.write((r.kv.req_pool_idx, slice(0, n)), self.tree.path_device_indices(match.last_device_node)[:n])
        self.reqs[request_id] = r
        tables = self.block_table(request_id)
        return (tables[0][:n], tables[1][:n]), n

    def _forward(self, r) -> None:
        """The deferred state copy-on-write (or clear) a request's first forward runs."""
        kv = r.kv
        if kv.mamba_cow_src_index is not None:
            self.pool.copy_mamba_state(kv.mamba_cow_src_index.view(-1), kv.mamba_pool_idx.view(-1))
            kv.mamba_cow_src_index = None
        elif kv.mamba_needs_clear:
            self.pool.mamba_pool.clear_slots(kv.mamba_pool_idx.view(-1))
        kv.mamba_needs_clear = False

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        r, s = self.reqs[request_id], self.s
        start, n = r.kv.kv_allocated_len, len(token_ids)
        assert start + n <= MAX_ROW, f"request {request_id}: row of {start + n} tokens exceeds MAX_ROW {MAX_ROW}"
        got = None
        for attempt in range(2):
            got = self.allocator.alloc(n)
            if got is not None or attempt:
                break
            self.tree.evict(s.EvictParams(num_tokens=max(n - self.allocator.available_size(), 1)))
        if got is None:
            return None
        self._forward(r)
        extend_row(self.pool, r, start, got, token_ids)
        if start < len(r.origin_input_ids):
            r.extend_end = r.kv.kv_allocated_len
        state = self._mamba_block(r.kv.mamba_pool_idx)
        return got.tolist(), [-1] * (n - 1) + [state]

    # SGLang's cache_unfinished_req / release_kv_cache as the hybrid SWA adapter drives them (one token a page)
    commit = SglangHybridSwaRadixCache.commit
    free = SglangHybridSwaRadixCache.free

    def block_table(self, request_id: int):
        r = self.reqs[request_id]
        kv = r.kv
        full = self._row(r, 0, kv.kv_allocated_len)
        mamba = [-1] * kv.kv_allocated_len
        if kv.mamba_cow_src_index is not None:
            mamba[kv.kv_committed_len - 1] = self._mamba_block(kv.mamba_cow_src_index.view(-1)[0])
        elif kv.mamba_pool_idx is not None:
            own = self._mamba_block(kv.mamba_pool_idx)
            for p in {kv.kv_committed_len - 1, kv.kv_allocated_len - 1}:
                if p >= 0:
                    mamba[p] = own
        return full, mamba

    def holds(self, request_id: int) -> bool:
        return request_id in self.reqs

    def counts(self) -> tuple[int, int, int] | None:
        """Only while no request is live (as the SWA cache's): every full and Mamba slot free or evictable."""
        if self.reqs:
            return None
        t = self.tree
        free = (self.allocator.available_size() + t.full_evictable_size()
                + self.pool.mamba_allocator.available_size() + t.mamba_evictable_size())
        total = self.num_blocks + self.mamba_size
        return free, total - free, total

    def evict(self, num_blocks: int) -> None:
        """States first (what admission does when the Mamba pool is short: nodes keep their full K/V
        without a state, so later hits stop above them), then full K/V (leaves)."""
        self.tree.evict(self.s.EvictParams(num_tokens=0, mamba_num=num_blocks))
        self.tree.evict(self.s.EvictParams(num_tokens=num_blocks))

    def reset(self) -> bool:
        if self.reqs:
            return False
        self.tree.reset()
        self.allocator.clear()
        self.pool.clear()
        return True

    def self_check(self) -> None:
        owner: dict[int, str] = {}

        def claim(blocks, who):
            for b in blocks:
                assert b not in owner, f"block {b} is both {owner[b]} and {who}"
                owner[b] = who

        alloc = self.allocator
        claim(alloc.free_pages.tolist() + alloc.release_pages.tolist(), "free in the full allocator")
        claim([self._mamba_block(q) for q in self.pool.mamba_allocator.free_slots.tolist()],
              "free in the Mamba allocator")
        claim(self.tree.all_values_flatten().tolist(), "in the tree (full)")
        claim([self._mamba_block(q) for q in self.tree.all_mamba_values_flatten().tolist()], "in the tree (Mamba)")
        for rid, r in self.reqs.items():
            kv = r.kv
            claim(self._row(r, kv.cache_protected_len, kv.kv_allocated_len), f"request {rid}'s own")
            claim([self._mamba_block(kv.mamba_pool_idx)], f"request {rid}'s state")
        want = set(range(1, self.num_blocks + 1)) | {self._mamba_block(q) for q in range(1, self.mamba_size + 1)}
        missing = want - set(owner)
        assert not missing, f"blocks {sorted(missing)} are neither free, in the tree, nor held by a request (leaked)"
        if not self.reqs:
            self.tree.sanity_check()


class SglangMambaRadixCachePathCap(SglangMambaRadixCache):
    """The same with ``--mamba-max-states-per-path 1``: one cached state per root-to-tail path."""

    max_states_per_path = 1


def cache_manager(config: ManagerConfig) -> SglangMambaRadixCache:
    """The manager factory (``--pagedkv-impl pagedkv.tools.peers:sglang_mamba_radix_cache``).

    Raises:
        BackendUnavailableError: sglang is not installed (the message gives the install command).
        ValueError: ``config.groups`` is not one full-attention and one Mamba group of block size 1.
    """
    return SglangMambaRadixCache(config)


#: The layouts, block sizes and program length the suite draws for this manager.
cache_manager_layouts = ("jamba", "qwen3-next")
cache_manager_block_sizes = (1,)
cache_manager_steps = 50


def cache_manager_path_cap(config: ManagerConfig) -> SglangMambaRadixCachePathCap:
    """The factory of ``:sglang_mamba_radix_cache_path_cap`` (errors as :func:`cache_manager`)."""
    return SglangMambaRadixCachePathCap(config)


def peer(path_cap: bool = False):
    """A suite candidate over :func:`cache_manager` in the Jamba and Qwen3-Next layouts (``path_cap``: over
    :func:`cache_manager_path_cap`); it has no kernels.

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_mamba()
    return types.SimpleNamespace(__name__=f"{__name__}:{'path_cap' if path_cap else 'plain'}",
                                 name=name + ("_path_cap" if path_cap else ""),
                                 cache_manager=cache_manager_path_cap if path_cap else cache_manager,
                                 cache_manager_layouts=cache_manager_layouts,
                                 cache_manager_block_sizes=cache_manager_block_sizes,
                                 cache_manager_steps=cache_manager_steps, module=sys.modules[__name__])


def path_cap_peer():
    """:func:`peer` with ``--mamba-max-states-per-path 1``
    (``pagedkv.tools.peers:sglang_mamba_radix_cache_path_cap``)."""
    return peer(path_cap=True)
