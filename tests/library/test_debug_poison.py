"""``CacheConfig(debug_poison=...)``: new pools, allocated blocks and emptied blocks hold the poison, so a
read of a slot nobody wrote shows in the output; cached K/V is never poisoned."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache, get_backend
from pagedkv.errors import ArgumentValueError, DTypeMismatchError

INDEXED = get_backend("indexed")


def _cache(poison="nan", num_blocks=4, **kw):
    return PagedKVCache(CacheConfig(num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=2, num_layers=2,
                                    debug_poison=poison, **kw))


def _write(cache, seq_id, tokens, k):
    slots = cache.append(seq_id, tokens)
    for layer in range(cache.config.num_layers):
        INDEXED.write_kv(cache.k_cache(layer), cache.v_cache(layer), k, -k, slots)
    cache.mark_written(seq_id)


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_new_pools_hold_the_poison_in_every_layer(poison):
    cache = _cache(poison)
    value = float(poison)
    assert cache.config.poison_value == value or math.isnan(value)
    x = cache.kv.float()
    assert (torch.isnan(x).all() if poison == "nan" else (x == value).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_poison_is_the_pools_largest_value(dtype):
    cache = _cache("max", dtype=dtype)
    biggest = torch.finfo(dtype).max
    assert cache.config.poison_value == biggest
    assert (cache.kv.float() == biggest).all()  # finite, for kernels that need unused slots finite
    cache.add_sequence(0, [])
    _write(cache, 0, [1, 2], torch.randn(2, 1, 2).to(dtype))
    cache.append(0, [3])  # reserved, never written: reads back as the poison, not as a plausible zero
    got = INDEXED.gather(cache.k_cache(1), cache.block_table(0), 3)
    assert (got[2].float() == biggest).all() and torch.isfinite(got).all()


def test_the_finite_poison_fits_fp8_e4m3_which_has_no_infinity():
    cache = _cache("max", kv_cache_dtype="fp8_e4m3")
    assert (cache.kv.float() == torch.finfo(torch.float8_e4m3fn).max).all()


def test_without_a_poison_the_pools_start_as_zeros():
    assert not _cache(None).kv.any()


def test_a_read_of_an_unwritten_slot_shows():
    cache = _cache()
    cache.add_sequence(0, [])
    k = torch.randn(3, 1, 2)
    _write(cache, 0, [1, 2, 3], k)
    cache.append(0, [4])  # reserved, never written
    got = INDEXED.gather(cache.k_cache(1), cache.block_table(0), 4)
    torch.testing.assert_close(got[:3], k)
    assert torch.isnan(got[3]).all()


def test_an_emptied_block_is_poisoned_and_a_reallocated_one_shows_no_old_kv():
    cache = _cache(num_blocks=2)
    cache.add_sequence(0, [])
    _write(cache, 0, [1, 2, 3], torch.randn(3, 1, 2))  # a partial block: caches nothing
    block = cache.block_table(0).tolist()[0]
    cache.free(0)
    assert torch.isnan(cache.kv[:, :, block].float()).all()  # every layer, K and V
    cache.add_sequence(1, [])
    _write(cache, 1, list(range(8)), torch.randn(8, 1, 2))  # two full blocks: both enter the prefix cache
    cached = cache.block_table(1).tolist()
    cache.free(1)
    assert not torch.isnan(cache.kv[:, :, cached].float()).any()  # evictable: kept for a prefix hit
    cache.add_sequence(2, [])
    cache.append(2, [9])  # evicts a cached block: its old K/V must not be readable
    fresh = cache.block_table(2).tolist()[0]
    assert fresh in cached and torch.isnan(cache.kv[:, :, fresh].float()).all()


def test_copy_on_write_copies_the_written_slots_and_the_poison_after_them():
    cache = _cache()
    cache.add_sequence(0, [])
    k = torch.randn(2, 1, 2)
    _write(cache, 0, [1, 2], k)
    cache.fork(0, 1)
    cache.append(1, [3])  # copy-on-write of the shared partial block
    got = INDEXED.gather(cache.k_cache(0), cache.block_table(1), 4)
    torch.testing.assert_close(got[:2], k)
    assert torch.isnan(got[2:]).all()


def test_paged_attention_over_an_unwritten_slot_is_nan():
    cache = _cache()
    cache.add_sequence(0, [])
    _write(cache, 0, [1, 2], torch.randn(2, 1, 2))
    cache.append(0, [3])  # the step's token, not written: an engine bug the poison shows
    out = INDEXED.paged_attention(torch.randn(1, 1, 2), cache.k_cache(), cache.v_cache(), cache.block_tables([0]),
                                  cache.seq_lens([0]), torch.tensor([0, 1], dtype=torch.int32))
    assert torch.isnan(out).all()


def test_fp8_pools_take_nan_but_e4m3_has_no_infinity():
    assert torch.isnan(_cache("nan", kv_cache_dtype="fp8_e4m3").kv.float()).all()
    assert torch.isinf(_cache("-inf", kv_cache_dtype="fp8_e5m2").kv.float()).all()
    with pytest.raises(DTypeMismatchError, match="debug_poison 'inf'.*float8_e4m3fn"):
        _cache("inf", kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("bad", ["zero", "NaN", 1.0])
def test_an_unknown_poison_is_refused(bad):
    with pytest.raises(ArgumentValueError, match="debug_poison"):
        _cache(bad)
