"""Mutation testing: faulty backends the property suite must reject, and ``python -m pagedkv mutants``.

Each mutant is the ``indexed`` backend with exactly one fault that paged-KV engines have shipped:
a class overriding one method (or one helper), whose docstring names the real fault it models. A
suite that lets a mutant pass has a hole: strengthen the strategies or the checks, never drop the
mutant.

Load one as the implementation under test like any candidate::

    pytest --pagedkv-impl=pagedkv.tools.mutants:gqa_modulo -x
    python -m pagedkv mutants --profile ci            # every mutant, table of results
    python -m pagedkv mutants --only scale_ignored --via-pytest

:mod:`pagedkv.tools.mutants.kill_table` runs every registered property (:mod:`pagedkv.testing.registry`), then
the shipped regression case files, against a mutant and stops at the first failure: the mutant is
*killed*. ``--via-pytest`` runs the conformance suite itself against the mutant instead.
"""

from __future__ import annotations

import math

import torch

from pagedkv.attention.dense import attend
from pagedkv.backends import indexed
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.config import blocks_needed
from pagedkv.validation.calls import attention_args, check_gather, check_scatter, check_write_kv, normalize_block_table


# -- the base: the indexed backend as a class -------------------------------------------------------------
class IndexedBackend:
    """The ``indexed`` backend as overridable methods; ``paged_attention`` is split into
    :meth:`context` (read one sequence's K or V) and :meth:`attend` (dense attention of its rows) so a
    mutant changes one step. Unmutated, it is bit-identical to :mod:`pagedkv.backends.indexed`."""

    name = "indexed"
    cache_class = PagedKVCache
    FEATURES = indexed.FEATURES

    def gather(self, cache: torch.Tensor, block_table, seq_len: int, validate: bool = True) -> torch.Tensor:
        """As :func:`pagedkv.backends.indexed.gather`."""
        return indexed.gather(cache, block_table, seq_len, validate=validate)

    def scatter(self, cache: torch.Tensor, block_table, values: torch.Tensor, start: int = 0,
                validate: bool = True) -> None:
        """As :func:`pagedkv.backends.indexed.scatter`."""
        indexed.scatter(cache, block_table, values, start, validate=validate)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, validate: bool = True, **scales) -> None:
        """As :func:`pagedkv.backends.indexed.write_kv` (``k_scale``, ``v_scale`` for fp8 pools)."""
        indexed.write_kv(k_cache, v_cache, key, value, slot_mapping, validate=validate, **scales)

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float | None = None, validate: bool = True, **features) -> torch.Tensor:
        """As :func:`pagedkv.backends.indexed.paged_attention`: per sequence, :meth:`context` then
        :meth:`attend` (with features, from :meth:`first_block` on, then :meth:`attend_features`)."""
        args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                              supported=self.FEATURES, **features)
        out = torch.empty_like(query)
        bs = k_cache.shape[1]
        for b, seq_len in enumerate(args.seq_lens):
            lo, hi = args.q_starts[b], args.q_starts[b + 1]
            if hi == lo:
                continue
            table = self.table_row(args.block_tables, b, args.seq_lens, bs)
            if not args.features:
                key = self.context(k_cache, table, seq_len)
                value = self.context(v_cache, table, seq_len)
                out[lo:hi] = self.attend(query[lo:hi], key, value, args.scale, seq_len)
                continue
            first = self.first_block(args, seq_len, hi - lo, bs)
            key = self.context(k_cache, table[first:], seq_len - first * bs)
            value = self.context(v_cache, table[first:], seq_len - first * bs)
            out[lo:hi] = self.attend_features(query[lo:hi], key, value, args, first * bs)
        return out

    # steps of paged_attention
    def table_row(self, block_tables: torch.Tensor, b: int, seq_lens: list[int], block_size: int) -> torch.Tensor:
        """Row ``b`` of ``block_tables`` (``int64 [batch, width]``)."""
        return block_tables[b]

    def context(self, cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``[L, num_kv_heads, head_dim]`` keys or values of one sequence (``L == seq_len`` unmutated)."""
        return self.gather(cache, table, seq_len, validate=False)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               seq_len: int) -> torch.Tensor:
        """Causal attention of the sequence's last ``q_len`` rows over ``key``/``value``."""
        return attend(query, key, value, scale)

    # steps of paged_attention with optional features (window, softcap, ALiBi, sinks, fp8 scales)
    def first_block(self, args, seq_len: int, q_len: int, block_size: int) -> int:
        """The first block any query of the sequence can see (0 without a window)."""
        return 0 if args.window_left < 0 else max(0, seq_len - q_len - args.window_left) // block_size

    def attend_features(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, args,
                        start: int) -> torch.Tensor:
        """:func:`pagedkv.attention.dense.attend` with the call's features; ``key[0]`` sits at position ``start``."""
        return attend(query, key, value, args.scale, **features_of(args))


def features_of(args, **changes) -> dict:
    """The feature keyword arguments of :func:`pagedkv.attention.dense.attend` from validated ``args``."""
    return {**dict(window_left=args.window_left, softcap=args.softcap, alibi_slopes=args.alibi_slopes,
                   sinks=args.sinks, k_scale=args.k_scale, v_scale=args.v_scale), **changes}


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
           kv_head: str = "group", causal: str = "bottom_right", stable_softmax: bool = True,
           mask: bool = True, seq_len: int | None = None) -> torch.Tensor:
    """:func:`pagedkv.attention.dense.attend` with one knob per fault (float32 math, ``[q, Hq, D]`` out).

    ``kv_head``: ``"group"`` (``h // group``, right) or ``"modulo"`` (``h % num_kv_heads``).
    ``causal``: ``"bottom_right"`` (row ``i`` at ``L - q + i``, right) or ``"top_left"`` (row ``i`` at ``i``).
    ``stable_softmax``: subtract the row max before ``exp``. ``mask``: apply the causal mask at all.
    ``seq_len``: the sequence's length when ``key`` holds more rows than it (default ``key.shape[0]``).
    """
    q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_q_heads // num_kv_heads
    if kv_head == "group":
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    else:
        key, value = key.repeat(1, group, 1), value.repeat(1, group, 1)
    q = query.float().permute(1, 0, 2)  # [Hq, q, D]
    k, v = key.float().permute(1, 0, 2), value.float().permute(1, 0, 2)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hq, q, L]
    length = key.shape[0]
    if mask:
        offset = (length if seq_len is None else seq_len) - q_len if causal == "bottom_right" else 0
        rows = torch.arange(q_len, device=query.device).unsqueeze(1) + offset
        allowed = torch.arange(length, device=query.device).unsqueeze(0) <= rows
        logits = logits.masked_fill(~allowed, float("-inf"))
    if stable_softmax:
        probs = torch.softmax(logits, dim=-1)
    else:
        e = torch.exp(logits)
        probs = e / e.sum(-1, keepdim=True)
    return torch.matmul(probs, v).permute(1, 0, 2).to(query.dtype)


