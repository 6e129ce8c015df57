"""SGLang's ``RadixCache`` over its token-to-KV allocator (sglang 0.5.23, pure Python) through the cache-manager
protocol.

Spec: ``pagedkv.tools.peers:sglang_radix_cache`` (``cache_manager`` is the factory the suite looks for).
Block size 1 is SGLang's ``TokenToKVPoolAllocator`` (page size 1, a block is a token slot); block sizes
above 1 are its ``PagedTokenToKVPoolAllocator`` (page size = block_size). Each protocol call is what
SGLang's scheduler does with a request's KV row (``req_to_token``), the tree and the allocator
(``managers/schedule_batch.py``, ``mem_cache/common.py``, ``RadixCache.checkpoint``):

- ``admit``: ``match_prefix`` on the prompt's first ``len - 1`` tokens (``_compute_max_prefix_len``: the
  last token is always computed), page-aligned, with the namespace in the ``RadixKey`` (a str is its
  ``cache_salt``, ``("lora", n)`` its ``extra_key``); ``lock`` (``inc_lock_ref``) of the matched node;
  the request's row starts with ``path_device_indices`` of that node. Extra keys are what SGLang does
  with a multimodal input: the token id at the position becomes a pad value derived from the input's
  hash (``pad_input_ids``), so the key is part of the token ids the tree sees (:func:`_pad`).
- ``reserve``: ``alloc`` (page size 1) or ``alloc_extend`` (paged; continues the row's last page); when
  short, ``evict`` the shortfall of unlocked leaves (``evict_to_free_tokens``) and try once more.
- ``commit``: ``checkpoint`` (what ``cache_unfinished_req`` does): ``insert`` the page-aligned written
  prefix, free the row's slots the tree already held (``free_segment`` of ``[cache_protected_len,
  prefix_len)``), re-``match_prefix`` and point the row at the tree's slots, move the lock to the new node.
- ``free``: ``release_kv_cache`` (``cache_finished_req``): the committed prefix is checkpointed, the
  row's own slots past ``cache_protected_len`` are freed, ``unlock`` (``dec_lock_ref``).
  ``preempt`` is a free and a re-admission.
- ``evict``: ``evict(EvictParams(num_tokens))``; ``reset``: ``flush_cache`` (``reset`` + ``allocator.clear``),
  refused (``False``) while a request is live, as SGLang refuses a flush of a busy scheduler.
- ``block_table``: the row's page ids (``row[i * page_size] // page_size``); ``counts``: pages
  free in the allocator plus evictable tree pages, of ``size / page_size``.
- ``self_check``: each slot is in exactly one of the allocator's free list, the tree, or one row's own
  part; each node's ``lock_ref`` equals the live requests locking it or a descendant; ``evictable_size``
  + ``protected_size`` equals the tree's size and the evictable leaves are exactly the unlocked leaves.

Loading: ``sglang/__init__``, ``sglang/srt/__init__`` and ``mem_cache/memory_pool.py`` pull the serving
stack, model configs and torchvision (not loadable beside this torch); the radix tree needs none of them.
:func:`_import_sglang` enters the two packages without running their ``__init__`` and puts two
placeholder modules in ``sys.modules`` for names the tree imports only as type names (``KVCache`` only as the base of
SGLang's ``BaseSWAKVPool``, see :mod:`.sglang_hybrid_manager`) or for metrics
it does not collect here: ``memory_pool.ReqToTokenPool`` (an annotation of ``CacheInitParams``) and
``observability.metrics_collector`` (used only with ``enable_metrics``). Everything else is SGLang's code.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import types
from array import array
from collections.abc import Hashable, Sequence

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.managers.oracle import stable_hash
from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities, ManagerConfig

#: The peer's name (what the summary and the peers table call it).
name = "sglang_radix_cache"
#: The install into a fresh venv holding torch and pagedkv[testing] (docs/peers.md, "SGLang's RadixCache").
RECIPE = ("pip install --no-deps sglang==0.5.23 triton==3.9.0 psutil pybase64 starlette msgspec pyzmq aiohttp "
          "multidict yarl propcache aiohappyeyeballs aiosignal frozenlist orjson requests urllib3 idna certifi "
          "charset_normalizer pydantic pydantic_core typing_inspection annotated_types anyio pillow apache-tvm-ffi "
          "(see docs/peers.md)")
#: Pad values of multimodal tokens sit above any vocabulary id, as SGLang's ``pad_value`` hashes do.
PAD_BASE = 1 << 30


def _placeholder_modules() -> dict[str, types.ModuleType]:
    """The two modules the tree imports for names only (see the module docstring)."""
    memory_pool = types.ModuleType("sglang.srt.mem_cache.memory_pool")
    memory_pool.ReqToTokenPool = type("ReqToTokenPool", (), {"__doc__": "Placeholder: a type name only."})
    memory_pool.KVCache = type("KVCache", (), {"__doc__": "Placeholder: the base of BaseSWAKVPool, no members used."})
    metrics = types.ModuleType("sglang.srt.observability.metrics_collector")
    metrics.STAT_LOGGER_ROLE_RADIX_CACHE = "radix_cache"
    metrics.RadixCacheMetricsCollector = type("RadixCacheMetricsCollector", (), {})
    metrics.radix_cache_metric_labels = metrics.resolve_collector_class = None
    return {m.__name__: m for m in (memory_pool, metrics)}


@functools.cache
def _import_sglang():
    """SGLang's radix tree and allocators, loaded without the packages' heavy ``__init__`` files."""
    try:
        loaded = sys.modules.get("sglang")
        if loaded is not None and getattr(loaded, "__path__", None):
            root = list(loaded.__path__)[0]
        else:
            spec = importlib.util.find_spec("sglang")
            if spec is None or spec.origin is None:
                raise ImportError("No module named 'sglang'")
            root = os.path.dirname(spec.origin)
        if not os.path.exists(os.path.join(root, "srt", "mem_cache", "radix_cache.py")):
            raise ImportError(f"{root} has no srt/mem_cache/radix_cache.py")
        for name, sub in (("sglang", ""), ("sglang.srt", "srt")):
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [os.path.join(root, sub)]
                package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
                package.__spec__.submodule_search_locations = package.__path__
                sys.modules[name] = package
        for name, module in _placeholder_modules().items():
            sys.modules.setdefault(name, module)
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as exc:
        raise BackendUnavailableError(f"sglang is not installed or lacks its RadixCache "
                                      f"({type(exc).__name__}: {exc}); install: {RECIPE}") from exc
    import torch
    return types.SimpleNamespace(torch=torch, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
                                 PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator, EvictParams=EvictParams,
                                 InsertParams=InsertParams, MatchPrefixParams=MatchPrefixParams,
                                 CacheInitParams=CacheInitParams, RadixCache=RadixCache, RadixKey=RadixKey)


def _pad(key: Hashable, token_id: int) -> int:
    """The token id SGLang's tree sees at a multimodal position: a pad value from the input's hash. The
    machine's token id there is folded in too, as a real input's hash covers all of it (SGLang's
    placeholder tokens carry one id, so the hash is the whole identity)."""
    return PAD_BASE + stable_hash((key, token_id)) % PAD_BASE


def radix_identity(token_ids: Sequence[int], namespace: Hashable,
                   extra_keys: Sequence[ExtraKey]) -> tuple[list[int], dict, str | None, str | None]:
    """A prompt as SGLang's radix tree keys it: ``(tokens, pads, extra_key, cache_salt)``: the token ids with
    each extra key's position padded (:func:`_pad`), the extra keys by position, a LoRA namespace as the
    ``RadixKey``'s ``extra_key`` (``lora{n}``) and any other namespace as its ``cache_salt`` (``str``)."""
    pads = {pos: key for pos, key in extra_keys}
    tokens = [_pad(pads[pos], t) if pos in pads else t for pos, t in enumerate(token_ids)]
    extra_key = cache_salt = None
    if isinstance(namespace, tuple) and namespace[:1] == ("lora",):
        extra_key = f"lora{namespace[1]}"
    elif namespace is not None:
        cache_salt = str(namespace)
    return tokens, pads, extra_key, cache_salt


