"""Row gather ``out[i] = pool[ids[i]]`` and scatter ``pool[ids[i]] = src[i]`` for CPU pools, in C
(``rows.c``).

``index_select`` and ``index_copy_`` copy one row after another, and at block size 1 (a 4 KiB row
for 8 x 128 float32) every pool row is a new page at a random address: each copy waits on DRAM, and
a gather from a fragmented free list costs 1.6-2x a contiguous copy of the same bytes. ``rows.c``
keeps the misses in flight (a prefetch stream a fixed number of cache lines ahead, page walks started
rows ahead) and writes with streaming stores, which brings the gather to about the
copy's time (docs/benchmarks.md has the measurements). It follows the approach of the open PyTorch PR
pytorch/pytorch#192270 for ``index_select``. Large blocks gain too: at block size 256 (1 MiB rows) the
line loop took 0.58-0.59 of a copy where ``torch.cat`` of the block views took 0.86-0.95.

The library is built with the package (an optional extension: without a C compiler the package
installs without it) and loaded through ``ctypes``; :func:`available` says whether it was.
``PAGEDKV_NATIVE_ROWS=0`` turns it off (the indexed backend then uses ``index_select`` and
``index_copy_`` everywhere).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import math
import os

import torch

#: The native loops take calls moving at least this many bytes: there the call's fixed cost (about
#: 4 us of Python and ctypes) is under a tenth of the copy. Below it ``index_select`` (and, for
#: large blocks, ``torch.cat`` of the block views) is as fast or faster.
MIN_BYTES = 1 << 20
#: Bytes a thread must have to move before another one is started (a thread start costs about as
#: much as copying this from cache).
THREAD_BYTES = 256 * 1024
_ID_DTYPES = (torch.int32, torch.int64)
_ABI = 3  # rows.c's pagedkv_rows_abi()
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_int]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled ``rows.c``, or None where the extension was not built or is turned off."""
    if os.environ.get("PAGEDKV_NATIVE_ROWS", "1") == "0":
        return None
    spec = importlib.util.find_spec("pagedkv.backends._rows")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        if lib.pagedkv_rows_abi() != _ABI:  # built from another rows.c: its arguments differ
            return None
    except (OSError, AttributeError):
        return None
    for fn in (lib.pagedkv_gather_rows, lib.pagedkv_scatter_rows):
        fn.restype, fn.argtypes = ctypes.c_int64, _ARGS
    return lib


def available() -> bool:
    """Whether the native row loops are built and enabled (``PAGEDKV_NATIVE_ROWS`` not ``0``)."""
    return _library() is not None


def _call(fn_name: str, pool: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> bool:
    lib = _library()
    if lib is None or not (pool.is_cpu and ids.is_cpu and rows.is_cpu) or ids.dtype not in _ID_DTYPES \
            or not (pool.is_contiguous() and ids.is_contiguous() and rows.is_contiguous()) \
            or rows.dtype != pool.dtype or ids.dim() != 1 or rows.dim() < 1 or rows.shape[0] != ids.shape[0] \
            or rows.shape[1:] != pool.shape[1:]:
        return False
    n = ids.shape[0]
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()  # not stride(0): an empty row may have any
    total = n * row_bytes
    if total < MIN_BYTES:
        return False
    fn = getattr(lib, fn_name)
    args = (pool.data_ptr(), pool.shape[0], row_bytes, ids.data_ptr(), ids.element_size(), n, rows.data_ptr())
    status = fn(*args, max(1, min(torch.get_num_threads(), total // THREAD_BYTES)))
    if status == -2:  # a thread could not be started: redo the whole call on this one
        status = fn(*args, 1)
    return status == -1


def gather_rows(pool: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> bool:
    """Copy ``pool[ids[i]]`` into ``out[i]`` for every ``i``, bit for bit; True when done here.

    Args:
        pool: ``[num_rows, ...]`` CPU tensor, contiguous, any dtype (rows are copied as bytes).
        ids: ``[n]`` ``int32`` or ``int64`` CPU tensor, contiguous: row indices into ``pool``.
        out: ``[n, ...]`` CPU tensor, contiguous, with ``pool``'s dtype and row shape.

    Returns:
        False, having written nothing, when the native loop does not take the call: not built or
        turned off, a non-CPU or non-contiguous tensor, a dtype or row-shape mismatch, under
        :data:`MIN_BYTES` in all (``index_select`` is as fast there), or an id outside
        ``[0, num_rows)`` (the caller's ``index_select`` then raises its own error). True when
        ``out`` holds the rows.

    Uses up to ``torch.get_num_threads()`` POSIX threads, each a contiguous range of rows.
    """
    return _call("pagedkv_gather_rows", pool, ids, out)


def scatter_rows(pool: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy ``src[i]`` into ``pool[ids[i]]`` for every ``i``, bit for bit; True when done here.

    The write twin of :func:`gather_rows`, with the same arguments (``src`` in ``out``'s place) and
    the same reasons to return False having written nothing. ``ids`` must not repeat (the contract
    refuses a slot written twice before this is reached); a repeated id leaves one of its rows there.
    """
    return _call("pagedkv_scatter_rows", pool, ids, src)
