"""How ``python -m pagedkv bench`` times a candidate in the storage and page tables it declares.

A candidate's ``capabilities`` (:mod:`pagedkv.backends.capabilities`) may declare a pool layout other
than the contract's NHD (``"HND"``, a :class:`~pagedkv.layouts.PoolLayout`, a ``(key, value)`` pair:
:mod:`pagedkv.layouts`) and FlashInfer's CSR page tables (``page_table="csr"``, :mod:`pagedkv.csr`).
The sweep builds every input set once, in logical NHD pools with padded block tables, so the built-in
backends and the copy bounds move the same bytes; before anything is timed, :func:`declared_sets`
gives such a candidate its own copy of the sets, each pool converted to the declared storage and, for
``paged_attention``, the padded tables converted to ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len``. The timed call (:func:`csr_attention` for a CSR candidate) converts nothing.
:func:`outside_declared` says when a sweep point lies outside the candidate's declared space
(``Capabilities.rejects``): the point is reported as skipped, never timed.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.backends.capabilities import Capabilities
from pagedkv.csr import padded_to_csr
from pagedkv.layouts import NHD, PoolLayout

#: The pool entries of each bench op's input set, with the layout that stores them (0 keys, 1 values);
#: ``gather``'s and ``scatter``'s one ``cache`` is a key pool, as the conformance suite hands it.
POOLS = {"gather": (("cache", 0),), "scatter": (("cache", 0),), "write_kv": (("k_cache", 0), ("v_cache", 1)),
         "attention": (("k_cache", 0), ("v_cache", 1))}


def converts(op: str, caps: Capabilities) -> bool:
    """Whether ``op``'s input sets need converting for a candidate declaring ``caps``."""
    return caps.pool_layouts != (NHD, NHD) or (op == "attention" and caps.page_table == "csr")


def to_storage(layout: PoolLayout, logical: torch.Tensor, pool_memory: str = "torch") -> torch.Tensor:
    """A new tensor in ``layout``'s storage holding the logical pool ``logical``
    (``[num_blocks, block_size, num_kv_heads, head_dim]``), same dtype and device.

    With ``pool_memory="cache"`` a view layout whose storage is contiguous is allocated as
    :class:`pagedkv.PagedKVCache` allocates its pools (:func:`pagedkv.cache.hugepages.zeros`), the memory
    the built-ins' pools and the copy bound's source live in; otherwise ``layout`` allocates it
    (``PoolLayout.copy_to_storage``).

    Raises:
        Whatever the layout's own ``allocate`` / ``to_storage`` raise.
    """
    if layout == NHD:
        return logical
    if pool_memory == "cache" and layout.is_view:
        try:
            meta = layout.allocate(tuple(logical.shape), logical.dtype, "meta")
        except Exception:  # noqa: BLE001 - a user's allocate that cannot run on meta: its own memory
            meta = None
        if meta is not None and meta.is_contiguous() and meta.dtype == logical.dtype:
            from pagedkv.cache import hugepages

            storage = hugepages.zeros(tuple(meta.shape), logical.dtype, logical.device)
            view = layout.logical(storage)
            if tuple(view.shape) == tuple(logical.shape):
                view.copy_(logical)
                return storage
    return layout.copy_to_storage(logical)


def declared_sets(op: str, sets: list[dict], caps: Capabilities, pool_memory: str = "torch") -> list[dict]:
    """The input sets of ``op`` as a candidate declaring ``caps`` takes them: ``sets`` themselves when it
    declares NHD pools (and padded tables), else new dicts sharing every other tensor, with

    - each pool entry (``cache``; ``k_cache`` / ``v_cache``) replaced by a copy in the declared storage
      (:func:`to_storage`; the key layout for ``cache`` and ``k_cache``, the value layout for ``v_cache``);
    - for ``attention`` under ``page_table="csr"``: ``kv_indptr int32 [batch + 1]``, ``kv_indices int32
      [nnz_pages]`` and ``kv_last_page_len int32 [batch]`` added, from the set's ``block_tables`` /
      ``seq_lens`` with ``page_size`` = the logical pool's ``block_size`` (:func:`pagedkv.csr.padded_to_csr`).

    Raises:
        Whatever :func:`to_storage` or :func:`pagedkv.csr.padded_to_csr` raise.
    """
    if not converts(op, caps):
        return sets
    layouts = caps.pool_layouts
    csr = op == "attention" and caps.page_table == "csr"
    out = []
    for logical in sets:
        s = dict(logical)
        for key, which in POOLS[op]:
            s[key] = to_storage(layouts[which], logical[key], pool_memory)
        if csr:
            table = padded_to_csr(logical["block_tables"], logical["seq_lens"], logical["k_cache"].shape[1])
            s.update(kv_indptr=table.kv_indptr, kv_indices=table.kv_indices, kv_last_page_len=table.kv_last_page_len)
        out.append(s)
    return out


def csr_attention(paged_attention: Callable, **kw: Any) -> Callable[[dict], Any]:
    """``fn(set)`` calling a CSR candidate's ``paged_attention(query, k_cache, v_cache, kv_indptr,
    kv_indices, kv_last_page_len, query_start_loc, scale=None)`` (FlashInfer's page metadata, the
    signature of :mod:`pagedkv.testing.cases.csr`) on a set made by :func:`declared_sets`."""
    return lambda s: paged_attention(s["query"], s["k_cache"], s["v_cache"], s["kv_indptr"], s["kv_indices"],
                                     s["kv_last_page_len"], s["query_start_loc"], None, **kw)


def outside_declared(caps: Capabilities, *, block_size: int, num_kv_heads: int, head_dim: int, dtype: str,
                     num_blocks: int, gqa_group: int | None = None) -> str | None:
    """Why a sweep point lies outside the declared space (``Capabilities.rejects``: block size, head dim,
    num_kv_heads, GQA group, dtype, ``max_pool_bytes`` of a ``num_blocks`` pool), or ``None``.

    ``gqa_group``: query heads per kv head of the point (attention); ``None`` for the data ops, which
    have no query, so the declared GQA groups do not restrict them.
    """
    group = gqa_group if gqa_group is not None else caps.gqa_groups.choose([1])[0]
    point = SimpleNamespace(block_size=block_size, head_dim=head_dim, num_kv_heads=num_kv_heads,
                            num_queries_per_kv=group, dtype=dtype, num_blocks=num_blocks)
    return caps.rejects(point)
