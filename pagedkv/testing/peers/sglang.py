"""SGLang's Triton attention kernels as CPU peers (``pip install --no-deps sglang`` + the modules its kernel
files import; recipe in ``docs/peers.md``)::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.testing.peers:sglang_triton        # page size 1
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.testing.peers:sglang_triton_paged  # page size = block

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which pagedkv sets). SGLang's
kernel modules import on a CPU machine as they are (no platform check to work around: ``sglang.srt.utils``
answers ``is_cuda() / is_hip()`` with ``False`` and the kernels pick their non-CUDA tile sizes).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedkv.backends.capabilities import Capabilities
from pagedkv.csr import check_csr
from pagedkv.errors import BackendUnavailableError
from pagedkv.validation import check_paged_attention, check_write_kv

MODULES = ("psutil pybase64 starlette msgspec pyzmq aiohttp multidict yarl propcache aiohappyeyeballs aiosignal "
           "frozenlist")
RECIPE = (f"pip install --no-deps sglang {MODULES} (the modules its kernel files import; never without --no-deps: "
          "a full install resolves SGLang's serving stack and a CUDA torch), see docs/peers.md")

#: SGLang's default ``--triton-attention-num-kv-splits``; a device without a core count (``get_device_core_count``
#: is 0 off CUDA) uses it for every request (``TritonAttnBackend.get_num_kv_splits``, static splits).
MAX_KV_SPLITS = 8


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """NHD ``[num_blocks, block_size, H, D]`` as SGLang's token pool ``[num_blocks * block_size, H, D]``
    (a view when the strides allow it, else a contiguous copy: attention only reads it)."""
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d)
    except RuntimeError:
        return cache.reshape(nb * bs, h, d).contiguous()


class SglangTriton:
    """SGLang's Triton attention backend kernels on pagedkv's pools (``sglang.kernels.ops``):

    - ``paged_attention``: per sequence by its query length, as SGLang's ``TritonAttnBackend`` splits
      decode and extend batches: ``q_len == 1`` through ``decode_attention_fwd`` (two-stage split-KV
      decode: stage 1 writes per-split partial outputs and log-sum-exps into ``attn_logits
      float32 [batch, H, 8, D]`` / ``attn_lse``, stage 2 reduces them; 8 splits for every request, SGLang's
      static choice on a device without a core count), ``q_len > 1`` through ``extend_attention_fwd``
      (prefill over a cached prefix: the prefix read through ``kv_indptr`` / ``kv_indices``, the new
      tokens' K/V passed as ``k_extend`` / ``v_extend``, causal). The contract puts the new tokens' K/V in
      the cache first, so the adapter reads ``k_extend`` / ``v_extend`` back from their slots (plain
      indexing), as SGLang's backend passes the K/V it has just stored. ``q_len == 0`` rows are zeros.
    - The metadata is SGLang's: the pool viewed as its token pool ``[num_blocks * block_size, H, D]``;
      with ``page_size=1`` a ``req_to_token int32 [batch, max_len]`` table of token slots
      (``block * block_size + offset``), with ``page_size=block_size`` the page-granular table (pagedkv's
      block tables, the "unified pool's read table"); either one expanded into token-granular
      ``kv_indptr int32 [batch + 1]`` / ``kv_indices int64 [tokens]`` by SGLang's own
      ``create_flashinfer_kv_indices_triton`` (``ENTRY_PAGE_SIZE`` 1 or ``block_size``), checked by
      :func:`pagedkv.csr.check_csr` (page size 1 over the slot pool), and the attention kernels run with
      ``page_size`` 1 or ``block_size`` (their page-aware address math).
    - ``write_kv``: ``launch_reshape_and_cache_flash`` (``sglang.kernels.ops.kvcache.cache_ops``, SGLang's
      Triton KV write into ``[num_blocks, block_size, H, D]`` with any token/head/block strides; negative
      slots skipped). ``key`` / ``value`` are made contiguous first (its source addressing assumes
      ``stride(1) == head_dim``, which SGLang's caller checks).

    Declared: every size; float32 and float16 under the interpreter (bfloat16 too when compiled; the
    interpreter's ``tl.dot`` multiplies bfloat16 bit patterns), no optional feature. No ``gather`` or
    ``scatter`` (SGLang has none as kernels).
    """

    def __init__(self, page_size: str = "one") -> None:
        if page_size not in ("one", "block"):
            raise ValueError(f"page_size must be 'one' or 'block', got {page_size!r}")
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
            from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
            from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton
            from sglang.kernels.ops.kvcache.cache_ops import launch_reshape_and_cache_flash
        except ImportError as exc:
            raise BackendUnavailableError(f"sglang is not installed or has no Triton attention kernels "
                                          f"({type(exc).__name__}: {exc}); install: {RECIPE}") from exc
        self._decode, self._extend = decode_attention_fwd, extend_attention_fwd
        self._indices, self._write = create_flashinfer_kv_indices_triton, launch_reshape_and_cache_flash
        self.page_size = page_size
        self.name = "sglang_triton" if page_size == "one" else "sglang_triton_paged"
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.capabilities = Capabilities(dtypes={"float32", "float16"} if interpreted else
                                         {"float32", "float16", "bfloat16"})

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``launch_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping)``."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        if slots.numel() == 0:
            return
        self._write(key.contiguous(), value.contiguous(), k_cache, v_cache, slots)

    def _kv_indices(self, block_tables: torch.Tensor, lens: list[int], block_size: int, num_slots: int):
        """Token-granular ``(kv_indptr int32 [n + 1], kv_indices int64 [sum(lens)])`` of positions ``0 ..
        lens[i] - 1`` of each row, built by SGLang's ``create_flashinfer_kv_indices_triton``."""
        device = block_tables.device
        n = len(lens)
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        indptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(kv_lens, 0)
        indices = torch.empty(sum(lens), dtype=torch.int64, device=device)
        if self.page_size == "one":  # SGLang's ReqToTokenPool: one token slot per position
            width = max(max(lens, default=0), 1)
            pos = torch.arange(width, device=device)
            cols = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
            table = (block_tables.gather(1, cols.expand(n, -1)) * block_size + pos % block_size).to(torch.int32)
            entry = 1
        else:  # the page-granular read table: pagedkv's block tables as they are
            table, entry = block_tables.to(torch.int32).contiguous(), block_size
        if n and sum(lens):
            self._indices[(n,)](table, torch.arange(n, dtype=torch.int32, device=device), kv_lens, indptr, None,
                                indices, table.stride(0), ENTRY_PAGE_SIZE=entry)
        check_csr(indptr, indices, torch.minimum(kv_lens, torch.ones_like(kv_lens)), 1, num_slots, seq_lens=kv_lens)
        return indptr, indices

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        """Decode rows through ``decode_attention_fwd``, prefill rows through ``extend_attention_fwd``."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        out = torch.zeros_like(query)
        nb, bs, num_kv_heads, head_dim = k_cache.shape
        starts, lens = args.q_starts, args.seq_lens
        q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
        decode = [b for b, q in enumerate(q_lens) if q == 1]
        extend = [b for b, q in enumerate(q_lens) if q > 1]
        if not decode and not extend:
            return out
        k_pool, v_pool = _flat(k_cache), _flat(v_cache)
        page = 1 if self.page_size == "one" else bs
        tables = args.block_tables
        device, heads = query.device, query.shape[1]
        if decode:
            rows = torch.tensor([starts[b] for b in decode], device=device)
            indptr, indices = self._kv_indices(tables[decode], [lens[b] for b in decode], bs, nb * bs)
            n = len(decode)
            o = torch.empty((n, heads, head_dim), dtype=query.dtype, device=device)
            logits = torch.empty((n, heads, MAX_KV_SPLITS, head_dim), dtype=torch.float32, device=device)
            lse = torch.empty((n, heads, MAX_KV_SPLITS), dtype=torch.float32, device=device)
            splits = torch.full((n,), MAX_KV_SPLITS, dtype=torch.int32, device=device)
            self._decode(query[rows].contiguous(), k_pool, v_pool, o, indptr, indices, logits, lse, splits,
                         MAX_KV_SPLITS, args.scale, 1.0, 1.0, page_size=page)
            out[rows] = o
        if extend:
            new = [(b, p) for b in extend for p in range(lens[b] - q_lens[b], lens[b])]
            rows = torch.tensor([starts[b] + i for b in extend for i in range(q_lens[b])], device=device)
            slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for b, p in new], device=device)
            indptr, indices = self._kv_indices(tables[extend], [lens[b] - q_lens[b] for b in extend], bs, nb * bs)
            qo = torch.zeros(len(extend) + 1, dtype=torch.int32, device=device)
            qo[1:] = torch.cumsum(torch.tensor([q_lens[b] for b in extend], dtype=torch.int32, device=device), 0)
            o = torch.empty((rows.numel(), heads, head_dim), dtype=query.dtype, device=device)
            self._extend(query[rows].contiguous(), k_pool[slots].contiguous(), v_pool[slots].contiguous(), o,
                         k_pool, v_pool, qo, indptr, indices, None, True, None, max(q_lens[b] for b in extend),
                         1.0, 1.0, sm_scale=args.scale, page_size=page)
            out[rows] = o
        return out


def sglang_triton() -> SglangTriton:
    """SGLang's Triton kernels over a token pool of page size 1 (SGLang's default Triton backend)."""
    return SglangTriton("one")


def sglang_triton_paged() -> SglangTriton:
    """SGLang's Triton kernels with ``page_size = block_size`` (page-granular read table, page-aware addressing)."""
    return SglangTriton("block")


def peer_classes() -> dict[str, Any]:
    """name -> factory, for :data:`pagedkv.testing.peers.PEERS`."""
    return {"sglang_triton": sglang_triton, "sglang_triton_paged": sglang_triton_paged}
