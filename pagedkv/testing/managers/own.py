"""pagedkv's own :class:`~pagedkv.cache.paged_cache.PagedKVCache` (one group) and
:class:`~pagedkv.cache.hybrid.HybridKVCache` (full-attention and sliding-window groups on one pool, the
``"gemma3"`` layout) through the cache-manager protocol.

``add_sequence`` is admit, ``append`` reserve, ``mark_written`` commit; the namespace and the extra keys
together are the sequence's ``cache_key`` (a coarser identity than per-position extra keys: requests
with different extra keys never share, which can only miss a hit, never serve a wrong one). The cache
copies K/V on copy-on-write, so it owns the pools. Spec: ``pagedkv.testing.managers.own`` (the factory
picks the cache by ``ManagerConfig.groups``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from pagedkv.cache.config import CacheConfig
from pagedkv.cache.hybrid import HybridKVCache
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import ArgumentTypeError, DoubleFreeError, OutOfBlocksError, ShapeError, UnknownBlockError
from pagedkv.testing.managers.protocol import ONE_GROUP, ExtraKey, ManagerCapabilities, ManagerConfig


def _cache_key(namespace: Hashable, extra_keys: Sequence[ExtraKey]) -> Hashable:
    return ("ns", namespace if namespace is not None else (), tuple(extra_keys)) if extra_keys else namespace


class OwnCacheManager:
    """:class:`PagedKVCache` as a :class:`~.protocol.CacheManager` (fork, window, namespaces, deferred commits)."""

    cache_class = PagedKVCache

    def __init__(self, config: ManagerConfig) -> None:
        self.cache = self.cache_class(self.cache_config(config))
        self.capabilities = ManagerCapabilities(block_size=config.block_size, fork=True, window=config.window_left,
                                                extra_keys=True, prompt_embeds=True, defers_commit=True,
                                                owns_pools=True, misuse=True)

    def cache_config(self, config: ManagerConfig) -> CacheConfig:
        """The cache's configuration: float32 pools on the CPU, poisoned with NaN (a subclass serves a
        kernel's geometry: :mod:`.kernel_property`)."""
        return CacheConfig(num_layers=config.num_layers, num_blocks=config.num_blocks, block_size=config.block_size,
                           num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=torch.float32,
                           window_left=config.window_left, debug_poison="nan")

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.k_cache(layer), self.cache.v_cache(layer)

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        cached = self.cache.add_sequence(request_id, list(token_ids), cache_key=_cache_key(namespace, extra_keys))
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

    def evictable_blocks(self) -> list[int]:
        """Released blocks that still cache a prefix, next evicted first (``ApiRules`` judges the order)."""
        return self.cache.allocator.evictable_blocks()

    def snapshot(self) -> tuple:
        """The allocator, every sequence and the pools' bits (for calls that must change nothing)."""
        from pagedkv.testing.compare import bits

        c = self.cache
        return (c.allocator.snapshot(), {s: (list(q.block_table), list(q.token_ids), q.num_written, q.cache_key)
                                         for s, q in c.sequences.items()}, bits(c.kv).cpu().clone())

    def misuses(self, request_id: int, freed_id: int | None) -> dict:
        """pagedkv's documented refusals (``ManagerCapabilities.misuse``): ``{name: (call, exception types)}``
        about live request ``request_id`` and a freed one (``None``: none freed yet)."""
        c, a = self.cache, self.cache.allocator
        unknown = max([*c.sequences, request_id, freed_id or 0]) + 1000

        def over_release(block: int = max(request_id, 0) % a.num_blocks):
            a.free(block) if a.is_free(block) else a.free_all([block] * (a.ref_count(block) + 1))

        out = {"append_to_unknown_request": (lambda: c.append(unknown, [1]), UnknownBlockError),
               "allocate_a_negative_count": (lambda: a.allocate(-1), ValueError),
               "free_a_block_past_the_pool": (lambda: a.free(a.num_blocks), UnknownBlockError),
               "release_a_block_once_too_often": (over_release, DoubleFreeError),
               "unhashable_cache_key": (lambda: c.add_sequence(unknown, [1, 2], cache_key=["not", "hashable"]),
                                        ArgumentTypeError),
               "float_token": (lambda: c.append(request_id, [1, 2.5]), ArgumentTypeError),
               "commit_past_the_end": (lambda: c.mark_written(request_id, c.seq_len(request_id) + 1), ShapeError),
               "commit_a_negative_count": (lambda: c.mark_written(request_id, -1), ShapeError),
               "slots_past_the_end": (lambda: c.slot_mapping(request_id, 0, c.seq_len(request_id) + 1), ShapeError)}
        if freed_id is not None:
            out["double_free"] = (lambda: c.free(freed_id), DoubleFreeError)
        return out


