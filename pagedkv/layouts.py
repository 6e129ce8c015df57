"""Pool layouts: how a backend's storage holds the logical pool ``[num_blocks, block_size, num_kv_heads, head_dim]``.

The contract speaks of logical positions: slot ``o`` of block ``b``, kv head ``h``, element ``d`` is
``pool[b, o, h, d]``. A kernel may keep them in another memory order (FlashInfer's and vLLM's
head-major ``HND``; vLLM's CPU attention stores each block's keys transposed, ``[head_dim,
block_size]`` per kv head). A :class:`PoolLayout` declares that mapping in one of two forms:

- **a view** (preferred): ``allocate(logical_shape, dtype, device) -> storage`` makes the backend's
  tensor for a logical shape, and ``logical(storage) -> tensor`` returns the logical
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor *as a view of the same memory* (a
  permute, a ``view`` that splits or merges contiguous dims). Writes through either side are
  visible in the other; nothing is ever copied.
- **a copy pair**, where no strided view exists (a layout that interleaves elements in a way
  strides cannot express): ``to_storage(logical) -> storage`` and ``to_logical(storage) -> logical``,
  each returning a new tensor, inverse of each other bit for bit, each block converted on its own
  (``to_storage(logical)[b]`` is ``to_storage(logical[b:b + 1])[0]``).

:data:`NHD` and :data:`HND` are two instances of the view form. The conformance suite
(:mod:`pagedkv.testing.cases.memory`) builds pools through ``allocate`` and reads them through
``logical`` when the layout is a view; for a copy pair it keeps logical pools and converts around
each call of the backend (``to_storage`` before, ``to_logical`` copied back after; past 2**24 slots
only the blocks holding anything, one at a time). Storage indexes
blocks along its dim 0 (``storage[b]`` is block ``b``), so block-strided pools (every other block of
one arena, as ``kv[:, 0]`` of an interleaved K/V tensor) are ``storage[0::2]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Shape = tuple[int, int, int, int]


@dataclass(frozen=True)
class PoolLayout:
    """One pool's layout (the key pool's or the value pool's), in the view form or the copy form.

    Attributes:
        name: shown in reports (``"NHD"``, ``"HND"``, ``"vllm_cpu_keys"``).
        allocate: ``(logical_shape, torch.dtype, device) -> Tensor``, the storage for a logical
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` shape, its dim 0 the blocks; may be
            uninitialized (``torch.empty``: the suite fills it).
        logical: ``storage -> Tensor[num_blocks, block_size, num_kv_heads, head_dim]``, a view (no copy).
        to_storage, to_logical: the copy form (new tensors, exact inverses, storage dim 0 the blocks, each
            block converted on its own), for a layout with no view.

    Raises (on construction):
        ValueError: neither form given completely, or both.
    """

    name: str
    allocate: Callable[[Shape, torch.dtype, torch.device | str], torch.Tensor] | None = None
    logical: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_storage: Callable[[torch.Tensor], torch.Tensor] | None = None
    to_logical: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        view = self.allocate is not None and self.logical is not None
        copy = self.to_storage is not None and self.to_logical is not None
        partial = (self.allocate is None) != (self.logical is None) or (self.to_storage is None) != (
            self.to_logical is None)
        if partial or view == copy:
            raise ValueError(f"PoolLayout {self.name!r}: give allocate and logical (a view) or to_storage and "
                             f"to_logical (a copy pair), exactly one of the two")

    @property
    def is_view(self) -> bool:
        """Whether the layout is declared as a view (zero-copy) rather than a copy pair."""
        return self.allocate is not None

    def new(self, shape: Shape, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(storage, logical)`` for a new uninitialized pool of the logical ``shape``: the logical
        tensor is a view of the storage (view form) or the storage's logical copy (copy form).

        Raises:
            TypeError: ``logical`` returned a tensor whose shape is not ``shape``.
        """
        if self.is_view:
            storage = self.allocate(tuple(shape), dtype, device)
            logical = self.logical(storage)
        else:
            logical = torch.empty(shape, dtype=dtype, device=device)
            storage = self.to_storage(logical)
        if tuple(logical.shape) != tuple(shape):
            raise TypeError(f"PoolLayout {self.name!r}: the logical tensor has shape {tuple(logical.shape)}, "
                            f"expected {tuple(shape)}")
        return storage, logical

    def copy_to_storage(self, logical: torch.Tensor) -> torch.Tensor:
        """A new storage tensor holding ``logical`` (``[num_blocks, block_size, num_kv_heads, head_dim]``)."""
        if not self.is_view:
            return self.to_storage(logical)
        storage = self.allocate(tuple(logical.shape), logical.dtype, logical.device)
        self.logical(storage).copy_(logical)
        return storage

    def copy_to_logical(self, storage: torch.Tensor) -> torch.Tensor:
        """A new logical tensor holding ``storage``."""
        return self.logical(storage).clone() if self.is_view else self.to_logical(storage)

    def storage_of(self, logical: torch.Tensor) -> torch.Tensor | None:
        """The storage ``logical`` is a view of, as a tensor over the same memory, when its strides are
        exactly those this layout's view gives (dim 0 may step over blocks, as ``kv[:, 0]`` does); else
        ``None``. Found without copying: the layout's strides for that shape are read from a storage
        allocated on the ``meta`` device, and the answer is checked by viewing it back."""
        if not self.is_view or logical.dim() != 4 or logical.device.type == "meta":
            return None
        ref = self.allocate(tuple(logical.shape), logical.dtype, "meta")
        ref_logical = self.logical(ref)
        strides = list(ref.stride())
        if not _same_strides(logical, ref_logical):
            if logical.shape[0] < 2 or strides[0] != ref_logical.stride(0) or not _same_strides(
                    logical[:1], ref_logical[:1]):
                return self._permuted_storage(logical, ref, ref_logical)
            strides[0] = logical.stride(0)  # block-strided: storage[0::k] of an arena
        return self._viewing_back(logical, ref.shape, strides)

    def _viewing_back(self, logical: torch.Tensor, shape, strides: list[int]) -> torch.Tensor | None:
        """The storage ``shape`` / ``strides`` over ``logical``'s memory when the layout views it back to
        exactly ``logical`` (same start, same strides), else ``None``."""
        try:
            storage = torch.as_strided(logical, shape, strides, logical.storage_offset())
            back = self.logical(storage)
        except RuntimeError:
            return None
        if back.data_ptr() != logical.data_ptr() or not _same_strides(back, logical):
            return None
        return storage

    def _permuted_storage(self, logical: torch.Tensor, ref: torch.Tensor, ref_logical: torch.Tensor
                          ) -> torch.Tensor | None:
        """Where the layout's view only reorders dims (HND's permute), the storage of a logical view that
        keeps the layout's memory order with gaps (a sub-view of a wider pool: a head stride that is not
        ``head_dim``), found by giving each storage dim the stride of the logical dim it is; ``None`` when
        the dims do not correspond one to one, the memory order is another, or the result does not view
        back to ``logical``."""
        mapping: list[int] = []
        for j, n in enumerate(ref.shape):
            match = [i for i in range(ref_logical.dim()) if i not in mapping and ref_logical.shape[i] == n
                     and (n == 1 or ref_logical.stride(i) == ref.stride(j))]
            if not match:
                return None
            mapping.append(match[0])
        strides = [logical.stride(i) for i in mapping]
        dims = [j for j, n in enumerate(ref.shape) if n > 1]
        by_ref = sorted(dims, key=lambda j: ref.stride(j))
        # the layout's memory order, gaps allowed in every dim but the storage's last (head_dim stays dense;
        # where it is one element wide, the next dim may step over a gap, as a one-wide head of a wider cache)
        if by_ref != sorted(dims, key=lambda j: strides[j]) or (ref.shape[-1] > 1 and strides[-1] != ref.stride(-1)):
            return None  # not the layout's memory order (with gaps): a copy in that order is what the backend takes
        return self._viewing_back(logical, ref.shape, strides)


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides over every dim longer than 1 (a length-1 dim's stride is never used)."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def _nhd_allocate(shape: Shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _hnd_allocate(shape: Shape, dtype: torch.dtype, device) -> torch.Tensor:
    nb, bs, h, d = shape
    return torch.empty((nb, h, bs, d), dtype=dtype, device=device)


def _swap_slots_and_heads(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 1, 3)


#: The contract's layout: storage is the logical tensor itself (vLLM's and FlashInfer's ``NHD``).
NHD = PoolLayout("NHD", allocate=_nhd_allocate, logical=lambda t: t)
#: Head-major: storage ``[num_blocks, num_kv_heads, block_size, head_dim]`` (FlashInfer's ``HND``).
HND = PoolLayout("HND", allocate=_hnd_allocate, logical=_swap_slots_and_heads)
#: Layouts known by name (``Capabilities(layout="HND")``).
NAMED = {"NHD": NHD, "HND": HND}


def pool_layouts(layout: str | PoolLayout | tuple[PoolLayout, PoolLayout]) -> tuple[PoolLayout, PoolLayout]:
    """``(key_layout, value_layout)`` of a declaration: a name of :data:`NAMED`, one :class:`PoolLayout`
    for both pools, or a ``(key, value)`` pair.

    Raises:
        ValueError: an unknown name, or anything else.
    """
    if isinstance(layout, str):
        if layout not in NAMED:
            raise ValueError(f"unknown layout {layout!r}; known: {list(NAMED)}, a PoolLayout or a (key, value) pair")
        return NAMED[layout], NAMED[layout]
    if isinstance(layout, PoolLayout):
        return layout, layout
    if isinstance(layout, tuple) and len(layout) == 2 and all(isinstance(x, PoolLayout) for x in layout):
        return layout
    raise ValueError(f"layout must be 'NHD', 'HND', a PoolLayout or a (key PoolLayout, value PoolLayout) pair, "
                     f"got {layout!r}")


def describe(layout: str | PoolLayout | tuple[PoolLayout, PoolLayout]) -> str:
    """The layout's name for reports (``"NHD"``, ``"keys vllm_cpu_keys, values HND"``)."""
    k, v = pool_layouts(layout)
    return k.name if k is v or k.name == v.name else f"keys {k.name}, values {v.name}"
