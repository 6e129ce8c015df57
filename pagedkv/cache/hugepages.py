"""CPU pools on transparent huge pages.

A read of a fragmented block table at small block sizes touches a new 4 KiB page every row (8 x 128
float32 is one page a token): a TLB miss and a page walk each, two-dimensional under a hypervisor.
On 2 MiB pages the walks all but vanish; on the machine of docs/benchmarks.md the native
block-size-1 gather of 16384 tokens went from 1.12-1.19x a copy to 0.94-1.07x (one process, same
ids). PyTorch offers the same for every allocation of a process (``THP_MEM_ALLOC_ENABLE=1``, read
once at its first allocation); the pools here get it on their own, whatever the rest of the process
does.

:func:`zeros` maps anonymous memory aligned to 2 MiB and asks the kernel for huge pages
(``madvise(MADV_HUGEPAGE)``, which Linux's default THP mode ``madvise`` honours; the kernel falls
back to 4 KiB pages silently when it has none). Elsewhere (not Linux, not the CPU, under
:data:`MIN_BYTES`) it is ``torch.zeros``. :func:`fresh_pages` maps the same kind of memory without the
advice, for a pool that must read as zeros and cost only the pages written.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

#: The x86-64 / arm64 (4 KiB base page) transparent huge page.
HUGE_PAGE_BYTES = 2 * 1024 * 1024
#: Pools from this size on get huge pages: past the reach of a last-level TLB of 4 KiB pages (2048
#: entries, 8 MiB, on current x86 cores) with room to spare. Smaller pools keep torch's allocation:
#: a huge-page fault zeroes 2 MiB at once and may compact memory first (``defrag=madvise``), which a
#: test suite creating many small caches pays again and again for nothing.
MIN_BYTES = 32 * 1024 * 1024


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled contiguous tensor; on a Linux CPU and at :data:`MIN_BYTES` or more, on transparent
    huge pages.

    Args:
        shape: the tensor's shape (ints).
        dtype: any torch dtype (fp8 included).
        device: where it lives; only ``cpu`` gets huge pages.

    Returns:
        A contiguous tensor of ``shape`` and ``dtype``. The huge-page one is backed by an anonymous
        ``mmap`` (zero-filled by the kernel, so no page is touched here), which the tensor keeps
        alive; it is freed with the tensor.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    return _on_mapping(shape, dtype, align=HUGE_PAGE_BYTES, huge=True)


def fresh_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor on a private anonymous ``mmap``: fresh pages that read as zeros and take
    memory only where written, whatever the allocator has freed before (``torch.empty`` may hand back
    a heap block written earlier).

    Args:
        shape: the tensor's shape (ints).
        dtype: any torch dtype (fp8 included).

    Returns:
        A contiguous CPU tensor of ``shape`` and ``dtype``, zero; the mapping is freed with it.
    """
    return _on_mapping(shape, dtype, align=1, huge=False)


def _on_mapping(shape: tuple[int, ...], dtype: torch.dtype, align: int, huge: bool) -> torch.Tensor:
    """``shape`` / ``dtype`` on a new private anonymous mapping, starting at an ``align``-byte boundary,
    advised huge (before any page is touched) when ``huge``."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:  # a mapping cannot be empty
        return torch.zeros(shape, dtype=dtype)
    # private (a shared anonymous map is shmem, whose huge pages are off by default); page aligned,
    # and `align` bytes more than asked for, to align the start
    memory = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(memory)) % align
    if huge:
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: faults then map 2 MiB at a time
        except OSError:  # THP compiled out or turned off: plain pages, same tensor
            pass
    flat = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=start)
    return flat.view(dtype).view(shape)
