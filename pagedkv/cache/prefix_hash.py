"""Prefix-cache identity: the namespaces (``cache_key``) blocks are cached under and the chained block hash.

A cached full block is found again by ``h_i = hash_fn(h_{i-1}, tokens_i)`` with ``h_{-1}`` derived from
the sequence's ``cache_key`` (vLLM's ``hash_block_tokens`` with its ``extra_keys`` / ``cache_salt``).
These rules live apart from :mod:`pagedkv.cache.allocator` because the cache, the allocator and any
reference model of them must agree on them exactly: what a key may be (:func:`check_cache_key`),
the parent hash of a first block (:func:`root_hash`) and the default hash (:func:`default_block_hash`).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Hashable

import torch

from pagedkv.errors import ArgumentTypeError

HashFn = Callable[[Hashable, tuple[int, ...]], Hashable]


def check_cache_key(name: str, cache_key: object) -> Hashable:
    """``cache_key`` as a prefix-cache namespace: ``None``, a ``str``, an ``int`` or a tuple of them (nested).

    Keys are compared with their type: Python calls ``1``, ``1.0`` and ``True`` equal (and hashes them
    alike), so a float or a bool would silently share a namespace with an int; both are refused.
    ``str`` and ``int`` subclasses (an ``IntEnum`` adapter id, NumPy integers) are normalised to the
    plain ``str`` / ``int`` they hold, so the returned key holds only ``str``, ``int`` and ``tuple``
    values, and no two of those types ever compare equal: two keys name one namespace exactly when
    they are equal with equal types, element by element (tenant salts, LoRA adapter ids and
    multimodal extra keys, as vLLM's ``cache_salt`` and ``extra_keys``, cannot collide by accident).

    Returns:
        The normalised key (``None`` stays ``None``).

    Raises:
        ArgumentTypeError (a ``TypeError``): any other value (a float, a bool, bytes, a list, ...),
            at any depth; the message names ``name`` and the offending element.
    """
    return None if cache_key is None else _typed_key(name, cache_key, ())


def _typed_key(name: str, key: object, path: tuple[int, ...]) -> str | int | tuple:
    where = name + "".join(f"[{i}]" for i in path)
    if isinstance(key, str):
        return str.__str__(key)  # a plain str (a str subclass's own text)
    if isinstance(key, tuple):
        return tuple(_typed_key(name, k, path + (i,)) for i, k in enumerate(key))
    if isinstance(key, numbers.Integral) and not isinstance(key, (bool, torch.Tensor)) and \
            type(key).__name__ not in ("bool_", "bool"):
        return operator.index(key)
    is_bool = isinstance(key, bool) or type(key).__name__ in ("bool_", "bool")
    kind = "a bool" if is_bool else "a float" if isinstance(key, numbers.Real) else type(key).__name__
    why = (": 1, 1.0 and True compare equal in Python, so a float or a bool would share an int's namespace"
           if is_bool or kind == "a float" else "")
    allowed = "a str, an int (not a bool) or a tuple of them" if path else \
        "None, a str, an int (not a bool) or a tuple of them"
    raise ArgumentTypeError(f"{where} must be {allowed}, got {kind} {key!r}{why}")


def root_hash(cache_key: Hashable) -> Hashable:
    """The parent hash of a sequence's first block under ``cache_key`` (``None`` for the default namespace)."""
    return None if cache_key is None else ("pagedkv.cache_key", cache_key)


def default_block_hash(parent_hash: Hashable, token_ids: tuple[int, ...]) -> Hashable:
    """Chained block hash: Python's tuple hash of ``(parent_hash, token_ids)`` (deterministic for ints)."""
    return hash((parent_hash, token_ids))
