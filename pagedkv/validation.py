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
:mod:`pagedkv.arguments`, the overlap test in :mod:`pagedkv.overlap`; both are re-exported here.

Each function returns the normalised arguments the op needs (tables as ``int64`` on the cache
device, lengths as Python ints, scales as ``float32`` tensors) so backends do not repeat the work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.arguments import (ALL_FEATURES, FP8_DTYPES, TableLike, as_scale, check_cache, check_cache_pair,
                               check_features, check_head_vector, check_ids_in_range, check_int_tensor,
                               check_kv_scale, check_length, check_like_cache, check_no_overlap, check_pool_scales,
                               check_scale, check_softcap, check_tensor, check_window, normalize_block_table)
from pagedkv.arguments import as_head_vector, check_num_splits
from pagedkv.config import DTYPES, blocks_needed
from pagedkv.errors import ArgumentTypeError, BlockIndexError, DeviceMismatchError, DTypeMismatchError, ShapeError
from pagedkv.overlap import shares_memory

__all__ = [
    "ALL_FEATURES", "FP8_DTYPES", "LEVELS", "AttentionArgs", "TableLike", "WriteArgs", "attention_args",
    "check_cache", "check_cache_pair", "check_features", "check_gather", "check_kv_scale", "check_paged_attention",
    "check_scatter", "check_write_kv", "check_write_overlap", "gather_args", "normalize_block_table", "scatter_args",
    "shares_memory", "validation_level", "write_kv_args",
]

#: The validation levels, strictest first.
LEVELS = ("full", "metadata", "none")


def validation_level(validate: object) -> str:
    """An op's ``validate`` argument as a level: ``True`` is ``"full"``, ``False`` is ``"none"``.

    Raises:
        ArgumentTypeError: anything but a bool or one of :data:`LEVELS`.
    """
    if validate is True:
        return "full"
    if validate is False:
        return "none"
    if isinstance(validate, str) and validate in LEVELS:
        return validate
    raise ArgumentTypeError(f"validate must be True, False or one of {list(LEVELS)}, got {validate!r}")


def _overlap_now() -> bool:
    """Whether the overlap test can run here: not while ``torch.compile`` traces (fake tensors have no
    address); the custom ops run it then, on the real tensors (``WriteArgs.check_overlap``)."""
    return not torch.compiler.is_compiling()


def check_scatter(cache: object, block_table: TableLike, values: object,
                  start: int = 0) -> tuple[torch.Tensor, int, int]:
    """Validate ``scatter(cache, block_table, values, start)`` (level ``"full"``).

    Returns:
        ``(table_int64_on_cache_device, start, n)``.

    Raises:
        ShapeError: ``values`` not ``[n, num_kv_heads, head_dim]``, negative ``start``, a table too short
            for ``start + n`` tokens, or one physical block at two written logical blocks.
        BlockIndexError: a written block id outside ``[0, num_blocks)``.
        DTypeMismatchError / DeviceMismatchError: ``values`` unlike ``cache``.
    """
    return scatter_args(cache, block_table, values, start)


def scatter_args(cache: object, block_table: TableLike, values: object, start: object = 0,
                 validate: object = "full") -> tuple[torch.Tensor, int, int]:
    """:func:`check_scatter` at any level (``"metadata"`` skips the block ids' range and uniqueness)."""
    level = validation_level(validate)
    if level == "none":
        return normalize_block_table(block_table, cache.device), int(start), values.shape[0]
    cache = check_cache("cache", cache)
    values = check_tensor("values", values, 3)
    check_like_cache("values", values, cache, "cache")
    if _overlap_now():
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


