"""The ``indexed`` backend: one indexing op per contiguous piece, no Python loop over blocks.

``gather`` copies whole blocks with one ``index_select`` on the block dimension straight into the
output (the contiguous ``block_size * num_kv_heads * head_dim`` run of each block is copied as one
piece) and the partial last block with one more ``index_select`` of a slot slice; it allocates
nothing beyond the output and reads no block id back to the host. On the CPU, calls moving 1 MiB and
more of blocks (or slots) of a contiguous pool go through the prefetching row loops of
:mod:`pagedkv.backends.native_rows` where they are built (``index_select`` / ``index_copy_``
otherwise): at block size 1 a fragmented table puts every row on a new page, and the row-by-row
copies wait on each; at every block size they write the output with streaming stores. Below 1 MiB
(or without them), contiguous pools with blocks of at least :data:`LARGE_BLOCK_BYTES` are gathered
by one ``torch.cat`` of the block views (one ``memcpy`` a block: ``index_select`` copies each slice
through a ``TensorIterator``, which costs more than the copy of a large block; reading the ids is
free there).
``scatter`` is the write twin: one ``index_copy_`` of whole blocks on the block dimension plus at
most two ``index_copy_`` of partial blocks at the two ends of the written range. ``write_kv`` (an
arbitrary ``slot_mapping``) writes through the flat slot view of the pool with one ``index_copy_``
per pool (``kv_pool[physical_blocks, slot_indices] = K`` when the pool's block and slot dims cannot
be flattened). Writes reinterpret the rows as 16-byte (or 8-byte) elements when their layout
allows it: ``index_copy_`` copies element by element, so wider elements mean fewer of them; the bits
moved are the same.

``write_kv`` and ``paged_attention`` are also the ``torch.library`` custom ops ``pagedkv::write_kv``
(mutating both pools) and ``pagedkv::paged_attention`` (a new tensor), with fake implementations:
under ``torch.compile`` the ops are the graph's nodes (no graph break); eagerly the same functions
are called without the dispatcher. Neither synchronises with the host below validation level
``"full"``. The ops' arguments, results and errors are the contract's
(:class:`pagedkv.backends.contract.PagedKVBackend`); :func:`pagedkv.backends.ops.backend_op` validates.
"""

from __future__ import annotations

import torch

from pagedkv.attention.dense import paged_attention_by_gather, paged_attention_sync_free
from pagedkv.backends import native_rows
from pagedkv.backends.capabilities import Sizes
from pagedkv.backends.ops import backend_op
from pagedkv.attention.fp8 import quantize
from pagedkv.attention.merge import merge_attn_states as _merge
from pagedkv.validation.calls import FP8_DTYPES, AttentionArgs, WriteArgs, check_write_overlap

name = "indexed"
#: On the CPU, blocks of at least this many bytes are gathered by one ``torch.cat`` of block views.
LARGE_BLOCK_BYTES = 256 * 1024
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})
#: ``paged_attention(..., return_lse=True)`` returns ``(out, lse)``, lse ``float32 [total_q, num_q_heads]``
#: in natural log; V may be narrower or wider than K (``head_dim_v``), or a view of K (MLA).
LSE, LSE_BASE, HEAD_DIMS_V = "token_major", "e", Sizes()


