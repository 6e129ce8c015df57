"""Mutants of partial attention: the LSE ``paged_attention`` returns, split-K parts and ``merge_attn_states``.

The base, :class:`PartialBackend`, is the ``indexed`` backend
(:class:`~pagedkv.tools.mutants.backends.IndexedBackend`) that also returns its LSE (token-major, natural
log), takes V of its own width (MLA's latent view included), splits each row's context into
``num_splits`` parts merged by their LSEs (split-K, as flash-decoding kernels do) and merges partial
states (:func:`pagedkv.attention.merge.merge_attn_states`). Each mutant plants one fault that attention
kernels have shipped:

- ``lse_base_2_declared_e``: the LSE in base 2 reported as natural log (vllm#47079, sglang#33065);
- ``merge_nan_on_two_empty_parts``: the merge shifts by ``max(lse)`` unguarded, so two parts of no keys
  give ``-inf - -inf = NaN`` (vllm#27491, flashinfer#4051);
- ``empty_split_merged_as_valid``: a split with no visible key stores ``lse = 0`` instead of ``-inf``
  and its zero output is merged with that weight (vllm#49294, vllm#47188);
- ``rope_read_at_wrong_offset``: MLA's rope columns of K read ``rope_dim`` columns early, inside the
  latent part (``k[..., head_dim_v - rope_dim : head_dim_v]`` where ``k[..., head_dim_v:]`` was meant).

Load one as a candidate: ``pytest --pagedkv-impl=pagedkv.tools.mutants:lse_base_2_declared_e``.
"""

from __future__ import annotations

import math

import torch

from pagedkv.attention.dense import attend
from pagedkv.attention.merge import check_merge_attn_states, merge_states
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Sizes
from pagedkv.tools.mutants.backends import IndexedBackend, features_of
from pagedkv.validation.calls import attention_args


