"""The paged KV cache: geometry, the block allocator, prefix caching, sequences and the K/V pools.

- ``config``: :class:`CacheConfig`, slot arithmetic (``slot = block_id * block_size + offset``);
- ``allocator``: :class:`BlockAllocator`: free list, reference counts, prefix caching, LRU eviction;
- ``prefix_hash``: namespaces (``cache_key``) and the chained block hash;
- ``sequence``: what the cache records per sequence;
- ``window``: sliding-window block release;
- ``paged_cache``: :class:`PagedKVCache`: pools, block tables, fork, copy-on-write, slot mapping;
- ``hybrid``: :class:`HybridKVCache`: KV-cache groups (full attention, sliding window) on one block pool;
- ``engine``: one engine step (admit, reserve, write, commit);
- ``hugepages``: CPU pools on transparent huge pages.

The names below load on first use (this package is imported by the lighter modules of the library).
"""

from __future__ import annotations

import importlib

_PUBLIC = {"CacheConfig": "config", "BlockAllocator": "allocator", "PagedKVCache": "paged_cache",
           "HybridKVCache": "hybrid"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
