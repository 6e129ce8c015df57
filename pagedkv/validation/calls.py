"""Argument checks of whole backend calls, at three levels, run before any kernel launch and any write.

On CUDA an out-of-range block id that reaches a kernel is a device-side assert (which poisons the
whole process) or a silent out-of-bounds access, so every backend op goes through one of the
``*_args`` functions below first (:mod:`pagedkv.backends.ops` applies them; nothing else does).
The ``validate`` argument of an op picks the level (see ``docs/validation.md`` for what each catches):

- ``"full"`` (or ``True``, the default): every check; block tables, lengths and slots are read on the
  host (one small device-to-host copy on CUDA).
- ``"metadata"``: shapes, dtypes, devices, strides and memory overlap only; no tensor data is read, so
  no host synchronisation (what ``torch.compile`` and CUDA graph capture need).
- ``"none"`` (or ``False``): nothing is checked; a bad argument is undefined behaviour.

Error types follow the backend contract: a block id or slot that would be read or written outside
the pool is an ``IndexError`` (:class:`BlockIndexError`); shapes, lengths, table sizes and head
counts are a ``ValueError`` (:class:`ShapeError`); a dtype mismatch, or an argument of the wrong
kind (a float block table, a bool length), is a ``TypeError`` (:class:`DTypeMismatchError` or
:class:`ArgumentTypeError`); a device mismatch is a ``ValueError`` (:class:`DeviceMismatchError`).
Messages name the argument and the offending values. The single-argument checks live in
:mod:`pagedkv.validation.arguments`, the overlap test in :mod:`pagedkv.validation.overlap`, the levels in
:mod:`pagedkv.validation.levels` and the ``paged_attention`` checks in :mod:`pagedkv.validation.attention_arguments`;
all are re-exported here.

Each function returns the normalised arguments the op needs (tables as ``int64`` on the cache
device, lengths as Python ints, scales as ``float32`` tensors) so backends do not repeat the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.validation.arguments import (ALL_FEATURES, FP8_DTYPES, TableLike, as_scale, check_cache, check_cache_pair,
                               check_features, check_ids_in_range, check_int_tensor, check_kv_scale, check_length,
                               check_in_layout, check_like_cache, check_no_overlap, check_pool_scales,
                               check_tensor,
                               normalize_block_table)
from pagedkv.validation.attention_arguments import AttentionArgs, attention_args, check_paged_attention
from pagedkv.cache.config import DTYPES, blocks_needed
from pagedkv.errors import BlockIndexError, DeviceMismatchError, DTypeMismatchError, ShapeError
from pagedkv.validation.overlap import shares_memory
from pagedkv.validation.levels import LEVELS, can_test_overlap, validation_level

__all__ = [
    "ALL_FEATURES", "FP8_DTYPES", "LEVELS", "AttentionArgs", "TableLike", "WriteArgs", "attention_args",
    "check_cache", "check_cache_pair", "check_features", "check_gather", "check_kv_scale", "check_paged_attention",
    "check_scatter", "check_write_kv", "check_write_overlap", "gather_args", "normalize_block_table", "scatter_args",
    "shares_memory", "validation_level", "write_kv_args",
]


def check_scatter(cache: object, block_table: TableLike, values: object,
                  start: int = 0, *, layout: object = "NHD") -> tuple[torch.Tensor, int, int]:
    """Validate ``scatter(cache, block_table, values, start)`` (level ``"full"``). ``layout``: the pool's, as
    ``Capabilities.layout`` declares it (``"HND"``: ``[num_blocks, num_kv_heads, block_size, head_dim]``;
    :func:`~pagedkv.validation.arguments.logical_pools`).

    Returns:
        ``(table_int64_on_cache_device, start, n)``.

    Raises:
        ShapeError: ``values`` not ``[n, num_kv_heads, head_dim]``, negative ``start``, a table too short
            for ``start + n`` tokens, or one physical block at two written logical blocks.
        BlockIndexError: a written block id outside ``[0, num_blocks)``.
        DTypeMismatchError / DeviceMismatchError: ``values`` unlike ``cache``.
        ArgumentValueError: an unknown ``layout``, or one with no view.
    """
    return check_in_layout(layout, lambda pool: scatter_args(pool, block_table, values, start), cache=cache)


def scatter_args(cache: object, block_table: TableLike, values: object, start: object = 0,
                 validate: object = "full") -> tuple[torch.Tensor, int, int]:
    """:func:`check_scatter` at any level (``"metadata"`` skips the block ids' range and uniqueness)."""
    level = validation_level(validate)
    if level == "none":
        return normalize_block_table(block_table, cache.device), int(start), values.shape[0]
    cache = check_cache("cache", cache)
    values = check_tensor("values", values, 3)
    check_like_cache("values", values, cache, "cache")
    if can_test_overlap():
        check_no_overlap("values", values, cache, "cache")
    if tuple(values.shape[1:]) != tuple(cache.shape[2:]):
        raise ShapeError(f"values must be [n, num_kv_heads, head_dim] = [n, {cache.shape[2]}, {cache.shape[3]}], "
                         f"got {tuple(values.shape)}")
    start = check_length("start", start)
    n = values.shape[0]
    table = normalize_block_table(block_table, cache.device)
    block_size = cache.shape[1]
    if n == 0:
        return table, start, 0
    first, last = start // block_size, blocks_needed(start + n, block_size)
    if table.numel() < last:
        raise ShapeError(f"block_table has {table.numel()} entries, but start + n = {start} + {n} = {start + n} "
                         f"tokens need {last} blocks of block_size {block_size}")
    if level == "full":
        written = table[first:last]
        check_ids_in_range("block_table", written, cache.shape[0])
        if torch.unique(written).numel() != written.numel():
            raise ShapeError(f"block_table maps two written logical blocks to one physical block: {written.tolist()}")
    return table, start, n


def check_gather(cache: object, block_table: TableLike, seq_len: int, *,
                 layout: object = "NHD") -> tuple[torch.Tensor, int]:
    """Validate ``gather(cache, block_table, seq_len)`` (level ``"full"``). ``layout``: the pool's, as
    ``Capabilities.layout`` declares it (:func:`~pagedkv.validation.arguments.logical_pools`).

    Returns:
        ``(table_int64_on_cache_device, seq_len)``.

    Raises:
        ShapeError: negative ``seq_len`` or a table with fewer than ``ceil(seq_len / block_size)`` entries.
        BlockIndexError: a read block id outside ``[0, num_blocks)`` (``-1`` padding past the read
            entries is fine).
        ArgumentValueError: an unknown ``layout``, or one with no view.
    """
    return check_in_layout(layout, lambda pool: gather_args(pool, block_table, seq_len), cache=cache)


def gather_args(cache: object, block_table: TableLike, seq_len: object,
                validate: object = "full") -> tuple[torch.Tensor, int]:
    """:func:`check_gather` at any level (``"metadata"`` skips the block ids' range).

    At ``"none"`` an ``int32``/``int64`` table already on the cache's device is returned as it is.
    """
    level = validation_level(validate)
    if level == "none":
        return _table_as_is(block_table, cache.device), int(seq_len)
    cache = check_cache("cache", cache)
    seq_len = check_length("seq_len", seq_len)
    table = normalize_block_table(block_table, cache.device)
    need = blocks_needed(seq_len, cache.shape[1])
    if table.numel() < need:
        raise ShapeError(f"block_table has {table.numel()} entries, but seq_len {seq_len} needs {need} blocks "
                         f"of block_size {cache.shape[1]}")
    if level == "full":
        check_ids_in_range("block_table", table[:need], cache.shape[0])
    return table, seq_len


def _table_as_is(block_table: TableLike, device: torch.device) -> torch.Tensor:
    """An integer table on ``device`` unchanged (ops index with int32 and int64 alike), else normalised."""
    if isinstance(block_table, torch.Tensor) and block_table.device == device \
            and block_table.dtype in (torch.int32, torch.int64):
        return block_table
    return normalize_block_table(block_table, device)


@dataclass(frozen=True)
class WriteArgs:
    """Normalised ``write_kv`` arguments."""

    slots: torch.Tensor  # int64 [num_tokens] on the cache device
    k_scale: torch.Tensor | None = None  # float32 [num_kv_heads] on the cache device (fp8 pools only)
    v_scale: torch.Tensor | None = None
    # the overlap test is still to run (it was skipped while torch.compile traced): the op runs it
    check_overlap: bool = False


def check_write_kv(k_cache: object, v_cache: object, key: object, value: object, slot_mapping: object, *,
                   k_scale: object = None, v_scale: object = None, layout: object = "NHD") -> torch.Tensor:
    """Validate ``write_kv`` (vLLM ``reshape_and_cache``, level ``"full"``). ``layout``: the pools', as
    ``Capabilities.layout`` declares it (:func:`~pagedkv.validation.arguments.logical_pools`); a slot is
    ``block * block_size + offset`` in every layout.

    ``key``/``value`` share the pools' dtype, except into an fp8 pool (``float8_e4m3fn`` /
    ``float8_e5m2``), which takes float32/float16/bfloat16 and requires ``k_scale`` and ``v_scale``
    (see :func:`check_kv_scale`); a non-fp8 pool refuses scales.

    Returns:
        ``slot_mapping`` as ``int64`` on the cache device (:func:`write_kv_args` also returns the scales).

    Raises:
        ShapeError: ``key``/``value`` not ``[num_tokens, num_kv_heads, head_dim]``, ``slot_mapping`` not
            ``[num_tokens]``, one slot written twice, ``k_cache`` and ``v_cache`` overlapping in memory, or
            ``key``/``value`` overlapping a pool.
        ArgumentValueError: a scale that is zero, negative or not finite.
        BlockIndexError: a non-negative slot ``>= num_blocks * block_size``.
        DTypeMismatchError / DeviceMismatchError: key/value/slot_mapping/scales unlike the caches.
        ArgumentTypeError: an fp8 pool without scales, or scales for a non-fp8 pool.
        ArgumentValueError: an unknown ``layout``, or one with no view.
    """
    return check_in_layout(layout, lambda k, v: write_kv_args(k, v, key, value, slot_mapping, k_scale=k_scale,
                                                              v_scale=v_scale).slots, k_cache=k_cache, v_cache=v_cache)


def check_write_overlap(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """``write_kv``'s memory-overlap checks (pools with each other, ``key``/``value`` with either pool)."""
    if shares_memory(k_cache, v_cache):
        raise ShapeError("k_cache and v_cache overlap in memory (one pool passed twice, or overlapping views): "
                         "a write of value would overwrite key")
    for name, x in (("key", key), ("value", value)):
        for cname, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_no_overlap(name, x, c, cname)


def write_kv_args(k_cache: object, v_cache: object, key: object, value: object, slot_mapping: object, *,
                  k_scale: object = None, v_scale: object = None, validate: object = "full",
                  supported: frozenset | None = None) -> WriteArgs:
    """:func:`check_write_kv` at any level, returning :class:`WriteArgs` (slots and normalised scales).

    ``"metadata"`` skips the slots' range and uniqueness and the scales' values; ``"none"`` only
    normalises (the caller checked). ``supported``: the backend's ``FEATURES``; an fp8 pool needs
    ``"fp8"`` in it (:func:`check_features`).
    """
    level = validation_level(validate)
    if level == "none":
        fp8 = k_cache.dtype in FP8_DTYPES
        h, dev = k_cache.shape[2], k_cache.device
        return WriteArgs(slot_mapping.to(torch.int64), as_scale(k_scale, h, dev) if fp8 else None,
                         as_scale(v_scale, h, dev) if fp8 else None)
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    overlap_now = can_test_overlap()
    if overlap_now and shares_memory(k_cache, v_cache):
        raise ShapeError("k_cache and v_cache overlap in memory (one pool passed twice, or overlapping views): "
                         "a write of value would overwrite key")
    key = check_tensor("key", key, 3)
    value = check_tensor("value", value, 3)
    fp8 = k_cache.dtype in FP8_DTYPES
    for name, x, cname, c in (("key", key, "k_cache", k_cache), ("value", value, "v_cache", v_cache)):
        if fp8:  # quantized on write: the values come in a float dtype
            if x.dtype not in DTYPES.values():
                raise DTypeMismatchError(f"{name}.dtype must be float32/float16/bfloat16 for an fp8 {cname} "
                                         f"({c.dtype}), got {x.dtype}")
            if x.device != c.device:
                raise DeviceMismatchError(f"{name} is on {x.device}, {cname} on {c.device}")
        else:
            check_like_cache(name, x, c, cname)
        if tuple(x.shape[1:]) != tuple(c.shape[2:]):
            raise ShapeError(f"{name} must be [num_tokens, num_kv_heads, head_dim] = [num_tokens, {c.shape[2]}, "
                             f"{c.shape[3]}], got {tuple(x.shape)}")
    if key.shape[0] != value.shape[0]:
        raise ShapeError(f"key has {key.shape[0]} tokens, value has {value.shape[0]}")
    if overlap_now:
        check_write_overlap(k_cache, v_cache, key, value)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, 1)
    check_int_tensor("slot_mapping", slot_mapping)
    if slot_mapping.device != k_cache.device:
        raise DeviceMismatchError(f"slot_mapping is on {slot_mapping.device}, k_cache on {k_cache.device}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping has {slot_mapping.shape[0]} entries, key has {key.shape[0]} tokens")
    slots = slot_mapping.to(torch.int64)
    if level == "full":
        _check_slots(slots, k_cache.shape[0], k_cache.shape[1])
    ks, vs = check_pool_scales(k_cache, k_scale, v_scale, read_values=level == "full")
    check_features(frozenset({"fp8"}) if fp8 else frozenset(), supported, "write_kv")
    return WriteArgs(slots, ks, vs, check_overlap=not overlap_now)


def _check_slots(slots: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every non-negative slot inside the pool and written once (reads the slots)."""
    valid = slots[slots >= 0]
    num_slots = num_blocks * block_size
    if not valid.numel():
        return
    hi = int(valid.max())
    if hi >= num_slots:
        at = int(torch.nonzero(slots == hi)[0][0])
        raise BlockIndexError(f"slot_mapping[{at}] = {hi} (block {hi // block_size}), outside "
                              f"[0, num_blocks * block_size = {num_slots})")
    uniq, counts = torch.unique(valid, return_counts=True)
    if uniq.numel() != valid.numel():
        dup = int(uniq[counts > 1][0])
        at = torch.nonzero(slots == dup).flatten().tolist()
        raise ShapeError(f"slot_mapping writes slot {dup} twice (entries {at})")
