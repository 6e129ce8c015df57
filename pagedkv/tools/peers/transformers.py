"""transformers' continuous-batching paged attention as CPU peers (transformers >= 5 with
``transformers.generation.continuous_batching``; pagedkv's ``hf`` extra installs it)::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:transformers_paged        # SDPA
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:transformers_paged_eager  # paged|eager

Continuous batching in transformers keeps the KV of every request in one flat token pool and moves it with
index tensors, not with a kernel: a step writes the new tokens' K/V at ``write_index`` (``index_copy_``)
and reads each request's whole context back at ``read_index`` (``index_select``), in
``PagedAttentionCache.update`` -> ``FullAttentionCacheAllocator.update``; the model then runs its
registered attention function (``sdpa_attention_forward``, or ``eager_paged_attention_forward`` for
``attn_implementation="paged|eager"``) over the packed batch with a block-diagonal causal bias built by
``build_attention_mask`` (0 where visible, ``finfo(dtype).min`` elsewhere).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.backends.capabilities import Capabilities, NonPromise
from pagedkv.errors import BackendUnavailableError
from pagedkv.validation.calls import check_paged_attention, check_write_kv

RECIPE = 'pip install "transformers>=5" (pagedkv[hf]), see docs/peers.md'


def _token_pool(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CB's token pool for ``cache`` (NHD ``[num_blocks, block_size, H, D]``) and the int64 ``slots`` to touch:
    ``(pool [tokens, H, D], slots in it, blocks)``. ``pool`` is the view ``[num_blocks * block_size, H, D]``
    when the strides allow it (``blocks`` None); otherwise (a strided or aliased pool) a contiguous copy of
    just the blocks ``slots`` touch, ``slots`` renumbered into it, and ``blocks`` the copied block ids (the
    caller copies writes back)."""
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d), slots, None
    except RuntimeError:
        blocks, where = torch.unique(slots // bs, return_inverse=True)
        sub = cache.index_select(0, blocks).reshape(blocks.numel() * bs, h, d)
        return sub, where * bs + slots % bs, blocks


#: What continuous batching does not promise, by its design (docs/peers.md, "Findings"): it attends a
#: batch as one SDPA over every request's keys with an additive block-diagonal bias.
_ONE_SDPA = "continuous batching attends the whole batch as one SDPA with a block-diagonal bias"
NON_PROMISES = {  # "not bit-identical": within the attention tolerance (NonPromise with no wider bound)
    "a_request_alone_equals_the_same_request_in_a_batch":
        NonPromise(f"not batch invariant: {_ONE_SDPA}, so a request's reductions depend on its neighbours"),
    "outputs_are_bit_identical_under_batch_order":
        NonPromise(f"not batch invariant: {_ONE_SDPA}, so reordering the batch reorders each request's reductions"),
}
# Not declarable: in the one SDPA another request's NaN value enters with weight 0, and 0 * NaN is NaN. A NaN
# output where the reference is finite is a failure no bound explains: a_nan_value_shows_exactly_in_the_
# outputs_that_read_it fails on this peer (docs/peers.md, "Findings").


class TransformersPaged:
    """transformers' continuous-batching cache write and paged attention on pagedkv's pools.

    - The pools are CB's per-layer token views (``_kv_token_views``): ``[num_blocks * block_size, H, D]``,
      slot ``s`` is token ``s``, which is how a CB block of ``page_size`` tokens is laid out. The adapter
      builds a ``FullAttentionCacheAllocator`` (without ``__init__``: no model config or sector pool; it
      holds only the layer's token views) under a ``PagedAttentionCache`` shell that maps layer 0 to it,
      and calls ``PagedAttentionCache.update`` with CB's kwargs (``read_index`` / ``write_index`` per
      allocator, ``cu_seq_lens_k`` / ``max_length_k`` per layer type), so CB's own transposes and index
      ops run. A pool with no token view (strided, or aliased blocks) runs on a contiguous copy of the
      blocks the call touches, written back block by block.
    - ``write_kv``: ``update`` with ``write_index = slot_mapping`` and no read. CB sends padding tokens to
      trash sectors instead of negative slots, so the adapter drops negative slots first.
    - ``paged_attention``: ``update`` with no write (the contract's new K/V are already in the cache) and
      ``read_index`` = every request's slots ``block * block_size + offset`` for positions
      ``0 .. seq_len - 1`` (what ``get_read_indices`` yields), the bias from ``build_attention_mask``
      (``cumulative_seqlens_q = query_start_loc``, ``cumulative_seqlens_k`` the running sum of
      ``seq_lens``; ``window_left`` as CB's ``sliding_window = window_left + 1``), then the registered
      attention function on ``[1, H, tokens, D]`` with ``module.num_key_value_groups`` set (its GQA
      repeat) and ``is_causal=False`` (the bias is the mask), as CB passes them. Eager also takes
      ``module.sinks``.

    Declared: every size and dtype; ``window`` (both) and ``sinks`` (eager). No ``gather`` or ``scatter``.
    """

    def __init__(self, attention: str = "sdpa") -> None:
        if attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
        try:
            from transformers.generation.continuous_batching.cache import PagedAttentionCache
            from transformers.generation.continuous_batching.cache_allocators.full_attention import (
                FullAttentionCacheAllocator,
            )
            from transformers.generation.continuous_batching.utils import build_attention_mask
            from transformers.integrations.eager_paged import eager_paged_attention_forward
            from transformers.integrations.sdpa_attention import sdpa_attention_forward
        except ImportError as exc:
            raise BackendUnavailableError(f"transformers is not installed or has no continuous-batching paged "
                                          f"attention ({type(exc).__name__}: {exc}); install: {RECIPE}") from exc
        self._cache_cls, self._alloc_cls = PagedAttentionCache, FullAttentionCacheAllocator
        self._mask = build_attention_mask
        self._attend = sdpa_attention_forward if attention == "sdpa" else eager_paged_attention_forward
        self.attention = attention
        self.name = "transformers_paged" if attention == "sdpa" else "transformers_paged_eager"
        self.capabilities = Capabilities(features={"window"} if attention == "sdpa" else {"window", "sinks"},
                                         non_promises=NON_PROMISES)

    def _update(self, k_cache, v_cache, key, value, read_index, write_index):
        """``PagedAttentionCache.update`` on layer 0 of a one-allocator shell over the pools; returns the read
        K/V as ``[tokens, H, D]`` (the written ones when ``read_index`` is empty). One of the two indices is
        empty (a write, or a read)."""
        touched = write_index if write_index.numel() else read_index
        (k_tok, k_slots, k_blocks), (v_tok, _, v_blocks) = (_token_pool(c, touched) for c in (k_cache, v_cache))
        read_index, write_index = (k_slots, write_index) if read_index.numel() else (read_index, k_slots)
        allocator = self._alloc_cls.__new__(self._alloc_cls)
        allocator.index, allocator._kv_token_views = 0, {0: (k_tok, v_tok)}
        cache = self._cache_cls.__new__(self._cache_cls)
        cache.layer_to_allocator = {0: allocator}
        n_read = int(read_index.numel())
        kwargs = {"cu_seq_lens_k": {allocator.layer_type: torch.tensor([0, n_read])},
                  "max_length_k": {allocator.layer_type: n_read}, "read_index": [read_index],
                  "write_index": [write_index]}
        ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (key, value))  # CB's [1, H, seqlen_q, D]
        k_out, v_out = cache.update(ks, vs, 0, kwargs)
        if write_index.numel():
            for pool, tok, blocks in ((k_cache, k_tok, k_blocks), (v_cache, v_tok, v_blocks)):
                if blocks is not None:
                    pool[blocks] = tok.view((blocks.numel(),) + tuple(pool.shape[1:]))
        return k_out[0].transpose(0, 1), v_out[0].transpose(0, 1)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``PagedAttentionCache.update`` with ``write_index`` = the non-negative slots."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        keep = slots >= 0
        if not bool(keep.any()):
            return
        self._update(k_cache, v_cache, key[keep], value[keep], slots.new_empty(0), slots[keep])

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, *,
                        window_left=-1, sinks=None):
        """CB's read (``update``), ``build_attention_mask`` and the registered attention function."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     window_left=window_left, sinks=sinks, supported=self.capabilities.features)
        out = torch.zeros_like(query)
        starts, lens = args.q_starts, args.seq_lens
        if starts[-1] == 0:
            return out
        bs, heads, device = k_cache.shape[1], query.shape[1], query.device
        tables = args.block_tables
        read = [int(tables[b, p // bs]) * bs + p % bs for b, n in enumerate(lens) for p in range(n)]
        read_index = torch.tensor(read, dtype=torch.int64, device=device)
        empty = query.new_empty((0,) + tuple(k_cache.shape[2:]))
        keys, values = self._update(k_cache, v_cache, empty, empty.clone(), read_index,
                                    read_index.new_empty(0))
        cu_k = [0]
        for n in lens:
            cu_k.append(cu_k[-1] + n)
        mask = torch.full((1, 1, starts[-1], cu_k[-1]), torch.finfo(query.dtype).min, dtype=query.dtype,
                          device=device)
        self._mask(mask, starts, cu_k, sliding_window=args.window_left + 1 if args.window_left >= 0 else 1)
        module = SimpleNamespace(num_key_value_groups=args.num_queries_per_kv, is_causal=False, training=False)
        if args.sinks is not None:
            module.sinks = args.sinks
        res, _ = self._attend(module, query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                              values.transpose(0, 1).unsqueeze(0), mask, scaling=args.scale, dropout=0.0,
                              is_causal=False)
        out.copy_(res[0].reshape(starts[-1], heads, -1))
        return out


def transformers_paged() -> TransformersPaged:
    """CB's cache update and SDPA (the default continuous-batching attention)."""
    return TransformersPaged("sdpa")


def transformers_paged_eager() -> TransformersPaged:
    """CB's cache update and ``paged|eager`` (``eager_paged_attention_forward``, with sinks)."""
    return TransformersPaged("eager")


def peer_classes() -> dict[str, Any]:
    """name -> factory, for :data:`pagedkv.tools.peers.PEERS`."""
    return {"transformers_paged": transformers_paged, "transformers_paged_eager": transformers_paged_eager}
