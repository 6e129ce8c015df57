"""The ``indexed`` backend: one indexing op per contiguous piece, no Python loop over blocks.

``gather`` copies whole blocks with one ``index_select`` on the block dimension straight into the
output (the contiguous ``block_size * num_kv_heads * head_dim`` run of each block is copied as one
piece) and the partial last block with one more ``index_select`` of a slot slice; it allocates
nothing beyond the output and reads no block id back to the host.
``scatter`` is the write twin: one ``index_copy_`` of whole blocks on the block dimension plus at
most two ``index_copy_`` of partial blocks at the two ends of the written range. ``write_kv`` (an
arbitrary ``slot_mapping``) writes through the flat slot view of the pool with one ``index_copy_``
per pool (``kv_pool[physical_blocks, slot_indices] = K`` when the pool's block and slot dims cannot
be flattened). Writes reinterpret the rows as 16-byte (or 8-byte) elements when their layout
allows it: ``index_copy_`` copies element by element, so wider elements mean fewer of them; the bits
moved are the same.

The tutorial's literal element-wise formulation is kept as :func:`gather_kv_from_blocks_v2`.
"""

from __future__ import annotations

import torch

from pagedkv.attention import paged_attention_by_gather
from pagedkv.fp8 import quantize
from pagedkv.validation import (FP8_DTYPES, attention_args, check_gather, check_scatter, normalize_block_table,
                                write_kv_args)

name = "indexed"
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


def gather(cache: torch.Tensor, block_table, seq_len: int, validate: bool = True) -> torch.Tensor:
    """Read logical positions ``0 .. seq_len - 1`` of one sequence with block-granular ``index_select``.

    Args:
        cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (any strides).
        block_table: ``int32``/``int64 [>= ceil(seq_len / block_size)]`` tensor or list of ints.
        seq_len: tokens to read, ``>= 0``.
        validate: check arguments first (see :func:`pagedkv.validation.check_gather`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).

    Returns:
        A new contiguous ``[seq_len, num_kv_heads, head_dim]`` tensor, ``cache.dtype``, on ``cache.device``.

    Raises:
        ShapeError, BlockIndexError: as ``check_gather``.
    """
    if validate:
        table, seq_len = check_gather(cache, block_table, seq_len)
    elif isinstance(block_table, torch.Tensor) and block_table.device == cache.device \
            and block_table.dtype in (torch.int32, torch.int64):
        table = block_table  # index_select takes int32 and int64 ids as they are
    else:
        table = normalize_block_table(block_table, cache.device)
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    full, tail = divmod(seq_len, block_size)
    if not full and tail and cache.device.type == "cpu":  # one partial block: a single copy into a new tensor
        return cache[int(table[0]), :tail].clone(memory_format=torch.contiguous_format)
    if full and not tail:  # whole blocks only: index_select allocates the (contiguous) output itself
        ids = table if table.shape[0] == full else table[:full]
        return torch.index_select(cache, 0, ids).view(seq_len, num_kv_heads, head_dim)
    out = cache.new_empty((seq_len, num_kv_heads, head_dim))
    if full:
        torch.index_select(cache, 0, table[:full], out=out[: full * block_size].view(full, block_size, num_kv_heads, head_dim))
    if tail:
        if cache.device.type == "cpu":  # reading the id costs nothing here; one slice copy is cheaper
            out[full * block_size :].copy_(cache[int(table[full]), :tail])
        else:  # no device-to-host read of the id: stays asynchronous and capturable in a CUDA graph
            torch.index_select(cache[:, :tail], 0, table[full : full + 1],
                               out=out[full * block_size :].view(1, tail, num_kv_heads, head_dim))
    return out


