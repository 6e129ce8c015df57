"""pagedkv: a paged KV cache whose read paths are proved equal by property-based tests.

The library (one concept a package or module):

- :mod:`pagedkv.cache`: the cache itself: geometry and slot arithmetic (``config``), the block
  allocator with reference counts, prefix caching and LRU eviction (``allocator``), the chained
  prefix hash (``prefix_hash``), per-sequence state (``sequence``), sliding-window release
  (``window``), the K/V pools plus block tables (``paged_cache``), one engine step (``engine``) and
  CPU pools on huge pages (``hugepages``).
- :mod:`pagedkv.validation`: the argument checks every op runs before touching memory.
- :mod:`pagedkv.attention`: dense attention and the fp64 reference, the blockwise algorithm of the
  fused kernel, fp8 arithmetic.
- :mod:`pagedkv.backends`: ``loop``, ``indexed``, ``triton`` and the loader for candidates.
- :mod:`pagedkv.layouts`, :mod:`pagedkv.csr`: pool layouts and FlashInfer's CSR page tables.
- :mod:`pagedkv.errors`: the exception hierarchy.

Around it, never imported by it: :mod:`pagedkv.testing` (the conformance gate),
:mod:`pagedkv.tools` (what uses the gate: mutants, peers, fuzzing, the refactor baseline) and
:mod:`pagedkv.cli` (``python -m pagedkv ...``).

Importing :mod:`pagedkv` imports no torch: the public names below load on first use, so the pytest
plugin (installed with the package) costs nothing in a run that never names a candidate.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("pagedkv")
except _metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

_ERRORS = ("AllocatorError", "ArgumentTypeError", "ArgumentValueError", "BackendError", "BackendUnavailableError",
           "BlockIndexError", "DeviceMismatchError", "DoubleFreeError", "DTypeMismatchError", "InvariantError",
           "OutOfBlocksError", "PagedKVError", "ShapeError", "UnknownBlockError")
_PUBLIC = {
    "BlockAllocator": "pagedkv.cache.allocator", "PagedKVCache": "pagedkv.cache.paged_cache",
    "CacheConfig": "pagedkv.cache.config",
    "available_backends": "pagedkv.backends", "get_backend": "pagedkv.backends", "load_backend": "pagedkv.backends",
    **{name: "pagedkv.errors" for name in _ERRORS},
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