def check_gather(cache: object, block_table: TableLike, seq_len: int) -> tuple[torch.Tensor, int]:
    """Validate ``gather(cache, block_table, seq_len)`` (level ``"full"``).

    Returns:
        ``(table_int64_on_cache_device, seq_len)``.

    Raises:
        ShapeError: negative ``seq_len`` or a table with fewer than ``ceil(seq_len / block_size)`` entries.
        BlockIndexError: a read block id outside ``[0, num_blocks)`` (``-1`` padding past the read
            entries is fine).
    """
    return gather_args(cache, block_table, seq_len)


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
                   k_scale: object = None, v_scale: object = None) -> torch.Tensor:
    """Validate ``write_kv`` (vLLM ``reshape_and_cache``, level ``"full"``).

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
    """
    return write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale).slots


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
    overlap_now = _overlap_now()
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


@dataclass(frozen=True)
class AttentionArgs:
    """Normalised ``paged_attention`` arguments.

    ``seq_lens`` / ``q_starts`` are host lists: the ``"full"`` check has read them; below that level
    they are read from ``seq_lens_tensor`` / ``query_start_loc`` only when a backend asks for them
    (a host read: the sync-free ops use the tensors).
    """

    block_tables: torch.Tensor  # int64 [batch, max_blocks] on the cache device
    host_seq_lens: list[int] | None
    host_q_starts: list[int] | None  # query_start_loc as Python ints, len batch + 1
    scale: float
    num_queries_per_kv: int
    window_left: int = -1  # a query at position p sees keys p - window_left .. p; -1: no window
    softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap); 0: off
    alibi_slopes: torch.Tensor | None = None  # float32 [num_q_heads] on the query's device
    sinks: torch.Tensor | None = None  # float32 [num_q_heads]: one extra logit per head, no value
    k_scale: torch.Tensor | None = None  # float32 [num_kv_heads] (fp8 pools only)
    v_scale: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None  # int32/int64 [batch] on the cache device, as given
    query_start_loc: torch.Tensor | None = None  # int32/int64 [batch + 1] on the cache device, as given
    num_splits: int | None = None  # split-K parts (a backend that declares split-K); None: its heuristic

    @property
    def seq_lens(self) -> list[int]:
        """Context length of each sequence (host ints; read from the tensor below level ``"full"``)."""
        return self.host_seq_lens if self.host_seq_lens is not None else [int(x) for x in self.seq_lens_tensor.tolist()]

    @property
    def q_starts(self) -> list[int]:
        """``query_start_loc`` as host ints (read from the tensor below level ``"full"``)."""
        if self.host_q_starts is not None:
            return self.host_q_starts
        return [int(x) for x in self.query_start_loc.tolist()]

    @property
    def features(self) -> frozenset:
        """The optional features this call uses (names as in a backend's ``FEATURES``)."""
        return frozenset(name for name, on in (
            ("window", self.window_left >= 0), ("softcap", self.softcap > 0), ("alibi", self.alibi_slopes is not None),
            ("sinks", self.sinks is not None), ("fp8", self.k_scale is not None)) if on)


def check_paged_attention(query: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object,
                          query_start_loc: object, scale: float | None = None, *, window_left: object = -1,
                          softcap: object = 0.0, alibi_slopes: object = None, sinks: object = None,
                          k_scale: object = None, v_scale: object = None,
                          supported: frozenset | None = None) -> AttentionArgs:
    """Validate ``paged_attention`` (packed varlen, flash-attn's ``cu_seqlens_q`` convention; level ``"full"``).

    The optional features (see ``docs/contract.md``; vLLM's unified attention and flash-attn's names):
    ``window_left`` (int ``>= -1``), ``softcap`` (float ``>= 0``), ``alibi_slopes`` and ``sinks``
    (``[num_q_heads]`` float32, float16 or bfloat16 tensors on the query's device, or sequences of
    floats, converted once to float32: :func:`check_head_vector`; sinks may be ``-inf``), ``k_scale`` / ``v_scale``
    (required for, and only for, an fp8 pool; see :func:`check_kv_scale`). With an fp8 pool the
    query is float32/float16/bfloat16. ``supported``: the backend's ``FEATURES``; a feature in use
    that it does not declare is refused (:func:`check_features`).

    Raises:
        ShapeError: wrong ranks; ``num_q_heads % num_kv_heads != 0``; ``head_dim`` mismatch;
            ``query_start_loc`` not ``[batch + 1]``, not starting at 0, decreasing, or not ending at
            ``total_q``; ``seq_lens`` not ``[batch]`` or negative; ``q_len > seq_len``; a table row too
            short for its ``seq_len``; slopes/sinks/scales of the wrong shape.
        ArgumentValueError: ``scale`` not finite; ``window_left < -1``; ``softcap`` negative or not
            finite; slopes/sinks not finite (sinks may be ``-inf``); an fp8 scale ``<= 0`` or not finite.
        BlockIndexError: a read block id outside ``[0, num_blocks)`` (with a window, the entries wholly
            before the first query's window are not read: ``-1`` there is fine).
        DTypeMismatchError / DeviceMismatchError: query, metadata, slopes, sinks or scales unlike the caches.
        ArgumentTypeError: ``window_left`` not an int, ``softcap`` not a number, an fp8 pool without
            scales or scales for a non-fp8 pool.
        BackendError: a feature in use that ``supported`` does not declare.
    """
    return attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, "full",
                          window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, supported=supported)


def attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                   validate: object = "full", *, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   k_scale=None, v_scale=None, supported: frozenset | None = None,
                   num_splits=None) -> AttentionArgs:
    """:func:`check_paged_attention` at any level, plus ``num_splits`` (:func:`check_num_splits`; passed on
    as ``AttentionArgs.num_splits``).

    ``"metadata"`` skips what needs the data: ``query_start_loc``'s values (first 0, last ``total_q``,
    non-decreasing), ``seq_lens`` against ``q_len`` and the table width, the block ids' range, and the
    values of slopes, sinks and tensor scales. ``"none"`` only normalises (the caller checked). Below
    ``"full"`` the result carries the metadata tensors and no host copy of them.
    """
    level = validation_level(validate)
    splits = (None if num_splits is None else int(num_splits)) if level == "none" else check_num_splits(num_splits)
    if level == "none":
        fp8 = k_cache.dtype in FP8_DTYPES
        h, dev = k_cache.shape[2], k_cache.device
        return AttentionArgs(block_tables.to(torch.int64), None, None,
                             1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
                             query.shape[1] // k_cache.shape[2], int(window_left), float(softcap),
                             as_head_vector(alibi_slopes, query.device), as_head_vector(sinks, query.device),
                             as_scale(k_scale, h, dev) if fp8 else None, as_scale(v_scale, h, dev) if fp8 else None,
                             seq_lens, query_start_loc, splits)
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    query = check_tensor("query", query, 3)
    if k_cache.dtype in FP8_DTYPES:  # dequantized in the kernel: the query stays in a float dtype
        if query.dtype not in DTYPES.values():
            raise DTypeMismatchError(f"query.dtype must be float32/float16/bfloat16 for an fp8 k_cache "
                                     f"({k_cache.dtype}), got {query.dtype}")
        if query.device != k_cache.device:
            raise DeviceMismatchError(f"query is on {query.device}, k_cache on {k_cache.device}")
    else:
        check_like_cache("query", query, k_cache, "k_cache")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.shape[2] != head_dim:
        raise ShapeError(f"query head_dim {query.shape[2]} != k_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0 or query.shape[1] == 0:
        raise ShapeError(f"query has num_q_heads {query.shape[1]}, not a positive multiple of k_cache's "
                         f"num_kv_heads {num_kv_heads}")
    block_tables = check_tensor("block_tables", block_tables, 2)
    seq_lens = check_tensor("seq_lens", seq_lens, 1)
    query_start_loc = check_tensor("query_start_loc", query_start_loc, 1)
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        check_int_tensor(name, x)
        if x.device != k_cache.device:
            raise DeviceMismatchError(f"{name} is on {x.device}, k_cache on {k_cache.device}")
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch:
        raise ShapeError(f"block_tables has {block_tables.shape[0]} rows, seq_lens has {batch} entries")
    if query_start_loc.shape[0] != batch + 1:
        raise ShapeError(f"query_start_loc must have batch + 1 = {batch + 1} entries, got {query_start_loc.shape[0]}")
    tables = block_tables.to(torch.int64)
    lens = starts = None
    if level == "full":  # a window leaves the table entries before it unread: -1 (released) is fine there
        lens, starts = _check_lengths(tables, seq_lens, query_start_loc, query.shape[0], num_blocks, block_size,
                                      check_window(window_left))
    scale = check_scale(scale, head_dim)
    num_q_heads = query.shape[1]
    if (type(window_left) is int and window_left == -1 and type(softcap) in (float, int) and softcap == 0
            and alibi_slopes is None and sinks is None and k_scale is None and v_scale is None
            and k_cache.dtype not in FP8_DTYPES):  # the plain call: no feature, nothing more to check
        return AttentionArgs(tables, lens, starts, scale, num_q_heads // num_kv_heads,
                             seq_lens_tensor=seq_lens, query_start_loc=query_start_loc, num_splits=splits)
    read = level == "full"
    window_left = check_window(window_left)
    softcap = check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = check_head_vector("alibi_slopes", alibi_slopes, num_q_heads, query.device, False, read)
    if sinks is not None:
        sinks = check_head_vector("sinks", sinks, num_q_heads, query.device, True, read)
    k_scale, v_scale = check_pool_scales(k_cache, k_scale, v_scale, read_values=read)
    args = AttentionArgs(tables, lens, starts, scale, num_q_heads // num_kv_heads, window_left, softcap,
                         alibi_slopes, sinks, k_scale, v_scale, seq_lens, query_start_loc, splits)
    check_features(args.features, supported, "paged_attention")
    return args


def _check_lengths(tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, total_q: int,
                   num_blocks: int, block_size: int, window_left: int = -1) -> tuple[list[int], list[int]]:
    """The data checks of ``paged_attention``'s metadata; returns ``seq_lens`` and ``query_start_loc`` as host ints.

    Block ids are checked in the entries a query reads: from the block of the first query's first
    visible key (``seq_len - q_len - window_left`` with a window, else 0) to ``ceil(seq_len / block_size)``,
    so entries a sliding window released (``-1``, :mod:`pagedkv.window`) pass where no query reads them."""
    lens = [int(x) for x in seq_lens.tolist()]
    starts = [int(x) for x in query_start_loc.tolist()]
    if starts[0] != 0:
        raise ShapeError(f"query_start_loc[0] must be 0, got {starts[0]}")
    if starts[-1] != total_q:
        raise ShapeError(f"query_start_loc[-1] = {starts[-1]} != total_q = query.shape[0] = {total_q}")
    batch = len(lens)
    for b in range(batch):  # all of query_start_loc first: a decrease also makes a neighbour's q_len too long
        if starts[b + 1] < starts[b]:
            raise ShapeError(f"query_start_loc decreases at sequence {b}: query_start_loc[{b}] = {starts[b]} > "
                             f"query_start_loc[{b + 1}] = {starts[b + 1]}")
    for b in range(batch):
        q_len = starts[b + 1] - starts[b]
        if lens[b] < 0:
            raise ShapeError(f"seq_lens[{b}] = {lens[b]} is negative")
        if q_len > lens[b]:
            raise ShapeError(f"sequence {b} has q_len {q_len} (query_start_loc[{b + 1}] - query_start_loc[{b}]) > "
                             f"seq_lens[{b}] = {lens[b]}")
        need = blocks_needed(lens[b], block_size)
        if need > tables.shape[1]:
            raise ShapeError(f"seq_lens[{b}] = {lens[b]} needs {need} blocks of block_size {block_size}, "
                             f"block_tables has {tables.shape[1]} columns")
        row = tables[b, :need]
        first = 0 if window_left < 0 else min(max(0, lens[b] - q_len - window_left) // block_size, need)
        if first:  # unread entries: checked as block 0, so an error still names the entry's own index
            row = row.clone()
            row[:first] = 0
        check_ids_in_range(f"block_tables[{b}]", row, num_blocks)
    return lens, starts