@backend_op(FEATURES)
def gather(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Block-granular ``index_select`` straight into the output (a contiguous tensor); on CUDA no block id
    is read back to the host."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    full, tail = divmod(seq_len, block_size)
    on_cpu = cache.device.type == "cpu"
    block_bytes = block_size * num_kv_heads * head_dim * cache.element_size()
    # on the CPU, 1 MiB or more of whole blocks: the prefetching, streaming row gather (native_rows.py)
    native = on_cpu and full * block_bytes >= native_rows.MIN_BYTES and cache.is_contiguous() \
        and native_rows.available()
    if seq_len and on_cpu and not native and (not full or block_bytes >= LARGE_BLOCK_BYTES and cache.is_contiguous()):
        # one partial block, or a few large blocks: one torch.cat of the block slices (a memcpy each)
        # beats index_select's per-slice copy; cat allocating its output is 2 us faster than cat(out=)
        ids = table[: full + (tail > 0)].tolist()
        return torch.cat([cache[b] for b in ids[:full]] + ([cache[ids[full], :tail]] if tail else []))
    if full and not tail and not native:  # whole blocks only: index_select allocates the output itself
        ids = table if table.shape[0] == full else table[:full]
        return torch.index_select(cache, 0, ids).view(seq_len, num_kv_heads, head_dim)
    out = cache.new_empty((seq_len, num_kv_heads, head_dim))
    if full:
        blocks = out[: full * block_size].view(full, block_size, num_kv_heads, head_dim)
        if not (native and native_rows.gather_rows(cache, table[:full], blocks)):
            torch.index_select(cache, 0, table[:full], out=blocks)
    if tail:
        if on_cpu:  # reading the id costs nothing here; one slice copy is cheaper
            out[full * block_size :].copy_(cache[int(table[full]), :tail])
        else:  # no device-to-host read of the id: stays asynchronous and capturable in a CUDA graph
            torch.index_select(cache[:, :tail], 0, table[full : full + 1],
                               out=out[full * block_size :].view(1, tail, num_kv_heads, head_dim))
    return out


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
    """``dst.index_copy_(0, index, src)``: on the CPU, 1 MiB or more of rows through the native row
    scatter (native_rows.py); else on wide views of both when both allow one."""
    if native_rows.scatter_rows(dst, index, src):  # False, writing nothing, off the CPU and where it does not apply
        return
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


@backend_op(FEATURES)
def scatter(cache: torch.Tensor, table: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Whole blocks with one indexed write: the written range is cut into a partial first block, whole
    blocks and a partial last block, each one ``index_copy_`` on the block dimension (no per-token index,
    no temporary copy of ``values``)."""
    n = values.shape[0]
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
        _index_copy(cache, table[block : block + full],
                    values[done : done + full * block_size].unflatten(0, (full, block_size)))
        done, block = done + full * block_size, block + full
    if done < n:  # partial last block
        _index_copy(cache[:, : n - done], table[block : block + 1], values[done:].unsqueeze(0))


@backend_op(FEATURES)
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             w: WriteArgs) -> None:
    """One indexed write per pool (fp8 bytes through a ``uint8`` view: CPU ``index_copy_`` has no fp8
    kernel); registered as the custom op ``pagedkv::write_kv`` (see :func:`write_kv_op`)."""
    if torch.compiler.is_compiling():
        torch.ops.pagedkv.write_kv(k_cache, v_cache, key, value, w.slots, w.k_scale, w.v_scale, w.check_overlap)
    else:  # eager: the same function without the dispatcher's ~40 us a call
        write_kv_eager(k_cache, v_cache, key, value, w.slots, w.k_scale, w.v_scale, w.check_overlap)


def write_kv_eager(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slots: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   check_overlap: bool) -> None:
    """``write_kv`` on normalised arguments (``slots`` int64, scales ``float32 [num_kv_heads]`` for fp8 pools).

    No device-to-host synchronisation: on the CPU the padding rows are dropped after reading the slots
    (host memory), elsewhere :func:`write_slots_sync_free` writes them onto a real row's slot.
    ``check_overlap``: run the memory-overlap checks here (they were skipped while ``torch.compile`` traced).
    """
    if check_overlap:
        check_write_overlap(k_cache, v_cache, key, value)
    if k_scale is not None:  # fp8 pools: stored = sat(x / scale) (pagedkv.attention.fp8.quantize)
        key, value = quantize(key, k_scale, k_cache.dtype), quantize(value, v_scale, v_cache.dtype)
    if slots.device.type != "cpu":
        write_slots_sync_free(k_cache, v_cache, key, value, slots)
        return
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    _write_slots(k_cache, slots, key)
    _write_slots(v_cache, slots, value)


#: The registered op (``torch.ops.pagedkv.write_kv``): the graph node under ``torch.compile``.
write_kv_op = torch.library.custom_op("pagedkv::write_kv", mutates_args=("k_cache", "v_cache"))(
    write_kv_eager)


@write_kv_op.register_fake
def _(k_cache, v_cache, key, value, slots, k_scale, v_scale, check_overlap) -> None:
    return None


def write_slots_sync_free(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          slots: torch.Tensor) -> None:
    """``write_kv``'s writes without reading ``slots`` on the host (capturable in a CUDA graph).

    A padding row (negative slot) is redirected to the slot of the row with the largest slot and
    carries that row's values, so the slot is written twice with the same bits (whichever write lands
    last); when every row is padding, slot 0 is rewritten with its own value.
    """
    if slots.numel() == 0:
        return
    keep = slots >= 0
    top = torch.argmax(slots).reshape(1)
    any_real = keep.any()
    rows = torch.where(keep, torch.arange(slots.shape[0], device=slots.device), top)
    target = torch.where(keep, slots, torch.where(any_real, slots[top], torch.zeros_like(slots)))
    for cache, x in ((k_cache, key), (v_cache, value)):
        own = cache[0, 0].unsqueeze(0).expand_as(x)  # slot 0's current value (all-padding case)
        src = torch.where(any_real, x.index_select(0, rows), own)
        _write_slots(cache, target, src.contiguous())


@backend_op(FEATURES)
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    args: AttentionArgs) -> torch.Tensor:
    """Indexed-gather each sequence, then dense attention in float32 (blocks before every row's window
    are not gathered); bit-identical to the ``loop`` backend at level ``"full"``. Below it, the custom op
    ``pagedkv::paged_attention`` (:func:`paged_attention_op`)."""
    if args.host_seq_lens is not None or (args.return_lse and query.device.type == "cpu"):
        return paged_attention_by_gather(gather, query, k_cache, v_cache, args)  # "full": lengths on the host
    if args.return_lse:  # not a registered op's output: the sync-free path, eagerly
        return paged_attention_sync_free(query, k_cache, v_cache, args.block_tables, args.seq_lens_tensor,
                                         args.query_start_loc, args.scale, window_left=args.window_left,
                                         softcap=args.softcap, alibi_slopes=args.alibi_slopes, sinks=args.sinks,
                                         k_scale=args.k_scale, v_scale=args.v_scale, return_lse=True)
    call = torch.ops.pagedkv.paged_attention if torch.compiler.is_compiling() else paged_attention_eager
    return call(query, k_cache, v_cache, args.block_tables, args.seq_lens_tensor, args.query_start_loc, args.scale,
                args.window_left, args.softcap, args.alibi_slopes, args.sinks, args.k_scale, args.v_scale)


def paged_attention_eager(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, window_left: int, softcap: float, alibi_slopes: torch.Tensor | None,
                          sinks: torch.Tensor | None, k_scale: torch.Tensor | None,
                          v_scale: torch.Tensor | None) -> torch.Tensor:
    """``paged_attention`` on normalised arguments, without a device-to-host synchronisation.

    On the CPU the lengths are read (host memory) and each sequence is gathered, as at level ``"full"``;
    elsewhere :func:`pagedkv.attention.dense.paged_attention_sync_free` attends over each row's padded table.
    """
    features = dict(window_left=window_left, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                    k_scale=k_scale, v_scale=v_scale)
    if query.device.type != "cpu":
        return paged_attention_sync_free(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                         **features)
    args = AttentionArgs(block_tables, None, None, scale, query.shape[1] // k_cache.shape[2], **features,
                         seq_lens_tensor=seq_lens, query_start_loc=query_start_loc)
    return paged_attention_by_gather(gather, query, k_cache, v_cache, args).contiguous()


#: The registered op (``torch.ops.pagedkv.paged_attention``): the graph node under ``torch.compile``.
paged_attention_op = torch.library.custom_op("pagedkv::paged_attention", mutates_args=())(
    paged_attention_eager)


@paged_attention_op.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window_left, softcap, alibi_slopes,
      sinks, k_scale, v_scale) -> torch.Tensor:
    return query.new_empty((*query.shape[:2], v_cache.shape[-1]))


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagedkv.attention.merge.merge_attn_states` with this backend's LSE layout and base (token-major,
    natural log): ``(out [total_q, num_heads, head_dim_v], lse float32 [total_q, num_heads])``."""
    return _merge(prefix_out, prefix_lse, suffix_out, suffix_lse, layout=LSE, base=LSE_BASE)
