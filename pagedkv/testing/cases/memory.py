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
  build in the layout (a property's ``torch.where`` of a pool, a library ``PagedKVCache`` pool).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from pagedkv.cache.hugepages import fresh_pages
from pagedkv.layouts import HND, NHD, PoolLayout, pool_layouts

#: ``(key_layout, value_layout)`` of the pools the kit builds (NHD; the declared ones while a backend runs).
POOL_LAYOUTS: contextvars.ContextVar[tuple[PoolLayout, PoolLayout]] = contextvars.ContextVar(
    "pagedkv_pool_layouts", default=(NHD, NHD))
#: The library cache's ``CacheConfig.kv_layout`` for the same pools: ``"HND"`` when both pools are
#: head-major, else ``"NHD"`` (a ``PagedKVCache`` knows no other layout: its pools are converted per call).
POOL_LAYOUT: contextvars.ContextVar[str] = contextvars.ContextVar("pagedkv_pool_layout", default="NHD")


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
