"""The storage of the pools the kit builds: the contract's NHD, or the layout a backend declares
(``Capabilities.layout``, :mod:`pagedkv.layouts`) while it runs (:func:`pagedkv.testing.execute.call`
sets it). Every pool the kit hands out is the *logical* ``[num_blocks, block_size, num_kv_heads,
head_dim]`` tensor, so every check and reference reads logical positions:

- a layout declared as a view: the pool is ``layout.logical(storage)`` of storage the layout
  allocated, poisoned in that storage; the backend is handed the storage itself (found again from the
  pool's strides by :meth:`~pagedkv.layouts.PoolLayout.storage_of`), so nothing is copied;
- a layout declared as a copy pair: the pool is a plain NHD tensor, and the backend's view
  (:class:`pagedkv.testing.space.DeclaredLayout`) converts it with ``to_storage`` before each call
  and copies ``to_logical`` of the result back after it. The same happens to any pool the kit did not
  build in the layout (a property's ``torch.where`` of a pool, a library ``PagedKVCache`` pool). Under
  :data:`BLOCKWISE_COPY` (the large-pool checks: lazily backed pools of gigabytes) only the blocks
  holding anything are converted, one at a time (:func:`blockwise_to_storage`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from pagedkv.cache.hugepages import fresh_pages
from pagedkv.layouts import HND, NHD, PoolLayout, pool_layouts
from pagedkv.testing.compare import bits

#: ``(key_layout, value_layout)`` of the pools the kit builds (NHD; the declared ones while a backend runs).
POOL_LAYOUTS: contextvars.ContextVar[tuple[PoolLayout, PoolLayout]] = contextvars.ContextVar(
    "pagedkv_pool_layouts", default=(NHD, NHD))
#: The library cache's ``CacheConfig.kv_layout`` for the same pools: ``"HND"`` when both pools are
#: head-major, else ``"NHD"`` (a ``PagedKVCache`` knows no other layout: its pools are converted per call).
POOL_LAYOUT: contextvars.ContextVar[str] = contextvars.ContextVar("pagedkv_pool_layout", default="NHD")
#: On while a large-pool check calls the backend: a copy-pair pool is converted block by block, only the
#: blocks holding anything, so its lazily backed zero pages stay unwritten (a whole conversion writes them all).
BLOCKWISE_COPY: contextvars.ContextVar[bool] = contextvars.ContextVar("pagedkv_blockwise_copy", default=False)
#: Elements scanned at once for nonzero bits (:func:`nonzero_blocks`).
_CHUNK_ELEMENTS = 1 << 26


@contextlib.contextmanager
def pool_layout(layout):
    """Build every pool in ``layout``'s storage inside the block (the tensors handed out stay logical):
    ``"NHD"``, ``"HND"``, a :class:`~pagedkv.layouts.PoolLayout` or a ``(key, value)`` pair.

    Raises:
        ValueError: ``layout`` is none of those.
    """
    pair = pool_layouts(layout)
    tokens = POOL_LAYOUTS.set(pair), POOL_LAYOUT.set("HND" if pair == (HND, HND) else "NHD")
    try:
        yield
    finally:
        POOL_LAYOUTS.reset(tokens[0])
        POOL_LAYOUT.reset(tokens[1])


@contextlib.contextmanager
def blockwise_copy():
    """Inside the block a copy-pair pool reaches the backend converted block by block (:data:`BLOCKWISE_COPY`)."""
    token = BLOCKWISE_COPY.set(True)
    try:
        yield
    finally:
        BLOCKWISE_COPY.reset(token)


def _fill(storage: torch.Tensor, value: float) -> None:
    if storage.dtype.itemsize == 1:  # fp8 through float32: torch's cast saturates inf where the format has none
        storage.copy_(torch.full(storage.shape, value, dtype=torch.float32, device=storage.device))
    else:
        storage.fill_(value)


def _logical_pool(layout: PoolLayout, shape, dtype, device, fill: float | None) -> torch.Tensor:
    if not layout.is_view:  # logical NHD memory, converted around each call
        layout = NHD
    storage, logical = layout.new(shape, dtype, device)
    if fill is not None:
        _fill(storage, fill)
    return logical


def new_lazy_pools(shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical CPU ``(k_cache, v_cache)`` of ``shape`` in the storage of :data:`POOL_LAYOUTS`, on fresh
    zero pages: a pool of gigabytes costs the pages written. A layout whose ``allocate`` gives no
    contiguous storage on the ``meta`` device allocates its own (its pages may then be reused ones:
    the caller checks that they read as zeros)."""
    pools = []
    for layout in POOL_LAYOUTS.get():
        layout = layout if layout.is_view else NHD
        try:
            meta = layout.allocate(tuple(shape), dtype, "meta")
        except Exception:  # noqa: BLE001 - a user's allocate that cannot run on meta: its own memory
            meta = None
        if meta is None or not meta.is_contiguous() or meta.dtype != dtype:
            pools.append(layout.new(shape, dtype, "cpu")[1])
        else:
            pools.append(layout.logical(fresh_pages(tuple(meta.shape), dtype)))
    return pools[0], pools[1]