def check_radix_tree(tree, locked_nodes, claim, page_of=None) -> None:
    """SGLang's radix tree against the requests that lock it: each node's ``lock_ref`` equals the locked
    nodes (one per live request) at or below it, ``evictable_leaves`` is exactly the unlocked leaves, the
    evictable and protected sizes add up to the tokens in the tree, and each node's slots are handed to
    ``claim(units, who)`` (the caller's one-owner check), as pages (``page_of(slot)``) where given.

    Raises:
        AssertionError: naming the node and the count that disagrees.
    """
    locks: dict[int, int] = {}
    for node in locked_nodes:
        while node is not tree.root_node:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    size, stack = 0, list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        size += len(node.key)
        slots = node.value.tolist()
        claim(slots if page_of is None else {page_of(slot) for slot in slots}, f"tree node {node.id}")
        want = locks.get(id(node), 0)
        assert node.lock_ref == want, f"tree node {node.id}: lock_ref {node.lock_ref}, {want} live requests lock it"
        leaf = not node.children and node.lock_ref == 0
        assert (node in tree.evictable_leaves) == leaf, \
            f"tree node {node.id}: in evictable_leaves {node in tree.evictable_leaves}, an unlocked leaf {leaf}"
        stack.extend(node.children.values())
    assert tree.evictable_size() + tree.protected_size() == size, \
        f"evictable {tree.evictable_size()} + protected {tree.protected_size()} != {size} tokens in the tree"


