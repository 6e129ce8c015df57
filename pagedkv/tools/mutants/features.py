"""Mutants of the optional attention features: the ``indexed`` backend
(:class:`~pagedkv.tools.mutants.backends.IndexedBackend`) with one fault in its window, soft-cap, ALiBi,
sinks or fp8 path, each a fault that attention kernels have shipped or nearly shipped.

They are shipped mutants like those of :mod:`pagedkv.tools.mutants.backends` (``python -m pagedkv mutants``
runs them, ``tests/tools/test_mutants.py`` keeps every one killed) and load as candidates::

    pytest --pagedkv-impl=pagedkv.tools.mutants:softcap_after_mask -x
"""

from __future__ import annotations

import torch

from pagedkv.attention.dense import attend, causal_mask, feature_logits, softmax_with_sinks
from pagedkv.backends import indexed
from pagedkv.attention.fp8 import quantize
from pagedkv.tools.mutants.backends import IndexedBackend, features_of
from pagedkv.validation.calls import write_kv_args


def _logits(query: torch.Tensor, key: torch.Tensor, args) -> torch.Tensor:
    """``scale * q . k`` as ``[Hq, q, L]`` float32 (GQA by ``h // group``; fp8 K dequantized)."""
    group = query.shape[1] // key.shape[1]
    k = key.float() if args.k_scale is None else key.float() * args.k_scale.view(-1, 1)
    return torch.matmul(query.float().permute(1, 0, 2),
                        k.repeat_interleave(group, dim=1).permute(1, 2, 0)) * args.scale


def _finish(probs: torch.Tensor, value: torch.Tensor, query: torch.Tensor, args) -> torch.Tensor:
    """``probs [Hq, q, L] @ V`` back to ``[q, Hq, D]`` in the query's dtype."""
    group = query.shape[1] // value.shape[1]
    v = value.float() if args.v_scale is None else value.float() * args.v_scale.view(-1, 1)
    return torch.matmul(probs, v.repeat_interleave(group, dim=1).permute(1, 0, 2)).permute(1, 0, 2).to(query.dtype)


def _visible(q_len: int, length: int, window_left: int, device) -> torch.Tensor:
    """``bool [q, L]``: causal (bottom-right) and inside the window."""
    visible = causal_mask(q_len, length, device)
    if window_left >= 0:
        rows = torch.arange(q_len, device=device).unsqueeze(1) + (length - q_len)
        visible &= torch.arange(length, device=device).unsqueeze(0) >= rows - window_left
    return visible


class WindowOffByOne(IndexedBackend):
    """A window one key too wide: the kernel keeps keys with ``q_pos - k_pos <= window_left + 1`` (the
    window's size, ``window_left + 1`` keys, used where its left extent was meant)."""

    name = "window_off_by_one"

    def first_block(self, args, seq_len, q_len, block_size):
        return 0 if args.window_left < 0 else max(0, seq_len - q_len - args.window_left - 1) // block_size

    def attend_features(self, query, key, value, args, start):
        wide = args.window_left + 1 if args.window_left >= 0 else -1  # FAULT: one key too many
        return attend(query, key, value, args.scale, **features_of(args, window_left=wide))


class WindowIgnoresPrefix(IndexedBackend):
    """The window placed on the wrong side of a cached prefix: its lower edge is computed from the
    query's row in the chunk (top-left, as if the prefix were absent) instead of its absolute
    position, so prefill over a cached prefix, and decode, see far more than the window."""

    name = "window_ignores_prefix"

    def first_block(self, args, seq_len, q_len, block_size):
        return 0

    def attend_features(self, query, key, value, args, start):
        q_len, length = query.shape[0], key.shape[0]
        logits = _logits(query, key, args)
        if args.softcap > 0:
            logits = args.softcap * torch.tanh(logits / args.softcap)
        rel = torch.arange(length, device=query.device)[None, :] - torch.arange(length - q_len, length,
                                                                                 device=query.device)[:, None]
        if args.alibi_slopes is not None:
            logits = logits + args.alibi_slopes.view(-1, 1, 1) * rel
        visible = rel <= 0
        if args.window_left >= 0:  # FAULT: row i's window starts at i - window_left, not at its position's
            visible &= torch.arange(length, device=query.device)[None, :] >= \
                torch.arange(q_len, device=query.device)[:, None] - args.window_left
        probs = softmax_with_sinks(logits.masked_fill(~visible, float("-inf")), args.sinks)
        return _finish(probs, value, query, args)


class SoftcapAfterMask(IndexedBackend):
    """Soft-cap applied after the mask: ``softcap * tanh(-inf / softcap)`` is ``-softcap``, a finite
    logit, so every masked key (the causal future of a prefill row, keys outside the window) leaks
    into the softmax."""

    name = "softcap_after_mask"

    def attend_features(self, query, key, value, args, start):
        logits = _logits(query, key, args)
        if args.alibi_slopes is not None:
            rel = torch.arange(key.shape[0], device=query.device)[None, :] - \
                torch.arange(key.shape[0] - query.shape[0], key.shape[0], device=query.device)[:, None]
            logits = logits + args.alibi_slopes.view(-1, 1, 1) * rel
        visible = _visible(query.shape[0], key.shape[0], args.window_left, query.device)
        logits = logits.masked_fill(~visible, float("-inf"))
        if args.softcap > 0:  # FAULT: after the mask
            logits = args.softcap * torch.tanh(logits / args.softcap)
        return _finish(softmax_with_sinks(logits, args.sinks), value, query, args)


