"""Where validation is applied: the one wrapper every built-in backend op goes through.

A backend module writes each op on *normalised* arguments and decorates it with :func:`backend_op`::

    @backend_op(FEATURES)
    def gather(cache, table, seq_len): ...        # table: int tensor on the cache's device

The decorator returns the public op with the contract's signature (plus ``validate`` and the
keyword-only features): it resolves the validation level, calls the matching ``*_args`` function of
:mod:`pagedkv.validation.calls` (the only place arguments are checked and normalised) and passes the
result on. The op's documentation is the implementation's own note followed by the contract's text
from :class:`pagedkv.backends.contract.PagedKVBackend`, so neither is repeated in the backends.

The implementations receive:

- ``gather(cache, table, seq_len)``, ``scatter(cache, table, values, start)``: ``table`` an ``int32`` /
  ``int64`` tensor on the cache's device (``int64`` unless the level is ``"none"``), ints for lengths;
- ``write_kv(k_cache, v_cache, key, value, w)``: ``w`` a :class:`pagedkv.validation.calls.WriteArgs`;
- ``paged_attention(query, k_cache, v_cache, args)``: ``args`` a :class:`pagedkv.validation.calls.AttentionArgs`
  (``args.num_splits``: the validated split-K count; a backend without split-K ignores it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from pagedkv.backends.contract import EXTRAS, OPS, PagedKVBackend
from pagedkv.validation.calls import attention_args, gather_args, scatter_args, write_kv_args


def _gather(impl: Callable, features: frozenset) -> Callable:
    def gather(cache, block_table, seq_len, validate="full"):
        table, seq_len = gather_args(cache, block_table, seq_len, validate)
        return impl(cache, table, seq_len)
    return gather


def _scatter(impl: Callable, features: frozenset) -> Callable:
    def scatter(cache, block_table, values, start=0, validate="full"):
        table, start, _ = scatter_args(cache, block_table, values, start, validate)
        impl(cache, table, values, start)
    return scatter


def _write_kv(impl: Callable, features: frozenset) -> Callable:
    def write_kv(k_cache, v_cache, key, value, slot_mapping, validate="full", *, k_scale=None, v_scale=None):
        w = write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                          validate=validate, supported=features)
        impl(k_cache, v_cache, key, value, w)
    return write_kv


def _paged_attention(impl: Callable, features: frozenset) -> Callable:
    def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        validate="full", *, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                        k_scale=None, v_scale=None, num_splits=None, return_lse=False):
        args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                              window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                              k_scale=k_scale, v_scale=v_scale, supported=features, num_splits=num_splits,
                              return_lse=return_lse)
        return impl(query, k_cache, v_cache, args)
    return paged_attention


_WRAPPERS = {"gather": _gather, "scatter": _scatter, "write_kv": _write_kv, "paged_attention": _paged_attention}
assert set(_WRAPPERS) == set(OPS)


def contract_doc(op: str) -> str:
    """The contract's documentation of ``op`` (from :class:`PagedKVBackend`) and pagedkv's ``validate``."""
    return inspect.cleandoc(getattr(PagedKVBackend, op).__doc__) + "\n" + EXTRAS


def backend_op(features: frozenset = frozenset()) -> Callable[[Callable], Callable]:
    """Decorator: the public op (named after the implementation: one of the contract's ops) around
    an implementation on normalised arguments, validating at the level its caller asks for.

    Args:
        features: the backend's ``FEATURES``; a call using another optional feature is refused.
    """
    def wrap(impl: Callable) -> Callable:
        if impl.__name__ not in _WRAPPERS:
            raise ValueError(f"backend_op wraps one of {list(OPS)}, not {impl.__name__!r}")
        op = _WRAPPERS[impl.__name__](impl, frozenset(features))
        op.__module__, op.__qualname__ = impl.__module__, impl.__qualname__
        op.__doc__ = inspect.cleandoc(impl.__doc__ or "") + "\n\n" + contract_doc(impl.__name__)
        op.impl = impl  # the implementation on normalised arguments
        return op
    return wrap