class _Row:
    """One request's KV row (``req_to_token[req_pool_idx]``) and its tree lock."""

    def __init__(self, tokens: list[int], pads: dict[int, Hashable], extra_key, cache_salt, row: list[int],
                 protected: int, lock) -> None:
        self.tokens, self.pads, self.extra_key, self.cache_salt = tokens, pads, extra_key, cache_salt
        self.row, self.protected, self.lock = row, protected, lock  # protected: cache_protected_len
        self.committed = protected


class SglangRadixCache:
    """One ``RadixCache`` over ``num_blocks`` pages of ``block_size`` token slots."""

    def __init__(self, config: ManagerConfig) -> None:
        s = self.s = _import_sglang()
        if config.window_left is not None:
            raise ValueError(f"window_left={config.window_left}: RadixCache is full attention (SGLang's sliding "
                             f"window lives in SWARadixCache)")
        ps = self.page_size = config.block_size
        size = config.num_blocks * ps
        # slot 0 (page 0) is SGLang's padding slot: the allocator hands out 1 .. size
        if ps == 1:
            self.allocator = s.TokenToKVPoolAllocator(size, s.torch.float32, "cpu", None, need_sort=False)
        else:
            self.allocator = s.PagedTokenToKVPoolAllocator(size, ps, s.torch.float32, "cpu", None, need_sort=False)
        self.tree = s.RadixCache(s.CacheInitParams(disable=False, req_to_token_pool=None,
                                                   token_to_kv_pool_allocator=self.allocator, page_size=ps))
        self.num_pages = config.num_blocks
        self.reserved_blocks = 1
        self.rows: dict[int, _Row] = {}
        self.capabilities = ManagerCapabilities(block_size=ps, extra_keys=True, evict=True, reset=True,
                                                eviction_order="lru-leaves", defers_commit=True)

    # -- helpers --------------------------------------------------------------------------------------
    def _key(self, tokens, extra_key, cache_salt):
        return self.s.RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)

    def _alloc(self, r: _Row, n: int):
        """``n`` new slots continuing the row (``None``: the pool is short even after eviction)."""
        torch = self.s.torch
        for attempt in range(2):
            if self.page_size == 1:
                got = self.allocator.alloc(n)
            else:
                length = len(r.row)
                got = self.allocator.alloc_extend(
                    torch.tensor([length]), torch.tensor([length]), torch.tensor([length + n]),
                    torch.tensor([length + n]), torch.tensor([r.row[-1] if r.row else -1]), n)
            if got is not None or attempt:
                return got
            shortfall = n + self.page_size - self.allocator.available_size()
            self.tree.evict(self.s.EvictParams(num_tokens=max(shortfall, 1)))
        return None

    def _checkpoint(self, r: _Row, up_to: int) -> None:
        """``RadixCache.checkpoint``: insert the written page-aligned prefix; the row takes the tree's slots."""
        s, torch = self.s, self.s.torch
        key = self._key(r.tokens[:up_to], r.extra_key, r.cache_salt).page_aligned(self.page_size)
        if len(key) <= r.protected:
            return
        values = torch.tensor(r.row[:len(key)], dtype=torch.int64)
        prefix_len = self.tree.insert(s.InsertParams(key=key, value=values)).prefix_len
        self.allocator.free_segment(values[r.protected:prefix_len], start_pos=r.protected)
        node = self.tree.match_prefix(s.MatchPrefixParams(key=key)).last_device_node
        indices = self.tree.path_device_indices(node).tolist()
        assert len(indices) == len(key), f"re-match found {len(indices)} of {len(key)} inserted tokens"
        r.row[r.protected:len(indices)] = indices[r.protected:]
        r.protected = len(indices)
        self.tree.unlock(r.lock)
        r.lock = self.tree.lock(node)

    # -- the protocol ---------------------------------------------------------------------------------
    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        tokens, pads, extra_key, cache_salt = radix_identity(token_ids, namespace, extra_keys)
        limit = max(len(tokens) - 1, 0)
        match = self.tree.match_prefix(self.s.MatchPrefixParams(key=self._key(tokens[:limit], extra_key, cache_salt)))
        num_cached = match.device_prefix_len
        row = self.tree.path_device_indices(match.last_device_node)[:num_cached].tolist()
        lock = self.tree.lock(match.last_device_node)
        self.rows[request_id] = _Row(tokens, pads, extra_key, cache_salt, row, num_cached, lock)
        return self.block_table(request_id), num_cached

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        r = self.rows[request_id]
        start = len(r.row)
        got = self._alloc(r, len(token_ids))
        if got is None:
            return None
        slots = got.tolist()
        r.row.extend(slots)
        extra = len(r.row) - len(r.tokens)
        if extra > 0:  # decode tokens (an extra key past the prompt pads its token when it comes)
            for t in list(token_ids)[len(token_ids) - extra:]:
                p = len(r.tokens)
                r.tokens.append(_pad(r.pads[p], t) if p in r.pads else t)
        assert len(r.row) == start + len(token_ids)
        return slots

    def commit(self, request_id: int, num_tokens: int) -> None:
        r = self.rows[request_id]
        r.committed = num_tokens
        self._checkpoint(r, num_tokens)

    def free(self, request_id: int) -> None:
        r = self.rows.pop(request_id)
        self._checkpoint(r, r.committed)
        own = r.row[r.protected:]
        if own:
            self.allocator.free_segment(self.s.torch.tensor(own, dtype=self.s.torch.int64), start_pos=r.protected)
        self.tree.unlock(r.lock)

    def block_table(self, request_id: int) -> list[int]:
        row, ps = self.rows[request_id].row, self.page_size
        return [row[i] // ps for i in range(0, len(row), ps)]

    def holds(self, request_id: int) -> bool:
        return request_id in self.rows

    def counts(self) -> tuple[int, int, int]:
        free = (self.allocator.available_size() + self.tree.evictable_size()) // self.page_size
        return free, self.num_pages - free, self.num_pages

    def evict(self, num_blocks: int) -> None:
        self.tree.evict(self.s.EvictParams(num_tokens=num_blocks * self.page_size))

    def reset(self) -> bool:
        if self.rows:
            return False
        self.tree.reset()
        self.allocator.clear()
        return True

    def self_check(self) -> None:
        ps, tree = self.page_size, self.tree
        owner: dict[int, str] = {}

        def claim(pages, who):
            for page in pages:
                assert page not in owner, f"page {page} is both {owner[page]} and {who}"
                owner[page] = who

        alloc = self.allocator
        free_pages = alloc.free_pages.tolist() + [p for t in getattr(alloc, "staged_pages", []) for p in t.tolist()]
        if getattr(alloc, "release_pages", None) is not None:  # page size 1's pages awaiting a sort
            free_pages += alloc.release_pages.tolist()
        claim(free_pages, "free in the allocator")
        for rid, r in self.rows.items():
            claim({s // ps for s in r.row[r.protected:]}, f"request {rid}'s own")
        check_radix_tree(tree, [r.lock.node for r in self.rows.values()], claim, page_of=lambda slot: slot // ps)
        missing = set(range(1, self.num_pages + 1)) - set(owner)
        assert not missing, f"pages {sorted(missing)} are neither free, in the tree, nor held by a request (leaked)"


def cache_manager(config: ManagerConfig) -> SglangRadixCache:
    """The manager factory (``--pagedkv-impl pagedkv.tools.peers:sglang_radix_cache``).

    Raises:
        BackendUnavailableError: sglang is not installed (the message gives the install command).
        ValueError: ``config.window_left`` is set (RadixCache is full attention).
    """
    return SglangRadixCache(config)


def peer():
    """This module as a suite candidate (``pagedkv.tools.peers:sglang_radix_cache``): its ``cache_manager`` is what
    the suite judges; it has no kernels.

    Raises:
        BackendUnavailableError: the engine is not installed (the message gives the install command).
    """
    _import_sglang()
    return sys.modules[__name__]
