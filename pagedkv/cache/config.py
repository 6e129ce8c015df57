"""Cache geometry and slot arithmetic.

A *slot* is the flat index of one token position in the pool: ``slot = block_id * block_size +
offset`` (vLLM's ``slot_mapping``). Slots and element offsets are always formed in 64-bit integers:
a pool of 2**31 slots or more is ordinary at large batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: vLLM's ``kv_cache_dtype`` names -> the pools' torch dtype (``None``: the model's dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: ``CacheConfig.kv_layout`` names: the memory order of each pool (the tensors handed out are NHD-shaped).
KV_LAYOUTS = ("NHD", "HND")
#: ``CacheConfig.layer_types`` names (transformers' ``config.layer_types``, Gemma 2/3, GPT-OSS).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: ``CacheConfig.debug_poison`` names -> the value unwritten slots hold (``"max"``: the pools' dtype's
#: largest finite value, filled in per dtype by ``CacheConfig.poison_value``).
POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "max": None}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Map ``"float32" | "float16" | "bfloat16"`` (or a torch dtype) to a torch dtype.

    Raises:
        DTypeMismatchError: for any other dtype.
    """
    from pagedkv.errors import DTypeMismatchError

    if isinstance(name, torch.dtype):
        if name in DTYPES.values():
            return name
    elif name in DTYPES:
        return DTYPES[name]
    raise DTypeMismatchError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """Inverse of :func:`dtype_from_name` (``torch.float16 -> "float16"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheConfig:
    """Geometry of a paged KV cache.

    Raises (on construction):
        ArgumentTypeError (``TypeError``): a size that is not an integer (bools included).
        ShapeError (``ValueError``): a size below 1. DTypeMismatchError: an unsupported dtype.
        DeviceMismatchError (``ValueError``): an unknown device, or CUDA when torch sees none.

    Attributes:
        num_blocks: physical blocks in each pool.
        block_size: token slots per block (any positive integer; 1 and non-powers of two are fine).
        num_kv_heads: K/V heads per token.
        head_dim: elements per head.
        dtype: the model's element type (float32, float16 or bfloat16): of the pools, unless
            ``kv_cache_dtype`` stores them in fp8.
        device: where the pools live.
        num_layers: one K pool and one V pool per layer.
        kv_cache_dtype: ``"auto"`` (pools in ``dtype``), ``"fp8_e4m3"`` (``float8_e4m3fn``) or
            ``"fp8_e5m2"`` (``float8_e5m2``): vLLM's ``--kv-cache-dtype``; fp8 pools are written and read
            with ``k_scale`` / ``v_scale`` (see :mod:`pagedkv.attention.fp8`).
        window_left: ``None`` (or ``-1``): full attention, every block is kept. An int ``>= 0``: every
            layer attends with this ``window_left`` (a query at position ``p`` reads keys
            ``p - window_left .. p``; vLLM's and transformers' ``sliding_window`` is ``window_left + 1``),
            so :class:`~pagedkv.cache.paged_cache.PagedKVCache` releases the blocks no later query can read (vLLM
            v1's ``SlidingWindowManager``; see ``docs/cache.md``). A model that mixes windowed and full
            layers (Gemma 2) leaves it ``None`` and passes ``window_left`` per layer to the attention.
        kv_layout: ``"NHD"`` (the default: each pool's memory is ``[num_blocks, block_size, num_kv_heads,
            head_dim]``, vLLM's and FlashInfer's default) or ``"HND"`` (memory ``[num_blocks, num_kv_heads,
            block_size, head_dim]``, FlashInfer's other layout and vLLM's for some kernels). The pools are
            always handed out as NHD-shaped tensors; with ``"HND"`` they are views of head-major memory,
            so ``pool.permute(0, 2, 1, 3)`` is the contiguous HND tensor a head-major kernel takes.
        debug_poison: ``None``, ``"nan"``, ``"inf"``, ``"-inf"`` or ``"max"``: the pools start filled with
            it, and every block handed out by an allocation or released empty is refilled with it (every
            layer, K and V), so a read of a slot nobody wrote shows in the output. ``"max"`` is the pools'
            dtype's largest finite value: the poison for kernels that load unused slots and mask their
            scores afterwards, so they need those slots finite (vLLM's CPU attention), while a read that
            reaches the output still shows as a huge value. For running an engine under test; off
            (``None``) in production: it costs one fill per allocated and released block.
        layer_types: ``None`` (every layer alike, as ``window_left`` says), or one name per layer,
            ``"full_attention"`` or ``"sliding_attention"`` (transformers' ``config.layer_types``): a
            hybrid model, served by :class:`~pagedkv.cache.hybrid.HybridKVCache` with one KV-cache group
            per kind; the sliding layers attend through ``window_left`` (required then).

    Raises (also):
        ArgumentValueError (``ValueError``): ``window_left`` below ``-1``; ``debug_poison`` not one of
        :data:`POISONS`. DTypeMismatchError: a poison the pools' dtype cannot hold (``"inf"`` in
        ``float8_e4m3fn``, which has no infinity). ArgumentTypeError: ``window_left`` not an int.
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    num_layers: int = 1
    kv_cache_dtype: str = "auto"
    window_left: int | None = None
    debug_poison: str | None = None
    kv_layout: str = "NHD"
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        from pagedkv.cache.allocator import as_int
        from pagedkv.errors import DeviceMismatchError, ShapeError

        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_layers"):
            value = as_int(name, getattr(self, name))  # ArgumentTypeError (TypeError) for non-integers
            if value < 1:
                raise ShapeError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        if self.kv_layout not in KV_LAYOUTS:
            from pagedkv.errors import ArgumentValueError

            raise ArgumentValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            from pagedkv.errors import DTypeMismatchError

            raise DTypeMismatchError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                                     f"got {self.kv_cache_dtype!r}")
        self._check_window_and_poison()
        self._check_layer_types()
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise DeviceMismatchError(f"device {self.device!r} is not a torch device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceMismatchError(f"device {self.device!r} asked for, but torch sees no CUDA device "
                                      f"(torch {torch.__version__})")

    def _check_window_and_poison(self) -> None:
        from pagedkv.cache.allocator import as_int
        from pagedkv.errors import ArgumentValueError, DTypeMismatchError

        if self.window_left is not None:
            window = as_int("window_left", self.window_left)
            if window < -1:
                raise ArgumentValueError(f"window_left must be None (or -1: no window) or >= 0, got {window}")
            object.__setattr__(self, "window_left", None if window == -1 else window)
        if self.debug_poison is not None:
            if self.debug_poison not in POISONS:
                raise ArgumentValueError(f"debug_poison must be None or one of {sorted(POISONS)}, "
                                         f"got {self.debug_poison!r}")
            if self.debug_poison in ("inf", "-inf") and self.cache_dtype == torch.float8_e4m3fn:  # no infinity
                raise DTypeMismatchError(f"debug_poison {self.debug_poison!r} cannot be stored in {self.cache_dtype} "
                                         "pools (no infinity): use \"nan\" or \"max\"")

    def _check_layer_types(self) -> None:
        from pagedkv.errors import ArgumentTypeError, ArgumentValueError

        if self.layer_types is None:
            return
        if isinstance(self.layer_types, (str, bytes)) or not hasattr(self.layer_types, "__iter__"):
            raise ArgumentTypeError(f"layer_types must be a sequence of {LAYER_TYPES} names, got "
                                    f"{type(self.layer_types).__name__} {self.layer_types!r}")
        kinds = tuple(self.layer_types)
        if len(kinds) != self.num_layers:
            raise ArgumentValueError(f"layer_types names {len(kinds)} layers, num_layers is {self.num_layers}")
        bad = [k for k in kinds if k not in LAYER_TYPES]
        if bad:
            raise ArgumentValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}")
        if "sliding_attention" in kinds and self.window_left is None:
            raise ArgumentValueError("layer_types has sliding_attention layers but window_left is None: "
                                     "set the sliding layers' window_left")
        object.__setattr__(self, "layer_types", kinds)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's ``window_left`` (``None``: full attention)."""
        if self.layer_types is None:
            return (self.window_left,) * self.num_layers
        return tuple(self.window_left if k == "sliding_attention" else None for k in self.layer_types)

    @property
    def poison_value(self) -> float | None:
        """The float ``debug_poison`` names (``None``: no poison; ``"max"``: ``torch.finfo(cache_dtype).max``)."""
        if self.debug_poison is None:
            return None
        if self.debug_poison == "max":
            return torch.finfo(self.cache_dtype).max
        return POISONS[self.debug_poison]

    @property
    def num_slots(self) -> int:
        """Token slots in one pool (``num_blocks * block_size``), a Python int (unbounded)."""
        return self.num_blocks * self.block_size

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_dim)``: the shape of one block."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one pool (K or V of one layer)."""
        return self.block_size * self.num_kv_heads * self.head_dim * torch.finfo(self.cache_dtype).bits // 8

    @property
    def cache_dtype(self) -> torch.dtype:
        """The pools' element type: ``dtype``, or the fp8 type ``kv_cache_dtype`` names."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """``ceil(num_tokens / block_size)``: table entries that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def slot_of(block_id: int, offset: int, block_size: int) -> int:
    """Slot of ``offset`` inside ``block_id`` (Python ints: exact at any pool size)."""
    return block_id * block_size + offset


def slots_for_positions(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of logical ``positions`` of a sequence, as ``int64``.

    Args:
        block_table: ``int32`` or ``int64 [num_table_entries]``.
        positions: integer ``[n]`` logical token positions.
        block_size: tokens per block.

    Returns:
        ``int64 [n]``: ``block_table[p // block_size] * block_size + p % block_size``, computed in
        64 bits so that pools past 2**31 slots are exact (an int32 product would wrap).
    """
    positions = positions.to(torch.int64)
    blocks = block_table.to(torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


def element_offset(slot: int | torch.Tensor, num_kv_heads: int, head_dim: int) -> int | torch.Tensor:
    """Element offset of ``slot``'s first value in a contiguous pool (64-bit for tensors)."""
    if isinstance(slot, torch.Tensor):
        return slot.to(torch.int64) * (num_kv_heads * head_dim)
    return slot * num_kv_heads * head_dim
