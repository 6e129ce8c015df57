"""pagedkv: a paged KV cache whose read paths are proved equal by property-based tests.

Architecture (one concept a module):

- :mod:`pagedkv.cache.config`: cache geometry and 64-bit slot arithmetic.
- :mod:`pagedkv.errors`: the exception hierarchy.
- :mod:`pagedkv.validation.calls`: argument checks every op runs before touching memory.
- :mod:`pagedkv.cache.allocator`: free list, reference counts, prefix caching, LRU eviction.
- :mod:`pagedkv.cache.paged_cache`: K/V pools plus per-sequence block tables, fork, copy-on-write, slot mapping.
- :mod:`pagedkv.attention.dense`: dense attention and the fp64 reference.
- :mod:`pagedkv.backends`: ``loop``, ``indexed``, ``triton`` and the loader for candidates.
- :mod:`pagedkv.testing.cases.case`: plain-data test cases (JSON round trip), their tensors, the property checks.
- :mod:`pagedkv.cli`: ``python -m pagedkv ...``.
"""

from importlib import metadata as _metadata

from pagedkv.cache.allocator import BlockAllocator
from pagedkv.backends import available_backends, get_backend, load_backend
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.config import CacheConfig
from pagedkv.errors import (AllocatorError, ArgumentTypeError, ArgumentValueError, BackendError,
                            BackendUnavailableError, BlockIndexError, DeviceMismatchError, DoubleFreeError,
                            DTypeMismatchError, InvariantError, OutOfBlocksError, PagedKVError, ShapeError,
                            UnknownBlockError)

try:
    __version__ = _metadata.version("pagedkv")
except _metadata.PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AllocatorError", "ArgumentTypeError", "ArgumentValueError", "BackendError", "BackendUnavailableError",
    "BlockAllocator",
    "BlockIndexError", "CacheConfig", "PagedKVCache",
    "DeviceMismatchError", "DoubleFreeError", "DTypeMismatchError", "InvariantError", "OutOfBlocksError",
    "PagedKVError",
    "ShapeError", "UnknownBlockError", "available_backends", "get_backend", "load_backend",
]
