"""CSR page tables (FlashInfer's paged-KV layout) and their conversion to and from padded block tables.

pagedkv's contract describes pages the vLLM / flash-attention way, one padded row per sequence
(``block_tables int32 [batch, max_blocks]`` plus ``seq_lens int32 [batch]``). FlashInfer (and SGLang's
backends built on it) describe the same pages compressed, as in its ``BatchDecodeWithPagedKVCacheWrapper.plan``
/ ``BatchPrefillWithPagedKVCacheWrapper.plan``:

- ``kv_indptr``: ``int32 [batch + 1]``, ``kv_indptr[0] == 0``, non-decreasing; sequence ``b`` owns the
  ``kv_indptr[b + 1] - kv_indptr[b]`` pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, in logical order;
- ``kv_indices``: ``int32 [nnz_pages]`` with ``nnz_pages == kv_indptr[-1]``: physical page ids in
  ``[0, num_pages)`` (a page may appear in several rows, or twice in one row, for reads);
- ``kv_last_page_len``: ``int32 [batch]``, the tokens held by each sequence's last page: ``1 ..
  page_size`` for a sequence with pages, ``0`` for one without.

So ``seq_len[b] = max(num_pages_b - 1, 0) * page_size + kv_last_page_len[b]`` (FlashInfer's
``flashinfer.page.get_seq_lens``). Page size 1 is the token-granular case (SGLang's Triton backend over
its ``req_to_token`` pool): every ``kv_last_page_len`` is 1 (0 for an empty sequence) and
``kv_indices`` lists token slots. A page here is a pagedkv block: ``page_size == block_size``.

:func:`padded_to_csr` and :func:`csr_to_padded` convert (a round trip keeps every read entry and
every length); :func:`check_csr` validates CSR metadata the way :mod:`pagedkv.validation.calls` validates
padded tables, raising pagedkv's errors with the offending argument named, before anything is read
by a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.validation.arguments import check_ids_in_range, check_int_tensor, check_tensor
from pagedkv.cache.config import blocks_needed
from pagedkv.errors import ArgumentTypeError, DeviceMismatchError, ShapeError

__all__ = ["CsrPageTable", "check_csr", "csr_seq_lens", "csr_to_padded", "padded_to_csr"]


@dataclass(frozen=True)
class CsrPageTable:
    """FlashInfer-style page metadata of one batch (all ``int32``, on one device).

    Attributes:
        kv_indptr: ``int32 [batch + 1]``, row offsets into ``kv_indices``.
        kv_indices: ``int32 [nnz_pages]``, physical page ids, each row in logical order.
        kv_last_page_len: ``int32 [batch]``, tokens in each row's last page (``0`` for a row without pages).
        page_size: tokens per page (pagedkv's ``block_size``).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int

    @property
    def batch(self) -> int:
        return self.kv_last_page_len.shape[0]

    def seq_lens(self) -> torch.Tensor:
        """``int32 [batch]``: each row's token count (:func:`csr_seq_lens`)."""
        return csr_seq_lens(self.kv_indptr, self.kv_last_page_len, self.page_size)


def _page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise ArgumentTypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise ShapeError(f"page_size must be >= 1, got {page_size}")
    return page_size


def csr_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """``int32 [batch]``: ``max(pages_b - 1, 0) * page_size + kv_last_page_len[b]`` (FlashInfer's
    ``get_seq_lens``), on ``kv_indptr``'s device. No checks: run :func:`check_csr` first."""
    pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    return ((pages - 1).clamp(min=0) * page_size + kv_last_page_len.to(torch.int64)).to(torch.int32)


def padded_to_csr(block_tables: object, seq_lens: object, page_size: int) -> CsrPageTable:
    """Padded block tables -> FlashInfer's CSR page metadata, on the tables' device.

    Row ``b`` keeps its first ``ceil(seq_lens[b] / page_size)`` entries (what the contract reads); the
    padding past them (``-1`` or anything else) is dropped, so the result holds no ``-1``.

    Args:
        block_tables: ``int32`` / ``int64 [batch, max_blocks]``.
        seq_lens: ``int32`` / ``int64 [batch]``, tokens per sequence (``>= 0``).
        page_size: tokens per page (pagedkv's ``block_size``), ``>= 1``.

    Returns:
        :class:`CsrPageTable` (``int32`` tensors on ``block_tables.device``).

    Raises:
        ArgumentTypeError: a non-tensor argument or a non-int ``page_size``.
        DTypeMismatchError: a table or length dtype other than ``int32`` / ``int64``.
        ShapeError: wrong ranks, ``seq_lens`` not ``[batch]``, a negative length, ``page_size < 1``, or
            a row with fewer than ``ceil(seq_len / page_size)`` entries.
        DeviceMismatchError: ``seq_lens`` on another device than ``block_tables``.
    """
    page_size = _page_size(page_size)
    block_tables = check_tensor("block_tables", block_tables, 2)
    seq_lens = check_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_tables", block_tables)
    check_int_tensor("seq_lens", seq_lens)
    if seq_lens.device != block_tables.device:
        raise DeviceMismatchError(f"seq_lens is on {seq_lens.device}, block_tables on {block_tables.device}")
    batch = block_tables.shape[0]
    if seq_lens.shape[0] != batch:
        raise ShapeError(f"seq_lens has {seq_lens.shape[0]} entries, block_tables has {batch} rows")
    lens = [int(n) for n in seq_lens.tolist()]
    pages = []
    for b, n in enumerate(lens):
        if n < 0:
            raise ShapeError(f"seq_lens[{b}] = {n} is negative")
        need = blocks_needed(n, page_size)
        if need > block_tables.shape[1]:
            raise ShapeError(f"seq_lens[{b}] = {n} needs {need} pages of page_size {page_size}, block_tables has "
                             f"{block_tables.shape[1]} columns")
        pages.append(need)
    device = block_tables.device
    indptr = torch.zeros(batch + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int64), 0)
    cols = torch.arange(block_tables.shape[1], device=device)
    keep = cols.unsqueeze(0) < torch.tensor(pages, dtype=torch.int64, device=device).unsqueeze(1)
    indices = block_tables[keep]  # row-major: each row's pages in logical order
    last = [0 if n == 0 else n - (p - 1) * page_size for n, p in zip(lens, pages)]
    return CsrPageTable(indptr.to(device=device, dtype=torch.int32), indices.to(torch.int32),
                        torch.tensor(last, dtype=torch.int32, device=device), page_size)


