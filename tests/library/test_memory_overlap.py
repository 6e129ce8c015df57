"""Writes refuse inputs that overlap the pool they write: ``shares_memory`` never misses a shared byte."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from pagedkv.validation.calls import shares_memory


def bytes_of(x: torch.Tensor) -> set[int]:
    """Every byte address ``x`` can touch (brute force, for small views)."""
    out = set()
    for pos in itertools.product(*(range(n) for n in x.shape)):
        start = x.data_ptr() + sum(p * s for p, s in zip(pos, x.stride())) * x.element_size()
        out.update(range(start, start + x.element_size()))
    return out


@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=4), strides=st.lists(st.integers(0, 12), min_size=4,
       max_size=4), offsets=st.tuples(st.integers(0, 60), st.integers(0, 60)), same_layout=st.booleans())
def test_shares_memory_never_misses_a_shared_byte(shape, strides, offsets, same_layout):
    buffer = torch.zeros(512)
    strides = strides[: len(shape)]
    a = buffer.as_strided(shape, strides, offsets[0])
    b = buffer.as_strided(shape, strides if same_layout else list(reversed(strides)), offsets[1])
    if bytes_of(a) & bytes_of(b):
        assert shares_memory(a, b)


def test_kv_views_of_one_interleaved_pool_do_not_overlap():
    kv = torch.zeros(4, 2, 3, 2, 2)
    assert not shares_memory(kv[:, 0], kv[:, 1])
    padded = torch.zeros(5, 3, 1, 2)  # a pool with one padding slot per block, V one block later
    k = padded[:4, :2]
    v = padded.view(-1).as_strided(k.shape, k.stride(), 2 * 1 * 2)
    assert shares_memory(k, v) and bool(bytes_of(k) & bytes_of(v))


def test_views_reaching_one_buffer_through_different_storages_overlap():
    array = np.arange(8, dtype=np.float32)
    cache = torch.from_numpy(array).view(4, 2, 1, 1)
    values = torch.from_numpy(array[1:5]).view(4, 1, 1)
    assert shares_memory(values, cache)
    from pagedkv import get_backend

    with pytest.raises(ValueError, match="values overlaps cache"):
        get_backend("indexed").scatter(cache, [0, 1, 2], values, start=2)
    assert array.tolist() == list(range(8))
