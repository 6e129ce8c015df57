"""The indexed gather's large-block paths on the CPU (one ``torch.cat`` of block views for blocks of at
least ``LARGE_BLOCK_BYTES``; the native row gather from 1 MiB of whole blocks, where it is built) return
exactly what each slot holds, like every other path. The suite's drawn pools are far smaller than
that, so the paths are pinned here, each with the native loops on and off."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backends import get_backend
from pagedkv.backends import indexed, native_rows
from pagedkv.testing.compare import assert_bitwise_equal

INDEXED = get_backend("indexed")


def _definition(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    bs = cache.shape[1]
    rows = [cache[int(table[p // bs]), p % bs] for p in range(seq_len)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


def test_the_large_block_path_is_taken_for_float32_blocks_of_64_tokens_of_8x128():
    assert torch.empty(64, 8, 128).nbytes >= indexed.LARGE_BLOCK_BYTES > torch.empty(16, 8, 128).nbytes


@pytest.mark.parametrize("native", [True, False], ids=["native", "cat"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [64, 256, 512])
def test_large_blocks_gather_exactly_what_each_slot_holds(dtype, block_size, native, monkeypatch):
    if not native:
        monkeypatch.setattr(native_rows, "available", lambda: False)
    heads, dim = 8, 128
    gen = torch.Generator().manual_seed(block_size)
    cache = torch.randn(7, block_size, heads, dim, generator=gen).to(dtype)
    table = torch.randperm(7, generator=gen)[:4]
    for seq_len in (0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size - 5, 4 * block_size):
        out = INDEXED.gather(cache, table, seq_len)
        assert out.is_contiguous() and out.shape == (seq_len, heads, dim)
        want = _definition(cache, table, seq_len)
        assert_bitwise_equal(out.view(torch.uint8) if dtype.itemsize == 1 else out,
                             want.view(torch.uint8) if dtype.itemsize == 1 else want, f"seq_len {seq_len}: ")


def test_a_strided_pool_of_large_blocks_takes_the_indexed_path_and_agrees():
    kv = torch.randn(6, 2, 64, 8, 128)
    table = torch.tensor([5, 0, 3])
    for seq_len in (64, 130, 192):
        assert_bitwise_equal(INDEXED.gather(kv[:, 1], table, seq_len), _definition(kv[:, 1], table, seq_len))