def csr_to_padded(kv_indptr: object, kv_indices: object, kv_last_page_len: object, page_size: int,
                  num_pages: int | None = None, *, width: int | None = None,
                  pad_value: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page metadata -> padded ``(block_tables, seq_lens)``, after :func:`check_csr`.

    A kernel that takes CSR tables and reads through padded ones passes ``num_pages`` (its pool's
    ``num_blocks``), so that a page id past the pool is reported naming ``kv_indices``, the argument its
    caller gave, rather than the ``block_tables`` made here.

    Args:
        kv_indptr, kv_indices, kv_last_page_len: as in the module docstring (``int32`` / ``int64``).
        page_size: tokens per page, ``>= 1``.
        num_pages: the pool's page count; ``None`` skips the range check of ``kv_indices``.
        width: columns of the result (default: the longest row's page count); must fit every row.
        pad_value: what fills the columns past a row's pages (vLLM pads with ``-1``).

    Returns:
        ``(block_tables int32 [batch, width], seq_lens int32 [batch])`` on ``kv_indptr``'s device.

    Raises:
        Whatever :func:`check_csr` raises for the metadata (``BlockIndexError`` naming ``kv_indices`` for
        a page id outside ``[0, num_pages)``); ``ShapeError`` when ``width`` is smaller than a row's page
        count; ``ArgumentTypeError`` for a non-int ``width`` or ``pad_value``.
    """
    csr = check_csr(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    pages = (csr.kv_indptr[1:] - csr.kv_indptr[:-1]).tolist()
    longest = max(pages, default=0)
    for name, v in (("width", width), ("pad_value", pad_value)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ArgumentTypeError(f"{name} must be an int, got {type(v).__name__}")
    width = longest if width is None else width
    if width < longest:
        raise ShapeError(f"width {width} is smaller than the longest row's {longest} pages (kv_indptr)")
    device = csr.kv_indptr.device
    out = torch.full((csr.batch, width), pad_value, dtype=torch.int32, device=device)
    cols = torch.arange(width, device=device)
    keep = cols.unsqueeze(0) < torch.tensor(pages, dtype=torch.int64, device=device).unsqueeze(1)
    out[keep] = csr.kv_indices
    return out, csr.seq_lens()


def check_csr(kv_indptr: object, kv_indices: object, kv_last_page_len: object, page_size: object,
              num_pages: int | None = None, *, seq_lens: object = None) -> CsrPageTable:
    """Validate FlashInfer-style CSR page metadata (reads it on the host) and return it as ``int32``.

    Args:
        kv_indptr: ``int32`` / ``int64 [batch + 1]``.
        kv_indices: ``int32`` / ``int64 [nnz_pages]``.
        kv_last_page_len: ``int32`` / ``int64 [batch]``.
        page_size: tokens per page, ``>= 1``.
        num_pages: the pool's page count (``num_blocks``); ``None`` skips the range check of the ids.
        seq_lens: optional ``int32`` / ``int64 [batch]`` given beside the CSR rows (SGLang passes both);
            each must equal the row's length from ``kv_indptr`` and ``kv_last_page_len``.

    Returns:
        :class:`CsrPageTable` with the tensors as ``int32`` on their device.

    Raises:
        ArgumentTypeError: a non-tensor argument, a non-int ``page_size``.
        DTypeMismatchError: a dtype other than ``int32`` / ``int64``.
        ShapeError: a rank other than 1; ``kv_indptr`` not ``[batch + 1]`` (``batch`` from
            ``kv_last_page_len``), not starting at 0 or decreasing (not monotone); ``kv_indptr[-1]`` not
            ``kv_indices.numel()``; a ``kv_last_page_len`` of 0 (or negative) for a row with pages, past
            ``page_size``, or not 0 for a row without pages; ``page_size < 1``; ``seq_lens`` not ``[batch]``
            or a sequence longer than its row's pages (or shorter, or ending elsewhere in the last page).
        BlockIndexError: a page id outside ``[0, num_pages)``.
        DeviceMismatchError: the tensors on different devices.
    """
    page_size = _page_size(page_size)
    named = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    if seq_lens is not None:
        named["seq_lens"] = seq_lens
    for name, x in named.items():
        check_int_tensor(name, check_tensor(name, x, 1))
    device = kv_indptr.device
    for name, x in named.items():
        if x.device != device:
            raise DeviceMismatchError(f"{name} is on {x.device}, kv_indptr on {device}")
    batch = kv_last_page_len.shape[0]
    if kv_indptr.shape[0] != batch + 1:
        raise ShapeError(f"kv_indptr must have batch + 1 = {batch + 1} entries (batch from kv_last_page_len), "
                         f"got {kv_indptr.shape[0]}")
    ptr = [int(x) for x in kv_indptr.tolist()]
    if ptr[0] != 0:
        raise ShapeError(f"kv_indptr[0] must be 0, got {ptr[0]}")
    for b in range(batch):
        if ptr[b + 1] < ptr[b]:
            raise ShapeError(f"kv_indptr is not monotone: kv_indptr[{b}] = {ptr[b]} > kv_indptr[{b + 1}] = "
                             f"{ptr[b + 1]}")
    if ptr[-1] != kv_indices.shape[0]:
        raise ShapeError(f"kv_indptr[-1] = {ptr[-1]} pages, kv_indices has {kv_indices.shape[0]} entries")
    last = [int(x) for x in kv_last_page_len.tolist()]
    for b in range(batch):
        pages = ptr[b + 1] - ptr[b]
        if pages == 0 and last[b] != 0:
            raise ShapeError(f"kv_last_page_len[{b}] = {last[b]}, but row {b} has no pages (kv_indptr[{b}] == "
                             f"kv_indptr[{b + 1}] = {ptr[b]}): it must be 0")
        if pages > 0 and not 1 <= last[b] <= page_size:
            raise ShapeError(f"kv_last_page_len[{b}] = {last[b]} must be in [1, page_size = {page_size}] for a row "
                             f"with {pages} pages")
    if num_pages is not None:
        check_ids_in_range("kv_indices", kv_indices, num_pages, "page id")
    csr = CsrPageTable(kv_indptr.to(torch.int32), kv_indices.to(torch.int32), kv_last_page_len.to(torch.int32),
                       page_size)
    if seq_lens is not None:
        if seq_lens.shape[0] != batch:
            raise ShapeError(f"seq_lens has {seq_lens.shape[0]} entries, kv_last_page_len has {batch}")
        for b, (n, got) in enumerate(zip(seq_lens.tolist(), csr.seq_lens().tolist())):
            need, have = blocks_needed(max(int(n), 0), page_size), ptr[b + 1] - ptr[b]
            if n < 0:
                raise ShapeError(f"seq_lens[{b}] = {n} is negative")
            if need > have:
                raise ShapeError(f"seq_lens[{b}] = {n} needs {need} pages of page_size {page_size}, but row {b} "
                                 f"has {have} (kv_indptr[{b + 1}] - kv_indptr[{b}]): a row longer than its pages")
            if n != got:
                raise ShapeError(f"seq_lens[{b}] = {n}, but kv_indptr and kv_last_page_len give row {b} {got} "
                                 f"tokens ({have} pages, {last[b]} in the last)")
    return csr
