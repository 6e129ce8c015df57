"""The ``loop`` backend: Python loops over blocks, one ``torch.cat`` per gather.

The simple design from the paged-attention tutorial: a gather slices each logical block out of the
pool and concatenates; a scatter writes block-sized slices; ``write_kv`` writes token by token. It
is the readable baseline the other backends are proved equal to, not a fast path.
"""

from __future__ import annotations

import torch

from pagedkv.attention import paged_attention_by_gather
from pagedkv.config import blocks_needed
from pagedkv.fp8 import quantize
from pagedkv.validation import attention_args, check_gather, check_scatter, normalize_block_table, write_kv_args

name = "loop"
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def gather(cache: torch.Tensor, block_table, seq_len: int, validate: bool = True) -> torch.Tensor:
    """Read logical positions ``0 .. seq_len - 1`` of one sequence.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (any strides).
        block_table: ``int32``/``int64 [>= ceil(seq_len / block_size)]`` tensor or list of ints.
        seq_len: tokens to read, ``>= 0``.
        validate: check arguments first (see :func:`pagedkv.validation.check_gather`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).

    Returns:
        A new ``[seq_len, num_kv_heads, head_dim]`` tensor, ``cache.dtype``, on ``cache.device``.

    Raises:
        ShapeError, BlockIndexError: as ``check_gather``.
    """
    if validate:
        table, seq_len = check_gather(cache, block_table, seq_len)
    else:
        table = normalize_block_table(block_table, cache.device)
    block_size = cache.shape[1]
    ids = table[: blocks_needed(seq_len, block_size)].tolist()
    parts = [cache[b, : min(block_size, seq_len - i * block_size)] for i, b in enumerate(ids)]
    if not parts:
        return cache.new_empty((0, *cache.shape[2:]))
    return torch.cat(parts)


def scatter(cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0, validate: bool = True) -> None:
    """Write ``values[j]`` to logical position ``start + j``, in place, one block slice at a time.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool, written in place.
        block_table: ``int32``/``int64`` tensor or list with ``>= ceil((start + n) / block_size)`` entries.
        values: ``[n, num_kv_heads, head_dim]``, ``cache.dtype``, on ``cache.device``.
        start: logical position of ``values[0]``.
        validate: check arguments first (:func:`pagedkv.validation.check_scatter`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError: as
        :func:`pagedkv.validation.check_scatter`; nothing is written then.
    """
    if validate:
        table, start, n = check_scatter(cache, block_table, values, start)
    else:
        table, n = normalize_block_table(block_table, cache.device), values.shape[0]
    block_size = cache.shape[1]
    ids = table.tolist()
    pos = start
    while pos < start + n:
        offset = pos % block_size
        count = min(block_size - offset, start + n - pos)
        cache[ids[pos // block_size], offset : offset + count] = values[pos - start : pos - start + count]
        pos += count


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, validate: bool = True, *, k_scale=None, v_scale=None) -> None:
    """vLLM ``reshape_and_cache``: token ``i`` goes to ``slot_mapping[i]``, token by token.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools, written in place.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype and device.
        slot_mapping: ``int64 [num_tokens]`` (int32 accepted), ``block_id * block_size + offset``;
            negative slots are skipped (padding tokens).
        validate: check arguments first (:func:`pagedkv.validation.check_write_kv`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).
        k_scale, v_scale: fp8 pools only (required there): a float or ``float32 [num_kv_heads]``;
            ``key``/``value`` then come in float32/float16/bfloat16 and are stored as
            :func:`pagedkv.fp8.quantize` (``sat(x / scale)``, round to nearest even), as vLLM's
            ``reshape_and_cache`` with ``kv_cache_dtype="fp8"``.

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError, ArgumentTypeError: as
        :func:`pagedkv.validation.check_write_kv`; nothing is written then.
    """
    w = write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale, validate=validate,
                      supported=FEATURES)
    slots = w.slots
    if w.k_scale is not None:  # fp8 pools: stored = sat(x / scale) (pagedkv.fp8.quantize)
        key, value = quantize(key, w.k_scale, k_cache.dtype), quantize(value, w.v_scale, v_cache.dtype)
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[i]
            v_cache[slot // block_size, slot % block_size] = value[i]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    validate: bool = True, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal varlen attention over paged K/V: loop-gather each sequence, then dense attention.

    Args:
        query: ``[total_q, num_q_heads, head_dim]``, packed by ``query_start_loc``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``int32 [batch, max_blocks_per_seq]``, ``-1``-padded.
        seq_lens: ``int32 [batch]`` context lengths including the new query tokens.
        query_start_loc: ``int32 [batch + 1]`` (flash-attn's ``cu_seqlens_q``).
        scale: logits multiplier, default ``1 / sqrt(head_dim)``.
        validate: check arguments first (:func:`pagedkv.validation.check_paged_attention`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).
        window_left: a query at position ``p`` sees keys ``p - window_left .. p`` (flash-attn's
            ``window_size[0]``); ``-1``: no window. Blocks before every row's window are not gathered.
        softcap: ``> 0``: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2); ``0``: off.
        alibi_slopes: ``float32 [num_q_heads]``: bias ``slope * (k_pos - q_pos)`` (after the soft-cap).
        sinks: ``float32 [num_q_heads]``: one extra logit per head in the denominator (gpt-oss).
        k_scale, v_scale: fp8 pools only (required there): a float or ``float32 [num_kv_heads]``;
            K/V are read as ``float32(stored) * scale``. Order of operations: vLLM's unified attention.

    Returns:
        ``[total_q, num_q_heads, head_dim]`` in ``query.dtype`` (math in float32).

    Raises:
        as :func:`pagedkv.validation.check_paged_attention`.
    """
    args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                          window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, supported=FEATURES)
    return paged_attention_by_gather(gather, query, k_cache, v_cache, args)


#: The tutorial's name for the loop gather.
gather_kv_from_blocks = gather
