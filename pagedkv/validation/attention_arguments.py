"""The checks of a whole ``paged_attention`` call, at the three validation levels, and what they return.

``paged_attention`` takes the most metadata of any op (packed varlen queries in flash-attn's
``cu_seqlens_q`` convention, per-sequence lengths and block tables, and the optional features of
vLLM's unified attention: window, softcap, ALiBi, sinks, fp8 scales), so its checks and its
normalised arguments (:class:`AttentionArgs`) are one module; :mod:`pagedkv.validation.calls` re-exports
them next to the other ops' checks. Error types follow the backend contract (``docs/validation.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pagedkv.validation.arguments import (FP8_DTYPES, as_head_vector, as_scale, check_cache_pair, check_features,
                               check_head_vector, check_ids_in_range, check_int_tensor, check_like_cache,
                               check_num_splits, check_pool_scales, check_scale, check_softcap, check_tensor,
                               check_window, check_in_layout)
from pagedkv.cache.config import DTYPES, blocks_needed
from pagedkv.errors import ArgumentTypeError, DeviceMismatchError, DTypeMismatchError, ShapeError
from pagedkv.validation.levels import validation_level


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
    return_lse: bool = False  # also return the log-sum-exp of each row's visible logits

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
                          supported: frozenset | None = None, layout: object = "NHD") -> AttentionArgs:
    """Validate ``paged_attention`` (packed varlen, flash-attn's ``cu_seqlens_q`` convention; level ``"full"``).

    ``layout``: the pools', as ``Capabilities.layout`` declares it (``"HND"``: ``[num_blocks, num_kv_heads,
    block_size, head_dim]``, FlashInfer's and vLLM's head-major pools): the checks read the pools through
    their logical view (:func:`~pagedkv.validation.arguments.logical_pools`; no copy).

    The optional features (see ``docs/contract.md``; vLLM's unified attention and flash-attn's names):
    ``window_left`` (int ``>= -1``), ``softcap`` (float ``>= 0``), ``alibi_slopes`` and ``sinks``
    (``[num_q_heads]`` float32, float16 or bfloat16 tensors on the query's device, or sequences of
    floats, converted once to float32: :func:`~pagedkv.validation.arguments.check_head_vector`; sinks may be
    ``-inf``), ``k_scale`` / ``v_scale`` (required for, and only for, an fp8 pool; see
    :func:`~pagedkv.validation.arguments.check_kv_scale`). With an fp8 pool the query is float32/float16/bfloat16.
    ``supported``: the backend's ``FEATURES``; a feature in use that it does not declare is refused
    (:func:`~pagedkv.validation.arguments.check_features`).

    Returns:
        :class:`AttentionArgs`: ``block_tables`` as ``int64`` on the caches' device, ``host_seq_lens`` and
        ``host_q_starts`` (``query_start_loc``) as Python ints, ``scale`` (``head_dim ** -0.5`` when ``None``),
        ``num_queries_per_kv`` (the GQA group), the features normalised (``window_left``, ``softcap``,
        ``alibi_slopes`` / ``sinks`` as float32, fp8 scales as float32 ``[num_kv_heads]``).

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
        ArgumentValueError: an unknown ``layout``, or one with no view (a copy pair).
    """
    return check_in_layout(layout, lambda k, v: attention_args(
        query, k, v, block_tables, seq_lens, query_start_loc, scale, "full", window_left=window_left,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        supported=supported), k_cache=k_cache, v_cache=v_cache)


def attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                   validate: object = "full", *, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                   k_scale=None, v_scale=None, supported: frozenset | None = None,
                   num_splits=None, return_lse=False) -> AttentionArgs:
    """:func:`check_paged_attention` at any level, plus ``num_splits``
    (:func:`~pagedkv.validation.arguments.check_num_splits`; passed on as ``AttentionArgs.num_splits``).

    ``"metadata"`` skips what needs the data: ``query_start_loc``'s values (first 0, last ``total_q``,
    non-decreasing), ``seq_lens`` against ``q_len`` and the table width, the block ids' range, and the
    values of slopes, sinks and tensor scales. ``"none"`` only normalises (the caller checked). Below
    ``"full"`` the result carries the metadata tensors and no host copy of them.
    """
    level = validation_level(validate)
    splits = (None if num_splits is None else int(num_splits)) if level == "none" else check_num_splits(num_splits)
    if type(return_lse) is not bool:
        raise ArgumentTypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    args = _attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, level,
                           window_left, softcap, alibi_slopes, sinks, k_scale, v_scale, supported, splits)
    return replace(args, return_lse=True) if return_lse else args


def _attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, level, window_left,
                    softcap, alibi_slopes, sinks, k_scale, v_scale, supported, splits) -> AttentionArgs:
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
    so entries a sliding window released (``-1``, :mod:`pagedkv.cache.window`) pass where no query reads them."""
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
