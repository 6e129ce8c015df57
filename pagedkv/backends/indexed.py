"""The ``indexed`` backend: one indexing op each way, no Python loop over blocks.

``gather`` copies whole blocks with one ``index_select`` on the block dimension straight into the
output (the contiguous ``block_size * num_kv_heads * head_dim`` run of each block is copied as one
piece) and the partial last block with one more slice copy; it allocates nothing beyond the output.
``scatter`` and ``write_kv`` write through the flat slot view of the pool with ``index_copy_``
(one advanced-indexing write, ``kv_pool[physical_blocks, slot_indices] = K`` when the pool's block
and slot dims cannot be flattened).

The tutorial's literal element-wise formulation is kept as :func:`gather_kv_from_blocks_v2`.
"""

from __future__ import annotations

import torch

from ..attention import paged_attention_by_gather
from ..validation import attention_args, check_gather, check_scatter, check_write_kv, normalize_block_table

name = "indexed"


def gather(cache: torch.Tensor, block_table, seq_len: int, validate: bool = True) -> torch.Tensor:
    """Read logical positions ``0 .. seq_len - 1`` of one sequence with block-granular ``index_select``.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (any strides).
        block_table: ``int32``/``int64 [>= ceil(seq_len / block_size)]`` tensor or list of ints.
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
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    out = cache.new_empty((seq_len, num_kv_heads, head_dim))
    full, tail = divmod(seq_len, block_size)
    if full:
        torch.index_select(cache, 0, table[:full], out=out[: full * block_size].view(full, block_size, num_kv_heads, head_dim))
    if tail:
        out[full * block_size :] = cache[table[full], :tail]
    return out


def gather_kv_from_blocks_v2(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The tutorial's element-wise gather: ``cache[physical_blocks, slot_indices]``, one index per token.

    Same contract as :func:`gather`; kept for comparison (it indexes token by token, so it moves
    ``num_kv_heads * head_dim`` elements per index instead of a whole block).
    """
    table, seq_len = check_gather(cache, block_table, seq_len)
    positions = torch.arange(seq_len, device=cache.device)
    return cache[table[positions // cache.shape[1]], positions % cache.shape[1]]


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache`` viewed as ``[num_slots, H, D]`` gets ``values[i]`` at ``slots[i]`` (int64, all valid)."""
    block_size = cache.shape[1]
    try:
        flat = cache.view(-1, *cache.shape[2:])
    except RuntimeError:  # block and slot dims not mergeable (a strided view): index both dims
        cache[slots // block_size, slots % block_size] = values
        return
    flat.index_copy_(0, slots, values)


def scatter(cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0, validate: bool = True) -> None:
    """Write ``values[j]`` to logical position ``start + j`` with one indexed write.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool, written in place.
        block_table: ``int32``/``int64`` tensor or list with ``>= ceil((start + n) / block_size)`` entries.
        values: ``[n, num_kv_heads, head_dim]``, ``cache.dtype``, on ``cache.device``.
        start: logical position of ``values[0]``.

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError: as
        :func:`pagedkv.validation.check_scatter`; nothing is written then.
    """
    if validate:
        table, start, n = check_scatter(cache, block_table, values, start)
    else:
        table, n = normalize_block_table(block_table, cache.device), values.shape[0]
    if n == 0:
        return
    block_size = cache.shape[1]
    positions = torch.arange(start, start + n, device=cache.device, dtype=torch.int64)
    slots = table[positions // block_size] * block_size + positions % block_size
    _write_slots(cache, slots, values)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, validate: bool = True) -> None:
    """vLLM ``reshape_and_cache`` with one indexed write per pool.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools, written in place.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype and device.
        slot_mapping: ``int64 [num_tokens]`` (int32 accepted); negative slots are skipped.

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError: as
        :func:`pagedkv.validation.check_write_kv`; nothing is written then.
    """
    slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping) if validate else slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    _write_slots(k_cache, slots, key)
    _write_slots(v_cache, slots, value)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    validate: bool = True) -> torch.Tensor:
    """Causal varlen attention over paged K/V: indexed-gather each sequence, then dense attention.

    Same arguments, result and errors as :func:`pagedkv.backends.loop.paged_attention`; with equal
    inputs the two return bit-identical outputs (same gathered K/V, same attention op).
    """
    args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate)
    return paged_attention_by_gather(gather, query, k_cache, v_cache, args)
