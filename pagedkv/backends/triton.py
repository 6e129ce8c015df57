"""The ``triton`` backend: fused paged attention and token-tiled copies as Triton kernels.

``paged_attention`` reads K/V straight from the cache blocks through the block table, with an online
softmax, as vLLM's paged attention does (no gather); one kernel serves decode and prefill over a
cached prefix. ``gather``, ``scatter`` and ``write_kv`` (vLLM ``reshape_and_cache``) are copy kernels.
The kernels live in :mod:`pagedkv.backends.triton_kernels`; the readable torch version of the attention
algorithm is :mod:`pagedkv.blockwise`.

Without a CUDA device the kernels run on the CPU in Triton's interpreter: importing this module sets
``TRITON_INTERPRET=1`` (unless already set) before Triton defines any kernel. Importing it raises
``ImportError`` when Triton is missing and :class:`~pagedkv.errors.BackendUnavailableError` when
there is no CUDA device and Triton is not in interpreter mode (``TRITON_INTERPRET=0``, or ``triton``
imported before the variable was set: set it before importing triton).
"""

from __future__ import annotations

import torch

from pagedkv.backends.interpreter import choose_interpreter

choose_interpreter()

import triton  # noqa: E402,F401  (ImportError here: the registry reports the backend unavailable)

from pagedkv.backends import triton_kernels as _kernels  # noqa: E402
from pagedkv.validation import (attention_args, check_gather, check_scatter, normalize_block_table,  # noqa: E402
                                write_kv_args)

_kernels.check_runnable()  # BackendUnavailableError: no CUDA and triton was imported without the interpreter

name = "triton"
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def gather(cache: torch.Tensor, block_table, seq_len: int, validate: bool = True) -> torch.Tensor:
    """Read logical positions ``0 .. seq_len - 1`` of one sequence with a token-tiled copy kernel.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (any strides).
        block_table: ``int32``/``int64 [>= ceil(seq_len / block_size)]`` tensor or list of ints; only
            the first ``ceil(seq_len / block_size)`` entries are read.
        seq_len: tokens to read, ``>= 0``.
        validate: check arguments first (see :func:`pagedkv.validation.check_gather`).

    Returns:
        A new contiguous ``[seq_len, num_kv_heads, head_dim]`` tensor, ``cache.dtype``, on ``cache.device``.

    Raises:
        ShapeError, BlockIndexError: as ``check_gather``.
    """
    if validate:
        table, seq_len = check_gather(cache, block_table, seq_len)
    else:
        table = normalize_block_table(block_table, cache.device)
    return _kernels.gather(cache, table, int(seq_len))


def scatter(cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0, validate: bool = True) -> None:
    """Write ``values[j]`` to logical position ``start + j``, in place, with a token-tiled copy kernel.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool, written in place.
        block_table: ``int32``/``int64`` tensor or list with ``>= ceil((start + n) / block_size)`` entries.
        values: ``[n, num_kv_heads, head_dim]``, ``cache.dtype``, on ``cache.device`` (any strides).
        start: logical position of ``values[0]``.
        validate: check arguments first (see :func:`pagedkv.validation.check_scatter`).

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError: as
        :func:`pagedkv.validation.check_scatter`; nothing is written then.
    """
    if validate:
        table, start, _ = check_scatter(cache, block_table, values, start)
    else:
        table = normalize_block_table(block_table, cache.device)
    _kernels.scatter(cache, table, values, int(start))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, validate: bool = True, *, k_scale=None, v_scale=None) -> None:
    """vLLM ``reshape_and_cache``: token ``i`` of ``key``/``value`` goes to ``slot_mapping[i]``, one kernel.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools, written in place.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype and device (any strides);
            float32/float16/bfloat16 into an fp8 pool.
        slot_mapping: ``int64 [num_tokens]`` (int32 accepted), ``block_id * block_size + offset``;
            negative slots are skipped (padding tokens).
        validate: check arguments first (see :func:`pagedkv.validation.check_write_kv`).
        k_scale, v_scale: fp8 pools only (required there): a float or ``float32 [num_kv_heads]``;
            the kernel stores ``sat(x / scale)`` rounded to nearest even (:func:`pagedkv.fp8.quantize`).

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError, ArgumentTypeError: as
        :func:`pagedkv.validation.check_write_kv`; nothing is written then.
    """
    w = write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale, validate=validate,
                      supported=FEATURES)
    _kernels.write_kv(k_cache, v_cache, key, value, w.slots.contiguous(), w.k_scale, w.v_scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    validate: bool = True, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal varlen attention over paged K/V in one fused kernel (vLLM paged attention, flash-attn varlen).

    K/V are read block by block through ``block_tables`` inside the kernel (never gathered) with an
    online softmax in float32; decode (``q_len = 1``) and prefill over a cached prefix (``q_len > 1``)
    share the kernel. Each program serves one sequence, one kv head and a tile of query tokens with
    the kv head's whole GQA group, so K/V are read once per group.

    Args:
        query: ``[total_q, num_q_heads, head_dim]``, packed by ``query_start_loc`` (any strides).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides).
        block_tables: ``int32 [batch, max_blocks_per_seq]``, ``-1``-padded; only the first
            ``ceil(seq_len / block_size)`` entries of a row are read.
        seq_lens: ``int32 [batch]`` context lengths including the new query tokens.
        query_start_loc: ``int32 [batch + 1]`` (flash-attn's ``cu_seqlens_q``).
        scale: logits multiplier, default ``1 / sqrt(head_dim)``.
        validate: check arguments first (see :func:`pagedkv.validation.check_paged_attention`).
        window_left: a query at position ``p`` sees keys ``p - window_left .. p`` (flash-attn's
            ``window_size[0]``); ``-1``: no window. The key loop starts at the tile's first visible key.
        softcap: ``> 0``: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2); ``0``: off.
        alibi_slopes: ``float32 [num_q_heads]``: bias ``slope * (k_pos - q_pos)`` (after the soft-cap).
        sinks: ``float32 [num_q_heads]``: one extra logit per head in the denominator (gpt-oss).
        k_scale, v_scale: fp8 pools only (required there): a float or ``float32 [num_kv_heads]``;
            K/V are read as ``float32(stored) * scale``.

    Returns:
        ``[total_q, num_q_heads, head_dim]`` in ``query.dtype`` (math in float32). No slot at a
        position ``>= seq_len`` is loaded, nor any before the first visible key of a query tile, so
        poison there cannot reach the output.

    Raises:
        as :func:`pagedkv.validation.check_paged_attention`.
    """
    args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                          window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, supported=FEATURES)
    q_lens = [hi - lo for lo, hi in zip(args.q_starts, args.q_starts[1:])]
    # The kernel indexes seq_lens, query_start_loc, slopes, sinks and scales as dense arrays.
    dense = (lambda x: None if x is None else x.contiguous())
    return _kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens.contiguous(),
                                    query_start_loc.contiguous(), args.scale, max(q_lens, default=0),
                                    window_left=args.window_left, softcap=args.softcap,
                                    alibi_slopes=dense(args.alibi_slopes), sinks=dense(args.sinks),
                                    k_scale=dense(args.k_scale), v_scale=dense(args.v_scale))