def new_pools(shape, dtype: torch.dtype, device, fill: float | None, *, interleaved: bool = False,
              head_strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical ``(k_cache, v_cache)`` of ``shape`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
    the storage of :data:`POOL_LAYOUTS`, every element ``fill`` (``None``: left as allocated, e.g. fresh
    zero pages). ``interleaved``: block ``b`` of K and V are blocks ``2b`` and ``2b + 1`` of one arena
    (``kv[:, 0]`` / ``kv[:, 1]`` of a ``[num_blocks, 2, ...]`` tensor: non-contiguous pools); when the
    key and value layouts differ, each pool takes every other block of an arena of its own.
    ``head_strided``: K and V are sub-views of one wider pool whose heads hold ``2 * head_dim + 1``
    elements (K first, one poisoned element, then V), so the head stride is not ``head_dim`` and V
    starts at an offset: a sub-view of a wider cache, as an engine's fused KV buffer hands out. It needs
    one view layout for both pools (NHD, HND); under a declared pair of different layouts (vLLM's packed
    CPU keys beside head-major values) the pools are that pair's own."""
    k_layout, v_layout = POOL_LAYOUTS.get()
    if head_strided and k_layout is v_layout and k_layout.is_view:
        d = shape[-1]
        wide = _logical_pool(k_layout, (*shape[:-1], 2 * d + 1), dtype, device, fill)
        return wide[..., :d], wide[..., d + 1:]
    if not interleaved:
        return (_logical_pool(k_layout, shape, dtype, device, fill),
                _logical_pool(v_layout, shape, dtype, device, fill))
    doubled = (2 * shape[0], *shape[1:])
    k_arena = _logical_pool(k_layout, doubled, dtype, device, fill)
    same = k_layout is v_layout or not (k_layout.is_view or v_layout.is_view)
    v_arena = k_arena if same else _logical_pool(v_layout, doubled, dtype, device, fill)
    return k_arena[0::2], v_arena[1::2]


def storage_of(pool: torch.Tensor) -> torch.Tensor:
    """The memory of a pool the kit built (its layout's storage, e.g. for a scan of raw words): the key or
    value layout's storage the pool is a view of, else the pool itself."""
    for layout in POOL_LAYOUTS.get():
        storage = layout.storage_of(pool)
        if storage is not None:
            return storage
    return pool


def nonzero_blocks(memory: torch.Tensor) -> list[int]:
    """The indices along dim 0 of ``memory`` (a pool or its storage: dim 0 the blocks) of the blocks holding
    any nonzero bit (``-0.0`` included). Chunks are scanned as raw words first: reading fresh zero pages
    maps no memory, so a lazily backed pool of gigabytes costs the pages written."""
    if memory.shape[0] == 0 or memory[0].numel() == 0:
        return []
    step = max(1, _CHUNK_ELEMENTS // memory[0].numel())
    found: list[int] = []
    for first in range(0, memory.shape[0], step):
        chunk = memory[first:first + step]
        raw = chunk.reshape(-1).view(torch.uint8)  # a copy only where the chunk is not contiguous
        words = raw.view(torch.int64) if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0 else raw
        if bool(words.any()):
            flags = raw.view(chunk.shape[0], -1).ne(0).any(-1)
            found += [first + int(i) for i in torch.nonzero(flags).flatten().tolist()]
    return found


def blockwise_to_storage(layout: PoolLayout, pool: torch.Tensor) -> torch.Tensor:
    """``layout.to_storage(pool)`` of a copy-pair layout for a pool mostly of zeros: the storage starts as
    zeros (fresh pages on a CPU) and only the blocks of ``pool`` holding anything are converted, one block
    at a time. Exact when the pair converts each block on its own and maps a zero block to zero storage
    (:func:`copy_pair_blockwise_problem` checks both)."""
    zero = layout.to_storage(torch.zeros((1, *pool.shape[1:]), dtype=pool.dtype, device=pool.device))
    shape = (pool.shape[0], *zero.shape[1:])
    storage = (fresh_pages(shape, zero.dtype) if pool.device.type == "cpu" else
               torch.zeros(shape, dtype=zero.dtype, device=pool.device))
    for b in nonzero_blocks(pool):
        storage[b] = layout.to_storage(pool[b:b + 1])[0]
    return storage


def blockwise_to_logical(layout: PoolLayout, storage: torch.Tensor, pool: torch.Tensor) -> None:
    """Copy ``layout.to_logical(storage)`` into ``pool`` block by block: every block nonzero in either
    (a block the backend wrote, or one it cleared)."""
    for b in sorted(set(nonzero_blocks(storage)) | set(nonzero_blocks(pool))):
        pool[b] = layout.to_logical(storage[b:b + 1])[0]


def copy_pair_blockwise_problem(layout: PoolLayout, block_shape, dtype: torch.dtype, device) -> str | None:
    """Why ``layout`` (a copy pair) cannot be converted block by block (:func:`blockwise_to_storage`), else
    ``None``: on three blocks of ``block_shape`` ``[block_size, num_kv_heads, head_dim]`` it must convert each
    block as the whole does (storage ``[b]`` is block ``b``, :mod:`pagedkv.layouts`) and back bit for bit;
    ``"zero"`` when it maps a zero block to nonzero storage (lazily backed zero pages cannot hold that)."""
    gen = torch.Generator().manual_seed(0)
    pool = (torch.rand((3, *block_shape), generator=gen) + 1).to(device=device, dtype=dtype)
    whole = layout.to_storage(pool)
    for b in range(3):
        one = layout.to_storage(pool[b:b + 1])
        if one.shape[0] != 1 or one.shape[1:] != whole.shape[1:] or one.dtype != whole.dtype or not torch.equal(
                bits(one[0]), bits(whole[b])):
            return f"its to_storage of block {b} alone is not block {b} of the whole pool's storage"
        back = layout.to_logical(one)[0]
        if back.shape != pool[b].shape or back.dtype != pool.dtype or not torch.equal(bits(back), bits(pool[b])):
            return f"its to_logical does not give block {b} back bit for bit"
    zero = layout.to_storage(torch.zeros((1, *block_shape), dtype=dtype, device=device))
    return "zero" if bool(bits(zero).any()) else None
