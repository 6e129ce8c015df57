"""Honest candidates in every configuration a backend can declare, for the meta-suite
(``tests/gate/test_declarable_configurations.py``).

:func:`honest` builds a backend that declares a :class:`~pagedkv.backends.capabilities.Capabilities`
(a pool layout: NHD, HND, a view :class:`~pagedkv.layouts.PoolLayout`, a copy pair, a key/value pair;
a page table: padded or CSR; dtypes, block sizes, head dims, features, preconditions) and provides a
chosen subset of the ops. Each op reads its storage through the declared layout and runs pagedkv's
``indexed`` reference op on the logical pools, so a correct gate must judge it green; like a real
kernel it refuses what it does not declare (an undeclared dtype is a ``TypeError``, an undeclared
block size a ``ValueError``) before anything else, so a kit that calls it outside its space fails.
A ``fault`` plants one bug a kernel of that configuration could have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities
from pagedkv.csr import check_csr, csr_to_padded
from pagedkv.layouts import HND, PoolLayout, pool_layouts
from pagedkv.validation.overlap import shares_memory


def _slots_last(shape, dtype, device):
    nb, bs, h, d = shape
    return torch.empty((nb, h, d, bs), dtype=dtype, device=device)


#: A view layout of its own: storage ``[num_blocks, num_kv_heads, head_dim, block_size]`` (slots innermost).
SLOTS_LAST = PoolLayout("slots_last", allocate=_slots_last, logical=lambda s: s.permute(0, 3, 1, 2))
#: A copy pair: each block's slots stored in reverse order (no strided view is declared).
REVERSED_SLOTS = PoolLayout("reversed_slots", to_storage=lambda t: t.flip(1), to_logical=lambda s: s.flip(1))
#: A copy pair in vLLM's packed-key spirit: ``[num_blocks, num_kv_heads, head_dim, block_size]``, contiguous.
PACKED_KEYS = PoolLayout("packed_keys", to_storage=lambda t: t.permute(0, 2, 3, 1).contiguous(),
                         to_logical=lambda s: s.permute(0, 3, 1, 2).contiguous())
#: The key/value pair: packed keys beside head-major values.
PACKED_PAIR = (PACKED_KEYS, HND)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAULTS = ("reads_storage_as_nhd", "ignores_last_page_len", "drops_last_token", "write_kv_swaps_pools")


class _Honest:
    """The ops over the declared layout (see the module docstring); instances are made by :func:`honest`."""

    capabilities: Capabilities
    fault: str | None = None

    # -- the declared space, checked first as a real kernel does ------------------------------------
    def _declared(self, pool: Any, what: str) -> None:
        fp8 = "fp8" in self.capabilities.features and isinstance(pool, torch.Tensor) and pool.element_size() == 1
        if isinstance(pool, torch.Tensor) and pool.is_floating_point() and not fp8 and pool.dtype not in {
                _DTYPES[d] for d in self.capabilities.dtypes}:
            raise TypeError(f"{what}: dtype {pool.dtype} is not supported by this kernel")

    def _logical(self, storage: torch.Tensor, which: int) -> torch.Tensor:
        layout = pool_layouts(self.capabilities.layout)[which]
        if storage.dim() != 4:
            raise ValueError(f"{'k_cache' if which == 0 else 'v_cache'} must be 4-D storage, got {storage.dim()}-D")
        if self.fault == "reads_storage_as_nhd":  # the layout bug: storage read as [blocks, slots, heads, dim]
            return storage if storage.is_contiguous() else storage.contiguous()
        logical = layout.logical(storage) if layout.is_view else layout.to_logical(storage)
        if not self.capabilities.block_sizes.allows(logical.shape[1]):
            raise ValueError(f"block_size {logical.shape[1]} is not supported by this kernel")
        return logical

    def _store(self, storage: torch.Tensor, logical: torch.Tensor, which: int) -> None:
        layout = pool_layouts(self.capabilities.layout)[which]
        if not layout.is_view and self.fault != "reads_storage_as_nhd":
            storage.copy_(layout.to_storage(logical))

    # -- ops -----------------------------------------------------------------------------------------
    def gather(self, cache, block_table, seq_len):
        self._declared(cache, "cache")
        return indexed.gather(self._logical(cache, 0), block_table, seq_len)

    def scatter(self, cache, block_table, values, start):
        self._declared(cache, "cache")
        logical = self._logical(cache, 0)
        if isinstance(values, torch.Tensor) and shares_memory(values, cache):
            raise ValueError("values overlaps the cache it writes")
        indexed.scatter(logical, block_table, values, start)
        self._store(cache, logical, 0)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, **scales):
        self._declared(k_cache, "k_cache")
        if isinstance(v_cache, torch.Tensor) and (v_cache is k_cache or shares_memory(k_cache, v_cache)):
            raise ValueError("v_cache overlaps k_cache")
        for name, x in (("key", key), ("value", value)):
            if isinstance(x, torch.Tensor) and isinstance(v_cache, torch.Tensor) and (
                    shares_memory(x, k_cache) or shares_memory(x, v_cache)):
                raise ValueError(f"{name} overlaps a pool it is written to")
        lk, lv = self._logical(k_cache, 0), self._logical(v_cache, 1) if isinstance(v_cache, torch.Tensor) else v_cache
        if self.fault == "write_kv_swaps_pools":
            key, value = value, key
        indexed.write_kv(lk, lv, key, value, slot_mapping, **scales)
        self._store(k_cache, lk, 0)
        self._store(v_cache, lv, 1)

    def _attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, features):
        self._declared(k_cache, "k_cache")
        lk = self._logical(k_cache, 0)
        lv = self._logical(v_cache, 1) if isinstance(v_cache, torch.Tensor) and v_cache.dim() == 4 else v_cache
        if self.fault == "drops_last_token" and isinstance(seq_lens, torch.Tensor) and seq_lens.numel():
            seq_lens = torch.where(seq_lens > 1, seq_lens - 1, seq_lens)
        return indexed.paged_attention(query, lk, lv, block_tables, seq_lens, query_start_loc, scale, **features)


class _Padded(_Honest):
    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        **features):
        return self._attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, features)


class _Csr(_Honest):
    def paged_attention(self, query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc,
                        scale=None, **features):
        self._declared(k_cache, "k_cache")
        logical = self._logical(k_cache, 0)
        block_size = logical.shape[1]
        check_csr(kv_indptr, kv_indices, kv_last_page_len, block_size, logical.shape[0])  # before the fault below
        if self.fault == "ignores_last_page_len" and isinstance(kv_last_page_len, torch.Tensor):
            kv_last_page_len = torch.where(kv_indptr[1:] > kv_indptr[:-1], block_size, kv_last_page_len)
        tables, seq_lens = csr_to_padded(kv_indptr, kv_indices, kv_last_page_len, block_size)
        return self._attention(query, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, features)


def honest(name: str, caps: Capabilities, ops: tuple[str, ...], fault: str | None = None) -> Any:
    """A backend named ``name`` declaring ``caps`` and providing exactly ``ops`` (``fault``: one of
    :data:`FAULTS` planted); an op not provided is ``None``, as the contract's "does not provide" reads it."""
    base = _Csr if caps.page_table == "csr" else _Padded
    absent = {op: None for op in ("gather", "scatter", "write_kv", "paged_attention") if op not in ops}
    return type(f"Honest_{name}", (base,), {"name": name, "capabilities": caps, "fault": fault, **absent})()


def with_fault(backend: Any, fault: str) -> Any:
    """A copy of ``backend``'s configuration with ``fault`` planted."""
    ops = tuple(op for op in ("gather", "scatter", "write_kv", "paged_attention") if callable(getattr(backend, op,
                                                                                                     None)))
    return honest(f"{backend.name}_{fault}", dataclasses.replace(backend.capabilities), ops, fault)
