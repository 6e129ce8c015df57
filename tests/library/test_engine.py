"""The engine step (pagedkv.cache.engine): admission refused when the first chunk does not fit holds nothing;
a step writes every layer with one write_kv and commits only sequences still live, so a request
freed between reserve and write leaves no prefix-cache entry (C11 through the driver)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache, get_backend
from pagedkv.cache.engine import Step, admit
from pagedkv.testing.cases.case import Geometry, token_kv

GEOMETRY = Geometry(num_blocks=8, block_size=4, num_kv_heads=1, head_dim=4)


def kv_of(tokens_of):
    def kv(seq_id, start, new, layer):
        return token_kv(GEOMETRY, new, start, 0, prefix=tokens_of[seq_id][:start], layer=layer)
    return kv


def test_an_admission_whose_first_chunk_does_not_fit_holds_nothing():
    cache = PagedKVCache(CacheConfig(2, 4, 1, 4))
    assert admit(cache, 0, list(range(20))) is None
    assert cache.allocator.num_free == 2 and not cache.sequences
    assert admit(cache, 1, list(range(20)), first=8) == 0 and cache.seq_len(1) == 0


def test_a_step_writes_every_layer_and_commits_only_live_sequences():
    cache = PagedKVCache(GEOMETRY.cache_config(num_layers=2))
    prompt = list(range(100, 109))
    tokens = {0: prompt, 1: prompt}
    step = Step(cache)
    for seq_id in (0, 1):
        assert admit(cache, seq_id, prompt) == 0
        step.reserve(seq_id, prompt)
    with pytest.raises(ValueError, match="reserved twice"):
        step.reserve(0, [1])
    cache.free(1)  # aborted after its reservation: its rows land in released blocks, nothing is committed
    assert step.write(get_backend("indexed").write_kv, kv_of(tokens)) == [0]
    for layer in (0, 1):
        k, v = token_kv(GEOMETRY, prompt, 0, 0, layer=layer)
        got = get_backend("indexed").gather(cache.k_cache(layer), cache.block_table(0), len(prompt))
        assert torch.equal(got, k)
    assert cache.add_sequence(2, prompt) == 8  # sequence 0's two full blocks were committed


def test_c11_through_the_driver_a_request_dropped_before_the_write_leaves_no_entry():
    cache = PagedKVCache(GEOMETRY.cache_config())
    prompt = list(range(100, 109))
    step = Step(cache)
    assert admit(cache, 0, prompt) == 0
    step.reserve(0, prompt)
    cache.free(0)
    step.drop(0)
    assert step.write(get_backend("indexed").write_kv, kv_of({0: prompt})) == []
    assert cache.add_sequence(1, prompt) == 0


def test_an_fp8_cache_config_stores_the_quantized_bytes_written_through_a_step():
    from pagedkv.attention.fp8 import quantize

    config = CacheConfig(8, 4, 1, 4, kv_cache_dtype="fp8_e4m3")
    assert config.cache_dtype == torch.float8_e4m3fn and config.bytes_per_block == 16
    cache = PagedKVCache(config)
    prompt = list(range(100, 109))
    step = Step(cache)
    assert admit(cache, 0, prompt) == 0
    step.reserve(0, prompt)
    indexed = get_backend("indexed")
    scale = torch.tensor([0.5])

    def write_kv(k_cache, v_cache, key, value, slots):
        indexed.write_kv(k_cache, v_cache, key, value, slots, k_scale=0.5, v_scale=0.5)

    assert step.write(write_kv, kv_of({0: prompt})) == [0]
    k, _ = token_kv(GEOMETRY, prompt, 0, 0)
    stored = indexed.gather(cache.k_cache(), cache.block_table(0), len(prompt))
    assert stored.dtype == torch.float8_e4m3fn
    assert torch.equal(stored.view(torch.uint8), quantize(k, scale, torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        CacheConfig(8, 4, 1, 4, kv_cache_dtype="int8")
