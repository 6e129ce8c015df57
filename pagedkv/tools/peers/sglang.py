"""SGLang's Triton attention kernels as CPU peers (``pip install --no-deps sglang`` + the modules its kernel
files import; recipe in ``docs/peers.md``)::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:sglang_triton        # page size 1
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:sglang_triton_paged  # page size = block

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which pagedkv sets). SGLang's
kernel modules import on a CPU machine as they are (no platform check to work around: ``sglang.srt.utils``
answers ``is_cuda() / is_hip()`` with ``False`` and the kernels pick their non-CUDA tile sizes).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedkv.validation.arguments import check_num_splits
from pagedkv.backends.capabilities import Capabilities
from pagedkv.backends.interpreter import wrap_interpreted_launches
from pagedkv.csr import check_csr
from pagedkv.errors import BackendUnavailableError
from pagedkv.validation.calls import check_paged_attention, check_write_kv

MODULES = ("psutil pybase64 starlette msgspec pyzmq aiohttp multidict yarl propcache aiohappyeyeballs aiosignal "
           "frozenlist")
RECIPE = (f"pip install --no-deps sglang {MODULES} (the modules its kernel files import; never without --no-deps: "
          "a full install resolves SGLang's serving stack and a CUDA torch), see docs/peers.md")

#: SGLang's default ``--triton-attention-num-kv-splits``; a device without a core count (``get_device_core_count``
#: is 0 off CUDA) uses it for every request (``TritonAttnBackend.get_num_kv_splits``, static splits).
MAX_KV_SPLITS = 8
#: ``SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE`` of the deterministic variant (SGLang's default is 256; 32, the decode
#: kernel's smallest split, so the suite's sequences of a few dozen tokens span several splits).
SPLIT_TILE_SIZE = 32
#: What SGLang's kernels take that the contract has (``xai_temperature_len``, ``score_mod`` and custom masks it
#: has not; ``k_scale`` / ``v_scale`` are one scalar per layer, the contract's fp8 scales one per kv head).
FEATURES = frozenset({"window", "softcap", "sinks"})


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """NHD ``[num_blocks, block_size, H, D]`` as SGLang's token pool ``[num_blocks * block_size, H, D]``
    (a view when the strides allow it, else a contiguous copy: attention only reads it)."""
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d)
    except RuntimeError:
        return cache.reshape(nb * bs, h, d).contiguous()



#: What SGLang's Triton kernels do not promise, by their design (docs/peers.md, "Findings").
SOFTCAP_PRECISION = ("tanh is computed as 2 * sigmoid(2x) - 1, which keeps float32's absolute precision: a cap "
                     "far above every logit moves each logit by about cap * 6e-8")
INT32_TOKEN_TABLE = "req_to_token is int32 and holds token slots at page size 1: no slot past 2**31 can be named"
# Not declared as a non-promise: as vLLM's (pagedkv.tools.peers.vllm.HUGE_SOFTCAP), the error grows with the
# cap, 0.12 on the explicit example and up to 2.8 over 25 drawn examples, which no tolerance bounds;
# a_huge_softcap_equals_no_softcap fails on this peer (it was a finding).

class SglangTriton:
    """SGLang's Triton attention backend kernels on pagedkv's pools (``sglang.kernels.ops``):

    - ``paged_attention``: per sequence by its query length, as SGLang's ``TritonAttnBackend`` splits
      decode and extend batches: ``q_len == 1`` through ``decode_attention_fwd`` (two-stage split-KV
      decode: stage 1 writes per-split partial outputs and log-sum-exps into ``attn_logits
      float32 [batch, H, max_kv_splits, D]`` / ``attn_lse``, stage 2 reduces them), ``q_len > 1`` through
      ``extend_attention_fwd`` (prefill over a cached prefix: the prefix read through ``kv_indptr`` /
      ``kv_indices``, the new tokens' K/V passed as ``k_extend`` / ``v_extend``, causal). The contract puts
      the new tokens' K/V in the cache first, so the adapter reads ``k_extend`` / ``v_extend`` back from
      their slots (plain indexing), as SGLang's backend passes the K/V it has just stored. ``q_len == 0``
      rows are zeros.
    - Decode splits: ``num_splits`` (declared ``split_k``) is ``--triton-attention-num-kv-splits`` with
      static splits (``num_kv_splits = max_kv_splits = num_splits`` for every request); ``None`` is
      SGLang's default 8 (static on a device without a core count, so a request's splits never depend
      on its neighbours). The deterministic variant (``--enable-deterministic-inference``) ignores it:
      ``num_kv_splits = ceil(len / SPLIT_TILE_SIZE)`` per request, ``max_kv_splits`` from the pool's
      capacity, and prefill through ``extend_attention_fwd_unified`` (one pass over prefix and new
      tokens through one index list built by ``build_unified_kv_indices``).
    - Features, mapped as ``TritonAttnBackend`` maps a layer's: ``softcap`` is ``logit_cap`` (SGLang's
      ``logit_cap * tanh(x / logit_cap)`` on the scaled logits, pagedkv's order); ``sinks`` (float32
      ``[num_q_heads]``, one extra logit in each head's denominator); ``window_left`` is SGLang's
      ``sliding_window_size`` (``config.sliding_window - 1``: a query at ``p`` sees ``p - W .. p``). The
      extend kernels mask the window (``q <= k + W``) over the window's part of the prefix
      (``update_sliding_window_buffer``: the last ``min(prefix, W)`` tokens, ``window_kv_offsets`` /
      ``window_start_pos`` the first one's position, tile-aligned by ``align_window_kv_to_tiles`` in
      deterministic mode); the decode kernel has no window mask and reads what that buffer holds:
      SGLang's last ``min(seq_len, W)`` tokens. SGLang builds window metadata only for ``W > 0``, and
      its kernels' window masks are guarded by ``SLIDING_WINDOW_SIZE > 0``: ``window_left = 0`` runs as
      no window. Both said where they diverge from the contract (docs/peers.md), not corrected.
    - The metadata is SGLang's: the pool viewed as its token pool ``[num_blocks * block_size, H, D]``;
      with ``page_size=1`` a ``req_to_token int32 [batch, max_len]`` table of token slots
      (``block * block_size + offset``), with ``page_size=block_size`` the page-granular table (pagedkv's
      block tables, the "unified pool's read table"); either one expanded into token-granular
      ``kv_indptr int32 [batch + 1]`` / ``kv_indices int64 [tokens]`` by SGLang's own
      ``create_flashinfer_kv_indices_triton`` (``ENTRY_PAGE_SIZE`` 1 or ``block_size``, ``kv_start_idx`` the
      window's first position), checked by :func:`pagedkv.csr.check_csr` (page size 1 over the slot
      pool), and the attention kernels run with ``page_size`` 1 or ``block_size``.
    - ``write_kv``: ``launch_reshape_and_cache_flash`` (``sglang.kernels.ops.kvcache.cache_ops``, SGLang's
      Triton KV write into ``[num_blocks, block_size, H, D]`` with any token/head/block strides; negative
      slots skipped). ``key`` / ``value`` are made contiguous first (its source addressing assumes
      ``stride(1) == head_dim``, which SGLang's caller checks).

    Declared: every size; float32 and float16 under the interpreter (bfloat16 too when compiled; the
    interpreter's ``tl.dot`` multiplies bfloat16 bit patterns); features :data:`FEATURES`; ``split_k``
    except the deterministic variant. No ``gather`` or ``scatter`` (SGLang has none as kernels).

    Raises (construction): ``BackendUnavailableError`` without sglang; ``ValueError`` for an unknown
    ``page_size``.
    """

    LAUNCHES_TRITON = True  # SGLang's kernels: a palette of specialisations, interpreted on a CPU (fewer examples)

    def __init__(self, page_size: str = "one", deterministic: bool = False) -> None:
        if page_size not in ("one", "block"):
            raise ValueError(f"page_size must be 'one' or 'block', got {page_size!r}")
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
            from sglang.kernels.ops.attention.extend_attention import (align_window_kv_to_tiles,
                                                                       build_unified_kv_indices,
                                                                       extend_attention_fwd,
                                                                       extend_attention_fwd_unified)
            from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton
            from sglang.kernels.ops.kvcache.cache_ops import launch_reshape_and_cache_flash
        except ImportError as exc:
            raise BackendUnavailableError(f"sglang is not installed or has no Triton attention kernels "
                                          f"({type(exc).__name__}: {exc}); install: {RECIPE}") from exc
        self._decode, self._extend = decode_attention_fwd, extend_attention_fwd
        wrap_interpreted_launches()  # interpreted launches: a fresh stack chunk, triton.language patched once
        self._unified = extend_attention_fwd_unified
        self._build_unified, self._align = build_unified_kv_indices, align_window_kv_to_tiles
        self._indices, self._write = create_flashinfer_kv_indices_triton, launch_reshape_and_cache_flash
        self.page_size, self.deterministic = page_size, deterministic
        self.name = "sglang_triton" + ("_paged" if page_size == "block" else "") + (
            "_deterministic" if deterministic else "")
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        # req_to_token is int32 at page size 1 (INT32_TOKEN_TABLE): pools up to 4 GiB, whose 2-byte elements
        # name fewer than 2**31 slots, are the space it takes (a declared space, not a non-promise)
        self.capabilities = Capabilities(dtypes={"float32", "float16"} if interpreted else
                                         {"float32", "float16", "bfloat16"},
                                         features=FEATURES, split_k=not deterministic,
                                         max_pool_bytes=None if page_size == "block" else 2**32)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """``launch_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping)``; pools of two widths
        one launch each (the kernel writes V at K's head size: 64 of MLA's 576 columns into the next slot)."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        if slots.numel() == 0:
            return
        if key.shape[-1] != value.shape[-1]:  # the kernel takes one head size (key's) for both pools: one
            self._write(key.contiguous(), key.contiguous(), k_cache, k_cache, slots)  # launch a pool, each at
            self._write(value.contiguous(), value.contiguous(), v_cache, v_cache, slots)  # its own width
            return
        self._write(key.contiguous(), value.contiguous(), k_cache, v_cache, slots)

    def _kv_indices(self, block_tables: torch.Tensor, starts: list[int], lens: list[int], block_size: int,
                    num_slots: int):
        """Token-granular ``(kv_indptr int32 [n + 1], kv_indices int64 [sum(lens)])`` of positions
        ``starts[i] .. starts[i] + lens[i] - 1`` of each row, built by SGLang's
        ``create_flashinfer_kv_indices_triton``."""
        device = block_tables.device
        n = len(lens)
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        indptr = torch.zeros(n + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(kv_lens, 0)
        indices = torch.empty(sum(lens), dtype=torch.int64, device=device)
        if self.page_size == "one":  # SGLang's ReqToTokenPool: one token slot per position
            width = max(max((s + k for s, k in zip(starts, lens)), default=0), 1)
            pos = torch.arange(width, device=device)
            cols = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
            table = (block_tables.gather(1, cols.expand(n, -1)) * block_size + pos % block_size).to(torch.int32)
            entry = 1
        else:  # the page-granular read table: pagedkv's block tables as they are
            table, entry = block_tables.to(torch.int32).contiguous(), block_size
        if n and sum(lens):
            first = torch.tensor(starts, dtype=torch.int32, device=device) if any(starts) else None
            self._indices[(n,)](table, torch.arange(n, dtype=torch.int32, device=device), kv_lens, indptr, first,
                                indices, table.stride(0), ENTRY_PAGE_SIZE=entry)
        check_csr(indptr, indices, torch.minimum(kv_lens, torch.ones_like(kv_lens)), 1, num_slots, seq_lens=kv_lens)
        return indptr, indices

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None,
                        window_left=-1, softcap=0.0, sinks=None, *, num_splits=None):
        """Decode rows through ``decode_attention_fwd``, prefill rows through ``extend_attention_fwd`` (or
        ``extend_attention_fwd_unified``, deterministic); features and splits as in the class docstring."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                     window_left=window_left, softcap=softcap, sinks=sinks)
        splits = check_num_splits(num_splits)
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
        window = args.window_left if args.window_left > 0 else -1  # SGLang's `sliding_window_size > 0` guards
        sink = None if args.sinks is None else args.sinks.to(torch.float32).contiguous()
        tables = args.block_tables
        device, heads = query.device, query.shape[1]
        if decode:
            rows = torch.tensor([starts[b] for b in decode], device=device)
            kv = [min(lens[b], window) if window > 0 else lens[b] for b in decode]  # update_sliding_window_buffer
            indptr, indices = self._kv_indices(tables[decode], [lens[b] - k for b, k in zip(decode, kv)], kv, bs,
                                               nb * bs)
            n = len(decode)
            if self.deterministic:  # get_num_kv_splits with split_tile_size; max from the pool's capacity
                max_splits = -(-nb * bs // SPLIT_TILE_SIZE)
                per = torch.tensor([max(-(-k // SPLIT_TILE_SIZE), 1) for k in kv], dtype=torch.int32, device=device)
            else:
                max_splits = splits or MAX_KV_SPLITS
                per = torch.full((n,), max_splits, dtype=torch.int32, device=device)
            o = torch.empty((n, heads, head_dim), dtype=query.dtype, device=device)
            logits = torch.empty((n, heads, max_splits, head_dim), dtype=torch.float32, device=device)
            lse = torch.empty((n, heads, max_splits), dtype=torch.float32, device=device)
            self._decode(query[rows].contiguous(), k_pool, v_pool, o, indptr, indices, logits, lse, per, max_splits,
                         args.scale, 1.0, 1.0, logit_cap=args.softcap, sinks=sink, page_size=page)
            out[rows] = o
        if extend:
            rows, o = self._extend_rows(query, k_pool, v_pool, tables, extend, starts, lens, q_lens, bs, nb, page,
                                        window, sink, args)
            out[rows] = o
        return out

    def _extend_rows(self, query, k_pool, v_pool, tables, extend, starts, lens, q_lens, bs, nb, page, window, sink,
                     args):
        """The extend kernel on the prefill rows: ``(rows int64 [n], out [n, H, D])``, ``rows`` their indices in
        the packed query."""
        device, heads, head_dim = query.device, query.shape[1], query.shape[2]
        prefix = [lens[b] - q_lens[b] for b in extend]
        kept = [min(p, window) if window > 0 else p for p in prefix]  # the window's part of the prefix
        first = [p - k for p, k in zip(prefix, kept)]
        new = [(b, p) for b in extend for p in range(lens[b] - q_lens[b], lens[b])]
        rows = torch.tensor([starts[b] + i for b in extend for i in range(q_lens[b])], device=device)
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for b, p in new], device=device)
        indptr, indices = self._kv_indices(tables[extend], first, kept, bs, nb * bs)
        n = len(extend)
        qo = torch.zeros(n + 1, dtype=torch.int32, device=device)
        qo[1:] = torch.cumsum(torch.tensor([q_lens[b] for b in extend], dtype=torch.int32, device=device), 0)
        o = torch.empty((rows.numel(), heads, head_dim), dtype=query.dtype, device=device)
        offsets = torch.tensor(first, dtype=torch.int32, device=device)
        max_q = max(q_lens[b] for b in extend)
        if self.deterministic:
            if window > 0:  # SGLang pads the window's list to whole tiles in deterministic mode
                indptr, indices = self._align(indptr, indices, offsets, n)
                offsets = torch.tensor(prefix, dtype=torch.int32, device=device) - (indptr[1:] - indptr[:-1])
            start_loc = (qo[:-1]).contiguous()
            q_len_t = torch.tensor([q_lens[b] for b in extend], dtype=torch.int32, device=device)
            u_indptr, u_indices, prefix_lens = self._build_unified(indptr, indices, start_loc, q_len_t, slots, n)
            self._unified(query[rows].contiguous(), o, k_pool, v_pool, 1.0, 1.0, qo, u_indptr, u_indices,
                          prefix_lens.to(torch.int32), max_q, sm_scale=args.scale, logit_cap=args.softcap,
                          is_causal=True, sliding_window_size=window, sinks=sink,
                          window_start_pos=offsets if window > 0 else None, page_size=page)
        else:
            self._extend(query[rows].contiguous(), k_pool[slots].contiguous(), v_pool[slots].contiguous(), o,
                         k_pool, v_pool, qo, indptr, indices, None, True, None, max_q, 1.0, 1.0,
                         sm_scale=args.scale, logit_cap=args.softcap, sliding_window_size=window, sinks=sink,
                         window_kv_offsets=offsets if window > 0 else None, page_size=page)
        return rows, o


def sglang_triton() -> SglangTriton:
    """SGLang's Triton kernels over a token pool of page size 1 (SGLang's default Triton backend)."""
    return SglangTriton("one")


def sglang_triton_paged() -> SglangTriton:
    """SGLang's Triton kernels with ``page_size = block_size`` (page-granular read table, page-aware addressing)."""
    return SglangTriton("block")


def sglang_triton_deterministic() -> SglangTriton:
    """SGLang's Triton kernels in deterministic mode (``--enable-deterministic-inference``): tile-size decode
    splits and the unified one-pass extend kernel; page size 1."""
    return SglangTriton("one", deterministic=True)


def peer_classes() -> dict[str, Any]:
    """name -> factory, for :data:`pagedkv.tools.peers.PEERS`."""
    return {"sglang_triton": sglang_triton, "sglang_triton_paged": sglang_triton_paged,
            "sglang_triton_deterministic": sglang_triton_deterministic}