class OwnHybridManager(OwnCacheManager):
    """:class:`HybridKVCache` as a grouped :class:`~.protocol.CacheManager`: one full-attention group
    and one sliding-window group (each of any number of layers), one block size, one pool.

    Raises:
        ValueError: ``config.groups`` other than one ``"full"`` and one ``"sliding_window"`` group (in
            that order) of ``config.block_size``.
    """

    cache_class = HybridKVCache

    def __init__(self, config: ManagerConfig) -> None:
        kinds = tuple(g.kind for g in config.groups)
        if kinds != ("full", "sliding_window") or any(g.block_size != config.block_size for g in config.groups):
            raise ValueError(f"groups {config.groups!r}: HybridKVCache serves one full and one sliding-window "
                             f"group of block_size {config.block_size}")
        full, sliding = config.groups
        layer_types = ("full_attention",) * full.num_layers + ("sliding_attention",) * sliding.num_layers
        cache_config = CacheConfig(num_layers=len(layer_types), num_blocks=config.num_blocks,
                                   block_size=config.block_size, num_kv_heads=config.num_kv_heads,
                                   head_dim=config.head_dim, dtype=torch.float32, window_left=sliding.window,
                                   debug_poison="nan", layer_types=layer_types)
        self.cache = self.cache_class(cache_config)
        self.groups = tuple(config.groups)
        # the hit promise holds where no extra keys are drawn (a cache_key of all of them is coarser)
        self.capabilities = ManagerCapabilities(block_size=config.block_size, fork=True, hit_promise=True,
                                                defers_commit=True, owns_pools=True, groups=self.groups)

    def kv_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer slot ``layer``: the ``layer``-th layer of every group (``HybridKVCache.kv[layer]``)."""
        return self.cache.kv[layer, 0], self.cache.kv[layer, 1]

    def admit(self, request_id: int, token_ids: Sequence[int], namespace: Hashable = None,
              extra_keys: Sequence[ExtraKey] = ()):
        cached = self.cache.add_sequence(request_id, list(token_ids), cache_key=_cache_key(namespace, extra_keys))
        return tuple(t[:cached // self.cache.block_size] for t in self.block_table(request_id)), cached

    def reserve(self, request_id: int, token_ids: Sequence[int]):
        try:
            return tuple(slots.tolist() for slots in self.cache.append(request_id, list(token_ids)))
        except OutOfBlocksError:
            return None

    def block_table(self, request_id: int) -> tuple[list[int], ...]:
        return tuple(self.cache.block_table(request_id, group=g).tolist() for g in range(len(self.groups)))

    def reference_counts(self) -> dict[int, int]:
        return self.cache.reference_counts()


def cache_manager(config: ManagerConfig) -> OwnCacheManager:
    """The manager factory the suite looks for (``--pagedkv-impl pagedkv.testing.managers.own``):
    :class:`OwnHybridManager` for a hybrid layout, else :class:`OwnCacheManager`."""
    return OwnHybridManager(config) if config.groups else OwnCacheManager(config)


def with_cache_class(cache_class: type, base: type = OwnCacheManager) -> type[OwnCacheManager]:
    """``base`` (:class:`OwnCacheManager`, or :class:`OwnHybridManager` for a ``HybridKVCache``
    subclass) over another cache class with its cache's API (a planted fault)."""
    return type(f"Own{cache_class.__name__}", (base,), {"cache_class": cache_class})


#: The windows the suite draws for this manager (``window_left``; ``None``: full attention).
cache_manager_windows = (None, 0, 2, 5)
#: The layouts it takes (protocol.HYBRID_LAYOUTS): one group, and full + sliding window on one pool.
cache_manager_layouts = (ONE_GROUP, "gemma3")
