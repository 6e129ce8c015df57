"""CPU pools on transparent huge pages (pagedkv/cache/hugepages.py): what they hold, how they are mapped,
and that the cache's pools are them."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache

from pagedkv.cache import hugepages

linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="transparent huge pages are a Linux feature")


def _mapping_flags(address: int) -> list[str] | None:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (None: no mapping does)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_zeros_is_a_contiguous_zero_tensor_of_the_shape_and_dtype(dtype):
    for shape in [(3, 5), (9, 1, 8, 128), (2, 2, 600, 16, 8, 64)]:  # under and over hugepages.MIN_BYTES
        x = hugepages.zeros(shape, dtype)
        assert x.shape == shape and x.dtype == dtype and x.is_contiguous() and x.device.type == "cpu"
        assert torch.count_nonzero(x.view(torch.uint8) if dtype.itemsize == 1 else x) == 0
        x.view(torch.uint8).fill_(0xAB)  # writable everywhere
        assert torch.all(x.view(torch.uint8) == 0xAB)


@linux_thp
def test_a_pool_of_min_bytes_or_more_starts_on_a_huge_page_boundary_and_is_advised_huge():
    x = hugepages.zeros((512, 16, 8, 128), torch.float32)  # 32 MiB
    assert x.nbytes >= hugepages.MIN_BYTES and x.data_ptr() % hugepages.HUGE_PAGE_BYTES == 0
    assert "hg" in _mapping_flags(x.data_ptr())  # madvise(MADV_HUGEPAGE) was applied to its mapping
    small = hugepages.zeros((64, 16, 8, 128), torch.float32)  # 4 MiB: torch's own allocation
    flags = _mapping_flags(small.data_ptr())
    assert flags is None or "hg" not in flags


@linux_thp
def test_the_mapping_is_freed_with_the_tensor():
    x = hugepages.zeros((512, 16, 8, 128), torch.float32)
    view = x[3:7]  # a view keeps it alive
    address = x.data_ptr()
    del x
    gc.collect()
    assert _mapping_flags(address) is not None and float(view.sum()) == 0.0
    del view
    gc.collect()
    assert _mapping_flags(address) is None


@linux_thp
def test_the_cache_allocates_its_cpu_pools_on_huge_pages_and_fills_the_debug_poison():
    config = CacheConfig(num_blocks=256, block_size=16, num_kv_heads=8, head_dim=128, num_layers=2,
                         dtype=torch.float32, device="cpu")  # 64 MiB
    cache = PagedKVCache(config)
    assert "hg" in _mapping_flags(cache.kv.data_ptr())
    assert torch.count_nonzero(cache.kv) == 0
    poisoned = PagedKVCache(CacheConfig(num_blocks=256, block_size=16, num_kv_heads=8, head_dim=128, num_layers=2,
                                        dtype=torch.float32, device="cpu", debug_poison="nan"))
    assert torch.isnan(poisoned.kv).all()
