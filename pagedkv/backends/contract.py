"""The backend contract as one ``typing.Protocol``: the four ops, their signatures and their docs, once.

``docs/contract.md`` is the prose version. :data:`pagedkv.backends.OPS` and
:data:`pagedkv.backends.OP_PARAMS` (what :func:`pagedkv.load_backend` checks a candidate's signatures
against) are read from :class:`PagedKVBackend`; the built-in backends' ops are built by
:mod:`pagedkv.backends.ops`, which takes each op's documentation from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

TableLike = torch.Tensor | Sequence[int]

#: What pagedkv's own ops add to each contract op (a candidate need not take them).
EXTRAS = """
pagedkv's own backends also take ``validate`` after the contract's positional arguments: ``"full"``
(or ``True``, the default) checks everything and reads block tables, lengths and slots on the host;
``"metadata"`` checks shapes, dtypes, devices, strides and memory overlap without reading tensor
data (no host synchronisation); ``"none"`` (or ``False``) checks nothing, and a bad argument is
undefined behaviour. See ``docs/validation.md`` for what each level catches.
``paged_attention`` also takes ``num_splits`` (keyword-only; ``None``, the default: the backend's
heuristic; ``1``: no split; an int ``>= 1`` otherwise, else ``ArgumentTypeError`` /
``ArgumentValueError``): the split-K (flash-decoding) parts of each query tile's context, for a
backend that declares split-K (``SPLIT_K = True``: ``triton``, where ``$PAGEDKV_NUM_SPLITS`` fixes the
count when the argument is ``None``); ``loop`` and ``indexed`` validate it and compute unsplit."""


@runtime_checkable
class PagedKVBackend(Protocol):
    """A paged KV cache backend: a ``name`` and the four ops, called positionally (see ``docs/contract.md``).

    Pools are ``[num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD", any strides); logical
    position ``p`` of a sequence lives at ``cache[block_table[p // block_size], p % block_size]``;
    ``slot = block_id * block_size + offset``. A candidate may omit ops (the properties needing them
    are skipped) and may take extra parameters with defaults.
    """

    name: str

    def scatter(self, cache: torch.Tensor, block_table: TableLike, values: torch.Tensor, start: int = 0) -> None:
        """Write ``values[j]`` to logical position ``start + j`` of one sequence, in place.

        Args:
            cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool, written in place.
            block_table: ``int32``/``int64`` tensor or list of ints with ``>= ceil((start + n) / block_size)``
                entries.
            values: ``[n, num_kv_heads, head_dim]``, ``cache.dtype``, on ``cache.device`` (any strides).
            start: logical position of ``values[0]``, ``>= 0``.

        Every other slot stays bit-identical (the rest of a partially written block included).

        Raises:
            ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError: as
            :func:`pagedkv.validation.calls.check_scatter`; nothing is written then.
        """

    def gather(self, cache: torch.Tensor, block_table: TableLike, seq_len: int) -> torch.Tensor:
        """Read logical positions ``0 .. seq_len - 1`` of one sequence.

        Args:
            cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pool (any strides).
            block_table: ``int32``/``int64`` tensor or list of ints; only the first
                ``ceil(seq_len / block_size)`` entries are read (later ones may be ``-1`` padding).
            seq_len: tokens to read, ``>= 0``.

        Returns:
            A new ``[seq_len, num_kv_heads, head_dim]`` tensor, ``cache.dtype``, on ``cache.device``, row
            ``p`` bit for bit ``cache[block_table[p // block_size], p % block_size]``. Writes nothing.

        Raises:
            ShapeError, BlockIndexError: as :func:`pagedkv.validation.calls.check_gather`.
        """

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """vLLM ``reshape_and_cache``: token ``i`` of ``key``/``value`` goes to ``slot_mapping[i]`` in both pools.

        Args:
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools, written in place.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype and device (any
                strides); float32/float16/bfloat16 into an fp8 pool.
            slot_mapping: ``int64 [num_tokens]`` (int32 accepted), ``block_id * block_size + offset``;
                negative slots are skipped (padding tokens). Nothing else changes.

        Keyword-only (optional feature ``"fp8"``): ``k_scale``, ``v_scale``, required for (and only for) a
        ``float8_e4m3fn`` / ``float8_e5m2`` pool: a float or ``float32 [num_kv_heads]``; the stored byte
        is ``sat(x / scale)`` rounded to nearest even (:func:`pagedkv.attention.fp8.quantize`).

        Raises:
            ShapeError, BlockIndexError, DTypeMismatchError, DeviceMismatchError, ArgumentTypeError: as
            :func:`pagedkv.validation.calls.check_write_kv`; nothing is written then.
        """

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
        """Causal, packed varlen attention straight from the pools (decode and prefill over a cached prefix).

        Args:
            query: ``[total_q, num_q_heads, head_dim]``; rows ``query_start_loc[b]:query_start_loc[b + 1]``
                belong to sequence ``b`` and sit at its last ``q_len`` positions (causal mask aligned
                bottom-right). GQA: query head ``h`` uses kv head ``h // (num_q_heads // num_kv_heads)``.
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` and ``[..., head_dim_v]``:
                V may be narrower or wider than K, or a view of K's first ``head_dim_v`` columns (MLA's latent
                cache; ``Capabilities.head_dims_v``, ``shared_kv_storage``).
            block_tables: ``int32 [batch, max_blocks_per_seq]``, ``-1``-padded; only the first
                ``ceil(seq_len / block_size)`` entries of a row are read.
            seq_lens: ``int32 [batch]`` context lengths including the new query tokens.
            query_start_loc: ``int32 [batch + 1]`` (flash-attn's ``cu_seqlens_q``); ``q_len`` may be 0.
            scale: logits multiplier, default ``1 / sqrt(head_dim)``.

        Keyword-only optional features (flash-attn / vLLM names; each off by default):
            window_left: a query at position ``p`` sees keys ``p - window_left .. p``; ``-1``: no window.
            softcap: ``> 0``: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2); ``0``: off.
            alibi_slopes: ``float32 [num_q_heads]``: bias ``slope * (k_pos - q_pos)`` (after the soft-cap).
            sinks: ``float32 [num_q_heads]``: one extra logit per head in the denominator (gpt-oss).
                pagedkv's own backends also take slopes and sinks in float16 / bfloat16 or as a sequence
                of floats, converted once to float32 (``docs/contract.md``); the suite passes float32.
            k_scale, v_scale: fp8 pools only (required there): a float or ``float32 [num_kv_heads]``;
                K/V are read as ``float32(stored) * scale``.
            return_lse: a backend that declares an LSE (``Capabilities.lse``, ``lse_base``) returns ``(out,
                lse)``: ``lse`` float32 ``[num_q_heads, total_q]`` (``"head_major"``) or ``[total_q,
                num_q_heads]`` (``"token_major"``), the log (base e or 2) of each row's softmax denominator.

        Returns:
            ``[total_q, num_q_heads, head_dim_v]`` in ``query.dtype``. Positions ``>= seq_len`` (and outside
            a query's window) never influence the result, even when they hold NaN or inf.

        Raises:
            as :func:`pagedkv.validation.calls.check_paged_attention`.
        """


#: The contract's ops, in the order the suite lists them.
OPS = ("scatter", "gather", "write_kv", "paged_attention")


class MergesAttentionStates(Protocol):
    """The optional op of a backend that merges partial attention states (``docs/contract.md``)."""

    def merge_attn_states(self, prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                          suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's ``merge_attn_states``, FlashInfer's ``merge_state``: attention over two disjoint parts of the
        context from each part's output and LSE.

        Args:
            prefix_out, suffix_out: ``[total_q, num_heads, head_dim_v]``, one float dtype.
            prefix_lse, suffix_lse: float32 in the declared layout (``Capabilities.lse``) and base
                (``lse_base``); ``-inf`` (with output 0): the part has no keys.

        Returns:
            ``(out, lse)``, new tensors: ``out = (w_p out_p + w_s out_s) / (w_p + w_s)`` with ``w = exp(lse -
            max)``, ``lse = max + log(w_p + w_s)``. A part of no keys returns the other exactly; two give
            ``out = 0, lse = -inf``, never NaN.
        """
