"""Prefix-cache namespaces compare with their type: ``1``, ``1.0`` and ``True`` are never one namespace
(the last two are refused), and a namespace never shares blocks with another."""

from __future__ import annotations

import enum

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.cache.allocator import check_cache_key
from pagedkv.errors import ArgumentTypeError

KEY = st.recursive(st.none() | st.text(max_size=3) | st.integers(-3, 3),
                   lambda inner: st.tuples(inner) | st.tuples(inner, inner), max_leaves=4)


def _committed(cache, seq_id, prompt, key):
    cached = cache.add_sequence(seq_id, prompt, cache_key=key)
    cache.append(seq_id, prompt[cached:])
    cache.mark_written(seq_id)
    return cached


def _key(x):
    """A generated key, None only at the top (a tuple holds str and int only)."""
    if isinstance(x, tuple):
        return tuple(0 if y is None else _key(y) for y in x)
    return x


@pytest.mark.parametrize("bad", [1.0, True, False, (1, True), ("lora", 1.0), [1], {"a": 1}, b"salt", np.bool_(True),
                                 np.float64(1.0), (None,)])
def test_floats_bools_and_other_kinds_are_refused_naming_cache_key(bad):
    cache = PagedKVCache(CacheConfig(num_blocks=4, block_size=2, num_kv_heads=1, head_dim=1))
    with pytest.raises(ArgumentTypeError, match="cache_key") as err:
        cache.add_sequence(0, [1, 2, 3], cache_key=bad)
    assert isinstance(err.value, TypeError)
    assert not cache.sequences and cache.allocator.num_used == 0  # nothing changed
    with pytest.raises(TypeError, match="cache_key"):
        cache.allocator.find_cached_prefix([1, 2], bad)


def test_one_and_true_and_one_point_zero_never_share():
    cache = PagedKVCache(CacheConfig(num_blocks=16, block_size=2, num_kv_heads=1, head_dim=1),
                         hash_fn=lambda parent, tokens: 0)  # every hash collides: only the key tells them apart
    p = [1, 2, 3, 4, 5]
    assert _committed(cache, 0, p, 1) == 0
    assert _committed(cache, 1, p, "1") == 0  # same text, another type
    assert _committed(cache, 2, p, (1,)) == 0
    assert _committed(cache, 3, p, 1) == 4  # the same key finds its own blocks
    with pytest.raises(ArgumentTypeError, match="bool"):
        cache.add_sequence(4, p, cache_key=True)
    with pytest.raises(ArgumentTypeError, match="float"):
        cache.add_sequence(4, p, cache_key=1.0)


def test_int_and_str_subclasses_name_the_plain_value():
    class Adapter(enum.IntEnum):
        A = 7

    assert check_cache_key("k", Adapter.A) == 7 and type(check_cache_key("k", Adapter.A)) is int
    assert type(check_cache_key("k", np.int64(7))) is int
    assert check_cache_key("k", ("lora", Adapter.A)) == ("lora", 7)
    cache = PagedKVCache(CacheConfig(num_blocks=8, block_size=2, num_kv_heads=1, head_dim=1))
    _committed(cache, 0, [1, 2, 3], Adapter.A)
    assert _committed(cache, 1, [1, 2, 3], 7) == 2 and cache.cache_key(1) == 7


@given(a=KEY.map(_key), b=KEY.map(_key))
def test_two_keys_share_blocks_exactly_when_equal_with_their_types(a, b):
    cache = PagedKVCache(CacheConfig(num_blocks=8, block_size=2, num_kv_heads=1, head_dim=1),
                         hash_fn=lambda parent, tokens: 0)
    p = [1, 2, 3]
    _committed(cache, 0, p, a)
    same = type(a) is type(b) and repr(a) == repr(b)  # typed equality, element by element
    assert (_committed(cache, 1, p, b) == 2) == same
