"""The suite's side of CSR page tables: a drawn case's padded tables as FlashInfer metadata, the call of
a candidate that takes it, and the faults of CSR metadata that the invalid-input properties inject.

A candidate declares that its ``paged_attention`` takes CSR page metadata instead of padded block tables
with ``page_table = "csr"`` (on its ``capabilities``, or as a backend attribute), and is then called as::

    paged_attention(query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc, scale=None,
                    **features)

with ``kv_indptr int32 [batch + 1]``, ``kv_indices int32 [nnz_pages]``, ``kv_last_page_len int32 [batch]``
(:mod:`pagedkv.csr`, FlashInfer's convention; ``page_size`` is the pools' ``block_size``). Every other op
keeps its padded signature. :func:`call_paged_attention` is the one place that converts: the same
sequences, fragmentation, sharing and empty sequences as the padded case, and no ``-1`` in any row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.csr import CsrPageTable, padded_to_csr

__all__ = ["CSR_FAULTS", "CsrFault", "call_paged_attention", "csr_from_case", "page_table_format"]


def page_table_format(backend: Any) -> str:
    """``"csr"`` or ``"padded"``: the backend's declared ``page_table``
    (:func:`pagedkv.backends.capabilities.capabilities_of`, which also reads a ``page_table`` attribute).

    Raises:
        ValueError: a declared format other than ``padded`` / ``csr``.
    """
    from pagedkv.backends.capabilities import capabilities_of

    return capabilities_of(backend).page_table


def csr_from_case(case: Any, device: str | torch.device = "cpu") -> CsrPageTable:
    """A :class:`~pagedkv.testing.cases.Case`'s tables as CSR metadata (``page_size = block_size``): each
    sequence's ``ceil(seq_len / block_size)`` read entries, in order; padding dropped."""
    return padded_to_csr(case.block_tables(device), case.seq_lens(device), case.geometry.block_size)


def call_paged_attention(backend: Any, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float | None = None, **features: Any) -> torch.Tensor:
    """``backend.paged_attention`` with the contract's padded arguments, converted to CSR
    (:func:`pagedkv.csr.padded_to_csr`) when the backend declares ``page_table = "csr"``. ``k_cache`` and
    ``v_cache`` are the *logical* pools ``[num_blocks, block_size, num_kv_heads, head_dim]``: ``page_size``
    is their ``block_size`` whatever the declared storage layout (a head-major pool's storage dim 1 is
    ``num_kv_heads``), and ``backend`` converts them to its storage (:class:`pagedkv.testing.space.DeclaredLayout`).

    Raises:
        What :func:`pagedkv.csr.padded_to_csr` raises for malformed padded metadata (a CSR candidate's
        own faults are injected on CSR metadata: :data:`CSR_FAULTS`), then whatever the backend raises.
    """
    if page_table_format(backend) == "padded":
        return backend.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       **features)
    csr = padded_to_csr(block_tables, seq_lens, k_cache.shape[1])
    return backend.paged_attention(query, k_cache, v_cache, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len,
                                   query_start_loc, scale, **features)


@dataclass(frozen=True)
class CsrFault:
    """One way to break valid CSR metadata, the builtin error the contract requires for it and the argument
    its message must name (a candidate is judged on these, as for the padded-table faults; pagedkv's own
    :func:`pagedkv.csr.check_csr` raises subclasses of them)."""

    name: str
    error: type[Exception]
    argument: str
    applies: Callable[[CsrPageTable], bool]
    breaks: Callable[[CsrPageTable, int], CsrPageTable]  # (valid metadata, num_pages) -> broken copy


def _with(csr: CsrPageTable, **tensors: torch.Tensor) -> CsrPageTable:
    fields = {"kv_indptr": csr.kv_indptr, "kv_indices": csr.kv_indices, "kv_last_page_len": csr.kv_last_page_len}
    fields.update(tensors)
    return CsrPageTable(page_size=csr.page_size, **fields)


def _rows_with_pages(csr: CsrPageTable) -> torch.Tensor:
    return torch.nonzero(csr.kv_indptr[1:] > csr.kv_indptr[:-1]).flatten()


def _set(t: torch.Tensor, i: int, v: int) -> torch.Tensor:
    out = t.clone()
    out[i] = v
    return out


def _swap_down(csr: CsrPageTable) -> CsrPageTable:
    """``kv_indptr[b + 1] < kv_indptr[b]`` at the first row with pages (its end moved before its start)."""
    b = int(_rows_with_pages(csr)[0])
    return _with(csr, kv_indptr=_set(csr.kv_indptr, b + 1, int(csr.kv_indptr[b]) - 1))


#: The faults of CSR metadata (the padded table's own are in :mod:`pagedkv.testing.cases.invalid_call`).
CSR_FAULTS: tuple[CsrFault, ...] = (
    CsrFault("kv_indptr not starting at 0", ValueError, "kv_indptr", lambda c: True,
             lambda c, n: _with(c, kv_indptr=c.kv_indptr + 1)),
    CsrFault("kv_indptr not monotone", ValueError, "kv_indptr", lambda c: _rows_with_pages(c).numel() > 0,
             lambda c, n: _swap_down(c)),
    CsrFault("kv_last_page_len 0 for a row with pages", ValueError, "kv_last_page_len",
             lambda c: _rows_with_pages(c).numel() > 0,
             lambda c, n: _with(c, kv_last_page_len=_set(c.kv_last_page_len, int(_rows_with_pages(c)[0]), 0))),
    CsrFault("kv_last_page_len past page_size", ValueError, "kv_last_page_len",
             lambda c: _rows_with_pages(c).numel() > 0,
             lambda c, n: _with(c, kv_last_page_len=_set(c.kv_last_page_len, int(_rows_with_pages(c)[0]),
                                                         c.page_size + 1))),
    CsrFault("kv_indices past the pool", IndexError, "kv_indices", lambda c: c.kv_indices.numel() > 0,
             lambda c, n: _with(c, kv_indices=_set(c.kv_indices, c.kv_indices.numel() - 1, n))),
    CsrFault("a row longer than its pages (kv_indptr[-1] past kv_indices)", ValueError, "kv_indptr",
             lambda c: c.batch > 0,
             lambda c, n: _with(c, kv_indptr=_set(c.kv_indptr, c.batch, int(c.kv_indptr[-1]) + 1))),
    CsrFault("kv_indptr not [batch + 1]", ValueError, "kv_indptr", lambda c: True,
             lambda c, n: _with(c, kv_indptr=c.kv_indptr[:-1])),
)
