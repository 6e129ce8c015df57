"""pagedkv's own :class:`~pagedkv.cache.paged_cache.PagedKVCache` through the cache-manager protocol.

``add_sequence`` is admit, ``append`` reserve, ``mark_written`` commit; the namespace and the extra keys
together are the sequence's ``cache_key`` (a coarser identity than per-position extra keys: requests
with different extra keys never share, which can only miss a hit, never serve a wrong one). The cache
copies K/V on copy-on-write, so it owns the pools. Spec: ``pagedkv.testing.managers.own``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.config import CacheConfig
from pagedkv.errors import OutOfBlocksError
from pagedkv.testing.managers.protocol import ExtraKey, ManagerCapabilities, ManagerConfig


class OwnCacheManager:
    """:class:`PagedKVCache` as a :class:`~.protocol.CacheManager` (fork, window, namespaces, deferred commits)."""

    cache_class = PagedKVCache

    def __init__(self, config: ManagerConfig) -> None:
        cache_config = CacheConfig(num_layers=config.num_layers, num_blocks=config.num_blocks,
                                   block_size=config.block_size, num_kv_heads=config.num_kv_heads,
                                   head_dim=config.head_dim, dtype=torch.float32, window_left=config.window_left,
                                   debug_poison="nan")
        self.cache = self.cache_class(cache_config)
        self.capabilities = ManagerCapabilities(block_size=config.block_size, fork=True, window=config.window_left,
                                                extra_keys=True, defers_commit=True, owns_pools=True)

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k_cache(layer), self.cache.v_cache(layer)

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        key = ("ns", namespace if namespace is not None else (), tuple(extra_keys)) if extra_keys else namespace
        cached = self.cache.add_sequence(request_id, list(token_ids), cache_key=key)
        return self.block_table(request_id)[:cached // self.cache.block_size], cached

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        try:
            return self.cache.append(request_id, list(token_ids)).tolist()
        except OutOfBlocksError:
            return None

    def commit(self, request_id: int, num_tokens: int) -> None:
        self.cache.mark_written(request_id, num_tokens)

    def free(self, request_id: int) -> None:
        self.cache.free(request_id)

    def fork(self, parent_id: int, child_id: int) -> None:
        self.cache.fork(parent_id, child_id)

    def block_table(self, request_id: int) -> list[int]:
        return self.cache.block_table(request_id).tolist()

    def holds(self, request_id: int) -> bool:
        return request_id in self.cache.sequences

    def counts(self) -> tuple[int, int, int]:
        a = self.cache.allocator
        return a.num_free, a.num_blocks - a.num_free, a.num_blocks

    def self_check(self) -> None:
        self.cache.check_invariants()


def cache_manager(config: ManagerConfig) -> OwnCacheManager:
    """The manager factory the suite looks for (``--pagedkv-impl pagedkv.testing.managers.own``)."""
    return OwnCacheManager(config)


def with_cache_class(cache_class: type) -> type[OwnCacheManager]:
    """:class:`OwnCacheManager` over another cache class with ``PagedKVCache``'s API (a planted fault)."""
    return type(f"Own{cache_class.__name__}", (OwnCacheManager,), {"cache_class": cache_class})


#: The windows the suite draws for this manager (``window_left``; ``None``: full attention).
cache_manager_windows = (None, 0, 2, 5)