class PartialBackend(IndexedBackend):
    """The ``indexed`` backend returning its LSE, with split-K parts and a merge: the mutants' base
    (passes every partial-attention property unmutated)."""

    name = "partial"
    LSE, LSE_BASE, HEAD_DIMS_V, SPLIT_K = "token_major", "e", Sizes(), True

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        validate=True, *, return_lse=False, num_splits=None, **features):
        """Per sequence: gather K and V, then :meth:`split_attention`; ``(out, lse)`` with ``return_lse``."""
        args = attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, validate,
                              supported=self.FEATURES, num_splits=num_splits, return_lse=return_lse, **features)
        out = query.new_empty((*query.shape[:2], v_cache.shape[-1]))
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        for b, seq_len in enumerate(args.seq_lens):
            lo, hi = args.q_starts[b], args.q_starts[b + 1]
            if hi == lo:
                continue
            table = args.block_tables[b]
            key = indexed.gather(k_cache, table, seq_len, validate=False)
            value = indexed.gather(v_cache, table, seq_len, validate=False)
            out[lo:hi], lse[lo:hi] = self.split_attention(query[lo:hi], self.read_key(key, value), value, args)
        return (out, self.report_lse(lse)) if return_lse else out

    def read_key(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The K a kernel computes logits with (MLA: latent and rope columns of the one pool)."""
        return key

    def report_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The LSE as returned (natural log, the declared base)."""
        return lse

    def split_attention(self, query, key, value, args):
        """``num_splits`` parts of the keys (equal ranges of positions), each attended alone with its LSE
        (the sink in the first), merged by :meth:`merge_split`: ``(out, lse)``."""
        n, length = max(1, args.num_splits or 1), key.shape[0]
        chunk = -(-length // n)
        pos = torch.arange(length, device=key.device)
        out = lse = None
        for s in range(n):
            mask = ((pos >= s * chunk) & (pos < (s + 1) * chunk)).expand(query.shape[0], length)
            feats = features_of(args, sinks=args.sinks if s == 0 else None)
            o, l_ = attend(query, key, value, args.scale, return_lse=True, key_mask=mask, **feats)
            o, l_ = self.empty_split(o, l_.float())
            out, lse = (o, l_) if out is None else self.merge_split(out, lse, o, l_)
        return out, lse

    def empty_split(self, out: torch.Tensor, lse: torch.Tensor):
        """A split with no visible key: ``out = 0, lse = -inf`` (what :func:`attend` gives)."""
        return out, lse

    def merge_split(self, out_a, lse_a, out_b, lse_b):
        """Two token-major natural-log states merged (:func:`pagedkv.attention.merge.merge_states`)."""
        return merge_states(out_a, lse_a, out_b, lse_b)

    def merge_attn_states(self, prefix_out, prefix_lse, suffix_out, suffix_lse):
        """``merge_attn_states`` (token-major, natural log): checked, then :meth:`merge_split`."""
        check_merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, self.LSE)
        out, lse = self.merge_split(prefix_out, prefix_lse, suffix_out, suffix_lse)
        return out.contiguous(), lse.float().contiguous()


class LseBase2DeclaredE(PartialBackend):
    """The LSE of an exp2 softmax (base 2) returned where natural log is declared: merged with
    natural-log weights, a long prefix's share is off by a factor (vllm#47079, sglang#33065)."""

    name = "lse_base_2_declared_e"

    def report_lse(self, lse):
        return lse / math.log(2.0)  # FAULT: log2, declared "e"


class MergeNanOnTwoEmptyParts(PartialBackend):
    """A merge shifting by ``max(lse_a, lse_b)`` with no guard: two parts of no keys give
    ``exp(-inf - -inf) = NaN`` (vllm#27491, flashinfer#4051)."""

    name = "merge_nan_on_two_empty_parts"

    def merge_split(self, out_a, lse_a, out_b, lse_b):
        m = torch.maximum(lse_a, lse_b)  # FAULT: -inf when both are empty, and -inf - -inf is NaN
        wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
        out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / (wa + wb)[..., None]
        return out.to(out_a.dtype), m + torch.log(wa + wb)


class EmptySplitMergedAsValid(PartialBackend):
    """A split-K part that sees no key (before the window, past a short context) stores ``lse = 0``, not
    ``-inf``, and its zero output is merged with that weight (vllm#49294, vllm#47188)."""

    name = "empty_split_merged_as_valid"

    def empty_split(self, out, lse):
        return out, torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)  # FAULT: finite "no keys"


class RopeReadAtWrongOffset(PartialBackend):
    """MLA: the rope columns of K read ``rope_dim`` columns early, inside the latent part
    (``k[..., head_dim_v - rope_dim:head_dim_v]`` where ``k[..., head_dim_v:]`` was meant)."""

    name = "rope_read_at_wrong_offset"

    def read_key(self, key, value):
        d, dv = key.shape[-1], value.shape[-1]
        rope = d - dv
        if rope <= 0 or rope > dv:
            return key
        return torch.cat([key[..., :dv], key[..., dv - rope:dv]], dim=-1)  # FAULT: offset dv - rope, not dv


#: name -> mutant class (``pagedkv.tools.mutants:NAME`` loads an instance).
PARTIAL_MUTANTS = {cls.name: cls for cls in (LseBase2DeclaredE, MergeNanOnTwoEmptyParts, EmptySplitMergedAsValid,
                                             RopeReadAtWrongOffset)}
#: The properties that should kill each mutant first.
PARTIAL_TARGETS = {
    "lse_base_2_declared_e": ("paged_attention_returns_the_log_sum_exp_of_the_reference",),
    "merge_nan_on_two_empty_parts": ("merge_attn_states_with_no_keys_is_exact_and_never_nan",),
    "empty_split_merged_as_valid": ("paged_attention_returns_the_log_sum_exp_of_the_reference",
                                    "backends_agree_on_every_op_both_provide"),
    "rope_read_at_wrong_offset": ("paged_attention_returns_the_log_sum_exp_of_the_reference",),
}