class AlibiBlockLocal(IndexedBackend):
    """ALiBi relative to the wrong position: the key's position is taken within its block (the
    tile-local offset ``k_pos % block_size``) instead of its absolute position, so keys in earlier
    blocks are penalised as if they sat next to the query."""

    name = "alibi_block_local"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        validate=True, **features):
        self._block_size = k_cache.shape[1]
        return super().paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       validate, **features)

    def attend_features(self, query, key, value, args, start):
        if args.alibi_slopes is None:
            return super().attend_features(query, key, value, args, start)
        q_len, length = query.shape[0], key.shape[0]
        k_pos = (torch.arange(length, device=query.device) + start) % self._block_size  # FAULT: block-local
        q_pos = torch.arange(length - q_len, length, device=query.device) + start
        logits = _logits(query, key, args)
        if args.softcap > 0:
            logits = args.softcap * torch.tanh(logits / args.softcap)
        logits = logits + args.alibi_slopes.view(-1, 1, 1) * (k_pos[None, :] - q_pos[:, None])
        logits = logits.masked_fill(~_visible(q_len, length, args.window_left, query.device), float("-inf"))
        return _finish(softmax_with_sinks(logits, args.sinks), value, query, args)


class SinksInNumerator(IndexedBackend):
    """Sinks counted in the numerator: the sink logit is treated as one more key whose value is the
    first visible token's (StreamingLLM's sink *token* confused with gpt-oss's learned sink logit),
    so its probability mass adds ``p_sink * V[first]`` instead of only shrinking the output."""

    name = "sinks_in_numerator"

    def attend_features(self, query, key, value, args, start):
        if args.sinks is None:
            return super().attend_features(query, key, value, args, start)
        q_len, length = query.shape[0], key.shape[0]
        k_pos = torch.arange(length, device=query.device)
        logits = feature_logits(_logits(query, key, args), k_pos[length - q_len:], k_pos, window_left=args.window_left,
                                softcap=args.softcap, alibi_slopes=args.alibi_slopes)
        sink = args.sinks.view(-1, 1, 1).expand(-1, q_len, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)
        first = max(0, length - q_len - args.window_left) if args.window_left >= 0 else 0
        values = torch.cat([value, value[first:first + 1]])  # FAULT: the sink gets the first visible token's value
        return _finish(probs, values, query, args)


class Fp8ScaleTwice(IndexedBackend):
    """An fp8 scale applied twice on the read: the gather dequantizes (``stored * k_scale``) and the
    kernel multiplies by ``k_scale`` again (two layers each owning the scale)."""

    name = "fp8_scale_twice"

    def attend_features(self, query, key, value, args, start):
        if args.k_scale is None:
            return super().attend_features(query, key, value, args, start)
        key = key.float() * args.k_scale.view(-1, 1)  # FAULT: the kernel below multiplies by k_scale again
        return attend(query, key, value, args.scale, **features_of(args))


class Fp8WriteMultiplies(IndexedBackend):
    """An fp8 write that multiplies by the scale instead of dividing (``k_scale`` taken as the
    quantization scale where it is the dequantization scale: vLLM's convention inverted)."""

    name = "fp8_write_multiplies"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True, **scales):
        w = write_kv_args(k_cache, v_cache, key, value, slot_mapping, validate=validate, supported=self.FEATURES,
                          **scales)
        if w.k_scale is None:
            return super().write_kv(k_cache, v_cache, key, value, slot_mapping, validate, **scales)
        key = quantize(key, 1 / w.k_scale, k_cache.dtype)  # FAULT: x * scale
        value = quantize(value, 1 / w.v_scale, v_cache.dtype)
        keep = w.slots >= 0
        indexed._write_slots(k_cache, w.slots[keep], key[keep])
        indexed._write_slots(v_cache, w.slots[keep], value[keep])


class WindowReadsWholeContext(IndexedBackend):
    """A window enforced by the mask alone: every block of the context is read and the keys outside
    the window are masked, so a NaN or inf left in a block no query can see reaches ``probs @ V`` as
    ``0 * NaN`` (the contract lets such blocks hold anything: a kernel must skip or zero them)."""

    name = "window_reads_whole_context"

    def first_block(self, args, seq_len, q_len, block_size):
        return 0  # FAULT: blocks outside every window are read too


#: name -> mutant class (``pagedkv.tools.mutants:NAME`` loads an instance).
FEATURE_MUTANTS: dict[str, type[IndexedBackend]] = {cls.name: cls for cls in (
    WindowOffByOne, WindowIgnoresPrefix, SoftcapAfterMask, AlibiBlockLocal, SinksInNumerator, Fp8ScaleTwice,
    Fp8WriteMultiplies, WindowReadsWholeContext)}


_REFERENCE = "paged_attention_matches_fp64_dense_reference"

#: The properties that should kill each feature mutant first.
FEATURE_TARGETS: dict[str, tuple[str, ...]] = {
    "window_off_by_one": (_REFERENCE,),
    "window_ignores_prefix": (_REFERENCE,),
    "softcap_after_mask": (_REFERENCE,),
    "alibi_block_local": (_REFERENCE,),
    "sinks_in_numerator": (_REFERENCE,),
    "fp8_scale_twice": ("scaling_stored_k_by_c_and_k_scale_by_1_over_c_changes_nothing", _REFERENCE),
    "fp8_write_multiplies": ("fp8_write_then_gather_returns_exactly_the_quantized_values",),
    "window_reads_whole_context": ("nan_in_blocks_outside_the_window_changes_nothing",),
}