# -- the mutants ---------------------------------------------------------------------------------------
class OffByOneLastBlock(IndexedBackend):
    """Off by one at a block boundary: the number of whole blocks is computed as
    ``(seq_len - 1) // block_size`` and the tail as ``seq_len % block_size``, so a sequence whose
    length is an exact multiple of ``block_size`` never copies its last block (those rows stay zero)."""

    name = "off_by_one_last_block"

    def gather(self, cache, block_table, seq_len, validate=True):
        table, seq_len = check_gather(cache, block_table, seq_len) if validate else \
            (normalize_block_table(block_table, cache.device), seq_len)
        bs = cache.shape[1]
        out = cache.new_zeros((seq_len, *cache.shape[2:]))
        full, tail = (seq_len - 1) // bs if seq_len else 0, seq_len % bs  # FAULT: loses a block at k * bs
        if full:
            out[: full * bs] = cache[table[:full]].flatten(0, 1)
        if tail:
            out[full * bs: full * bs + tail] = cache[table[full], :tail]
        return out


class ScatterDropsStartOffset(IndexedBackend):
    """A write that starts inside a block loses its offset: the destination of ``values[j]`` is
    computed from the start *block* plus ``j``, so a chunk appended at ``start % block_size != 0``
    lands at offset 0 of its first block (overwriting earlier tokens)."""

    name = "scatter_drops_start_offset"

    def scatter(self, cache, block_table, values, start=0, validate=True):
        table, start, n = check_scatter(cache, block_table, values, start) if validate else \
            (normalize_block_table(block_table, cache.device), start, values.shape[0])
        if n == 0:
            return
        bs = cache.shape[1]
        rel = torch.arange(n, device=cache.device) + (start // bs) * bs  # FAULT: should be + start
        cache[table[rel // bs], rel % bs] = values


class PaddingReadAsBlock(IndexedBackend):
    """The ``-1`` padding of ``block_tables`` read as a block: attention walks every column of the
    table (``max_blocks_per_seq``) and only masks the logits of columns past the sequence, so the
    block that index ``-1`` wraps to (the pool's last block, NaN/inf poison included) flows into
    ``probs @ V`` as ``0 * NaN``; a padding value ``>= num_blocks`` reads out of bounds."""

    name = "padding_read_as_block"

    def context(self, cache, table, seq_len):
        pad = table[blocks_needed(seq_len, cache.shape[1]):]  # FAULT: padding columns read as blocks
        return torch.cat((self.gather(cache, table, seq_len, validate=False), cache[pad].flatten(0, 1)))

    def attend(self, query, key, value, scale, seq_len):
        return _dense(query, key, value, scale, seq_len=seq_len)  # masks the padding's logits, not its values


class _NoCowCache(PagedKVCache):
    """A cache manager whose ``append`` believes every block is exclusively owned."""

    def append(self, seq_id, token_ids):
        self.allocator.ref_count = lambda block: 1  # FAULT: the shared-block test always says "not shared"
        try:
            return super().append(seq_id, token_ids)
        finally:
            del self.allocator.ref_count


class NoCopyOnWrite(IndexedBackend):
    """A shared block written without copy-on-write: after a fork mid-block, appending to one
    sequence writes into the partially filled block the other sequence still reads (a cache-manager
    fault: the reference-count test before the append is skipped)."""

    name = "no_copy_on_write"
    cache_class = _NoCowCache


class GqaModulo(IndexedBackend):
    """GQA head mapping ``h % num_kv_heads`` instead of ``h // (num_q_heads // num_kv_heads)``
    (K/V expanded with ``repeat`` where ``repeat_interleave`` was meant)."""

    name = "gqa_modulo"

    def attend(self, query, key, value, scale, seq_len):
        return _dense(query, key, value, scale, kv_head="modulo")


class CausalTopLeft(IndexedBackend):
    """A wrong causal offset for a cached prefix: the mask is aligned top-left (row ``i`` sees
    positions ``<= i``) instead of bottom-right (``<= seq_len - q_len + i``), so prefill over a
    cached prefix (and decode) ignores the prefix (flash-attn changed this alignment in 2.1)."""

    name = "causal_top_left"

    def attend(self, query, key, value, scale, seq_len):
        return _dense(query, key, value, scale, causal="top_left")


class TailUnmasked(IndexedBackend):
    """The tail of the last block is not masked: the decode path (``q_len == 1``) reads whole
    blocks and attends to every slot of them, positions ``>= seq_len`` (poison, stale tokens) included."""

    name = "tail_unmasked"

    def context(self, cache, table, seq_len):
        return cache[table[: blocks_needed(seq_len, cache.shape[1])]].flatten(0, 1)  # whole blocks

    def attend(self, query, key, value, scale, seq_len):
        if query.shape[0] == 1:  # FAULT: decode attends to ceil(seq_len / bs) whole blocks, no seq_len mask
            return _dense(query, key, value, scale, mask=False)
        return attend(query, key[:seq_len], value[:seq_len], scale)

class ScaleIgnored(IndexedBackend):
    """An explicit ``scale`` ignored: the kernel always uses ``1 / sqrt(head_dim)``."""

    name = "scale_ignored"

    def attend(self, query, key, value, scale, seq_len):
        return attend(query, key, value, 1.0 / math.sqrt(query.shape[-1]))  # FAULT: scale dropped


class SoftmaxNoMax(IndexedBackend):
    """Softmax without max subtraction: ``exp(logits) / sum(exp(logits))`` overflows to ``inf / inf``
    (NaN) once a logit passes ~88 in float32."""

    name = "softmax_no_max"

    def attend(self, query, key, value, scale, seq_len):
        return _dense(query, key, value, scale, stable_softmax=False)


class BatchStride(IndexedBackend):
    """A batch stride bug: the kernel indexes the flattened ``block_tables`` with a row stride of
    ``ceil(max(seq_lens) / block_size)`` (the blocks the longest sequence needs) instead of the
    tensor's real row stride, so every sequence after the first reads another row's blocks when the
    table is wider than that."""

    name = "batch_stride"

    def table_row(self, block_tables, b, seq_lens, block_size):
        stride = max(blocks_needed(n, block_size) for n in seq_lens)  # FAULT: should be block_tables.stride(0)
        flat = block_tables.reshape(-1)
        row = flat[b * stride: b * stride + block_tables.shape[1]]
        return torch.cat((row, row.new_full((block_tables.shape[1] - row.numel(),), -1)))


class Float32SlotGather(IndexedBackend):
    """Index arithmetic in float32: the gather computes each token's flat slot
    ``block * block_size + offset`` in float32, exact only below 2**24 slots; on a larger pool tokens
    are read from a neighbouring slot."""

    name = "float32_slot_gather"

    def gather(self, cache, block_table, seq_len, validate=True):
        table, seq_len = check_gather(cache, block_table, seq_len) if validate else \
            (normalize_block_table(block_table, cache.device), seq_len)
        bs = cache.shape[1]
        pos = torch.arange(seq_len, device=cache.device)
        slots = (table[pos // bs].float() * bs + (pos % bs).float()).long()  # FAULT: float32 slots
        return cache[slots // bs, slots % bs]


class Float32SlotMapping(IndexedBackend):
    """``slot_mapping`` routed through a float32 tensor (a ``torch.where`` with a float fill): slots
    past 2**24 round to a neighbour, so ``write_kv`` writes tokens to the wrong slots on large pools."""

    name = "float32_slot_mapping"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True):
        if validate:
            check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        slots = torch.where(slot_mapping >= 0, slot_mapping.float(), -1.0).long()  # FAULT: float32 round trip
        indexed.write_kv(k_cache, v_cache, key, value, slots, validate=False)


class ScatterClobbersBlock(IndexedBackend):
    """Slots outside the write clobbered: the scatter stages whole blocks in a zero-filled buffer and
    copies them back, so the slots before ``start`` in the first block and after the last written
    position in the last block are zeroed."""

    name = "scatter_clobbers_block"

    def scatter(self, cache, block_table, values, start=0, validate=True):
        table, start, n = check_scatter(cache, block_table, values, start) if validate else \
            (normalize_block_table(block_table, cache.device), start, values.shape[0])
        if n == 0:
            return
        bs = cache.shape[1]
        first, last = start // bs, blocks_needed(start + n, bs)
        staging = cache.new_zeros(((last - first) * bs, *cache.shape[2:]))  # FAULT: not read back first
        staging[start - first * bs: start - first * bs + n] = values
        cache[table[first:last]] = staging.view(last - first, bs, *cache.shape[2:])


class NegativeSlotWritten(IndexedBackend):
    """Padding tokens written: ``write_kv`` does not skip negative ``slot_mapping`` entries, and slot
    ``-1`` wraps to the pool's last slot."""

    name = "negative_slot_written"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True):
        if validate:
            check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        slots = slot_mapping.to(torch.int64)
        bs = k_cache.shape[1]  # FAULT: no `slots >= 0` filter
        k_cache[slots // bs, slots % bs] = key
        v_cache[slots // bs, slots % bs] = value


#: name -> mutant class (``pagedkv.tools.mutants:NAME`` loads an instance).
MUTANTS: dict[str, type[IndexedBackend]] = {cls.name: cls for cls in (
    OffByOneLastBlock, ScatterDropsStartOffset, PaddingReadAsBlock, NoCopyOnWrite, GqaModulo, CausalTopLeft,
    TailUnmasked, ScaleIgnored, SoftmaxNoMax, BatchStride, Float32SlotGather, Float32SlotMapping,
    ScatterClobbersBlock, NegativeSlotWritten)}



#: The properties that should kill each mutant first (the runner tries these, then all the others).
TARGETS: dict[str, tuple[str, ...]] = {
    "off_by_one_last_block": ("gather_returns_exactly_what_each_slot_holds",),
    "scatter_drops_start_offset": ("scatter_then_gather_round_trips_and_touches_no_other_slot",),
    "padding_read_as_block": ("paged_attention_matches_fp64_dense_reference",),
    "no_copy_on_write": ("every_live_sequence_reads_only_its_own_tokens",),
    "gqa_modulo": ("paged_attention_matches_fp64_dense_reference",),
    "causal_top_left": ("paged_attention_matches_fp64_dense_reference",),
    "tail_unmasked": ("paged_attention_matches_fp64_dense_reference",),
    "scale_ignored": ("paged_attention_matches_fp64_dense_reference",),
    "softmax_no_max": ("paged_attention_matches_fp64_dense_reference",),
    "batch_stride": ("paged_attention_matches_fp64_dense_reference", "outputs_are_bit_identical_under_batch_order"),
    "float32_slot_gather": ("gather_is_exact_on_pools_past_2_24_slots",),
    "float32_slot_mapping": ("write_kv_is_exact_on_pools_past_2_24_slots",),
    "scatter_clobbers_block": ("scatter_then_gather_round_trips_and_touches_no_other_slot",),
    "negative_slot_written": ("write_kv_lands_at_slot_mapping_and_skips_negative_slots",),
}