def gather_kv_from_blocks_v2(cache: torch.Tensor, block_table, seq_len: int) -> torch.Tensor:
    """The tutorial's element-wise gather: ``cache[physical_blocks, slot_indices]``, one index per token.

    Same contract as :func:`gather`; kept for comparison (it indexes token by token, so it moves
    ``num_kv_heads * head_dim`` elements per index instead of a whole block).
    """
    table, seq_len = check_gather(cache, block_table, seq_len)
    positions = torch.arange(seq_len, device=cache.device)
    return cache[table[positions // cache.shape[1]], positions % cache.shape[1]]


def _wide(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` with its last dim reinterpreted as 16- or 8-byte elements (same bytes), or None if impossible."""
    for dtype, size in ((torch.complex128, 16), (torch.float64, 8)):
        ratio = size // x.element_size()
        if ratio > 1 and x.shape[-1] % ratio == 0:
            try:
                return x.view(dtype)
            except RuntimeError:  # last dim not contiguous, or a stride / offset not divisible
                continue
    return None


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as ``uint8`` (same bytes): CPU ``index_copy_`` has no fp8 kernel; anything else as is."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


def _index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(0, index, src)``, on wide views of both when both allow one."""
    dst, src = _bytes(dst), _bytes(src)
    wide_dst, wide_src = _wide(dst), _wide(src)
    if wide_dst is not None and wide_src is not None and wide_dst.dtype == wide_src.dtype:
        dst, src = wide_dst, wide_src
    dst.index_copy_(0, index, src)


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache`` viewed as ``[num_slots, H, D]`` gets ``values[i]`` at ``slots[i]`` (int64, all valid)."""
    cache, values = _bytes(cache), _bytes(values)
    block_size = cache.shape[1]
    try:
        flat = cache.view(-1, *cache.shape[2:])
    except RuntimeError:  # block and slot dims not mergeable (a strided view): index both dims
        wide_cache, wide_values = _wide(cache), _wide(values)
        if wide_cache is not None and wide_values is not None and wide_cache.dtype == wide_values.dtype:
            cache, values = wide_cache, wide_values
        cache[slots // block_size, slots % block_size] = values
        return
    _index_copy(flat, slots, values)


def scatter(cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0, validate: bool = True) -> None:
    """Write ``values[j]`` to logical position ``start + j``: whole blocks with one indexed write.

    The written range is cut into a partial first block, whole blocks and a partial last block;
    each piece is one ``index_copy_`` on the block dimension (at most three calls, no per-token
    index and no temporary copy of ``values``).

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
    if n == 0:
        return
    block_size = cache.shape[1]
    block, offset = divmod(start, block_size)
    done = 0
    if offset:  # partial first block
        count = min(block_size - offset, n)
        _index_copy(cache[:, offset : offset + count], table[block : block + 1], values[:count].unsqueeze(0))
        done, block = count, block + 1
    full = (n - done) // block_size
    if full:
        _index_copy(cache, table[block : block + full], values[done : done + full * block_size].unflatten(0, (full, block_size)))
        done, block = done + full * block_size, block + full
    if done < n:  # partial last block
        _index_copy(cache[:, : n - done], table[block : block + 1], values[done:].unsqueeze(0))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, validate: bool = True, *, k_scale=None, v_scale=None) -> None:
    """vLLM ``reshape_and_cache`` with one indexed write per pool.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools, written in place.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype and device.
        slot_mapping: ``int64 [num_tokens]`` (int32 accepted); negative slots are skipped.
        validate: check arguments first (:func:`pagedkv.validation.check_write_kv`);
            ``False`` is the fast path for a caller that already validated: no checks, no host
            sync, and a bad argument is undefined behaviour (see ``docs/validation.md``).
        k_scale, v_scale: fp8 pools only, as :func:`pagedkv.backends.loop.write_kv` (fp8 bytes are
            written through a ``uint8`` view: CPU ``index_copy_`` has no fp8 kernel).

    Raises:
        ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError, ArgumentTypeError: as
        :func:`pagedkv.validation.check_write_kv`; nothing is written then.
    """
    w = write_kv_args(k_cache, v_cache, key, value, slot_mapping, k_scale=k_scale, v_scale=v_scale, validate=validate,
                      supported=FEATURES)
    slots = w.slots
    if w.k_scale is not None:  # fp8 pools: stored = sat(x / scale) (pagedkv.fp8.quantize)
        key, value = quantize(key, w.k_scale, k_cache.dtype), quantize(value, w.v_scale, v_cache.dtype)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    _write_slots(k_cache, slots, key)
    _write_slots(v_cache, slots, value)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
                    validate: bool = True, *, window_left: int = -1, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    k_scale=None, v_scale=None) -> torch.Tensor:
    """Causal varlen attention over paged K/V: indexed-gather each sequence, then dense attention.

    Same arguments (``validate`` and the optional features included), result and errors as
    :func:`pagedkv.backends.loop.paged_attention`; with equal
    inputs the two return bit-identical outputs (same gathered K/V, same attention op).
    """
    args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                          window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, supported=FEATURES)
    return paged_attention_by_gather(gather, query, k_cache, v_cache, args)
