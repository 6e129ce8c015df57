"""vLLM's and SGLang's Triton MLA decode kernels and vLLM's Triton merge of attention states, as CPU peers::

    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:vllm_triton_decode
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:vllm_merge_attn_states
    pytest --pyargs pagedkv.testing.suite --pagedkv-impl pagedkv.tools.peers:sglang_triton_decode

- :class:`VllmTritonDecode`: ``vllm/v1/attention/ops/triton_decode_attention.py``'s ``decode_attention_fwd``
  (two-stage split-KV decode: stage 1 writes each split's output and log-sum-exp, stage 2 merges them and
  writes the row's LSE), called as vLLM's ``TritonMLAImpl.forward_mqa`` calls it: MLA (one latent pool,
  ``v_cache`` its first ``head_dim_v`` columns, ``is_mla=True``) or plain GQA/MHA pools of any widths.
- :class:`VllmMergeAttnStates`: ``vllm/v1/attention/ops/triton_merge_attn_states.py``'s ``merge_attn_states``,
  the merge vLLM selects where its CUDA kernel is not built (ROCm before CDNA3, XPU, any head size the CUDA
  kernel cannot pack).
- :class:`SglangTritonDecode`: ``sglang/kernels/ops/attention/decode_attention.py``'s ``decode_attention_fwd``
  with token-level CSR indices (page size 1) and per-request split counts, ``has_mla`` on a latent pool.

Neither decode kernel has a causal mask: like ``forward_mqa`` for a multi-token block, the adapters give
each query token its own decode row whose keys are the sequence's first ``seq_len - q_len + i + 1``
(query ``i`` of the sequence), so prefill rows run through the same kernel as decode rows. Without CUDA
the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which pagedkv sets); bfloat16 is then
left out of the declared dtypes (the interpreter computes on bfloat16 bit patterns), so these peers are
judged in float32 and float16 on a CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pagedkv.backends.capabilities import ANY, Capabilities
from pagedkv.backends.interpreter import wrap_interpreted_launches
from pagedkv.errors import BackendUnavailableError, DTypeMismatchError, ShapeError
from pagedkv.tools.peers.sglang import RECIPE as SGLANG_RECIPE
from pagedkv.tools.peers.sglang import SglangTriton
from pagedkv.tools.peers.vllm import _real_triton_in_vllm, _unavailable
from pagedkv.validation.arguments import check_num_splits
from pagedkv.validation.calls import check_paged_attention

#: vLLM's ``triton_mla._MIN_WORK_PER_SPLIT``: its default split count is ``next_power_of_2(max_seq_len // 512)``
#: (capped there at twice the SM count, which a CPU has not).
MIN_WORK_PER_SPLIT = 512
#: SGLang's default ``--triton-attention-num-kv-splits``.
SGLANG_MAX_KV_SPLITS = 8
#: The core count SGLang's per-request split heuristic (``get_num_kv_splits_triton``) is given: an H100's 132
#: SMs (``get_device_core_count`` is 0 off CUDA, which would make every request's count the static maximum).
SGLANG_CORE_COUNT = 132


def _interpreted() -> bool:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


_interpreted()  # before Triton's import: without CUDA the kernels run in its interpreter
try:  # the peers launch Triton kernels: the suite reads this module's Triton (pagedkv.testing.space) to know
    import triton  # noqa: F401  # their kernels specialise (a palette) and, on a CPU, are interpreted (fewer examples)
except ImportError:
    triton = None


def shares_storage(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``True`` when ``v_cache`` is ``k_cache[..., :head_dim_v]`` (MLA's latent pool: same storage, same
    block, slot and head strides, narrower)."""
    return (v_cache.shape[:3] == k_cache.shape[:3] and v_cache.shape[3] <= k_cache.shape[3]
            and v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride())


def decode_rows(args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode row per query token: ``(sequence int64 [total_q], keys int32 [total_q])``, query ``i`` of a
    sequence with ``q_len`` queries and ``seq_len`` keys seeing its first ``seq_len - q_len + i + 1`` keys (the
    causal extent, as ``forward_mqa`` builds it for a multi-token block)."""
    seqs, keys = [], []
    for b, seq_len in enumerate(args.seq_lens):
        q_len = args.q_starts[b + 1] - args.q_starts[b]
        seqs += [b] * q_len
        keys += range(seq_len - q_len + 1, seq_len + 1)
    return (torch.tensor(seqs, dtype=torch.int64, device=device),
            torch.tensor(keys, dtype=torch.int32, device=device))



def _judged_dtypes() -> set[str]:
    """float32 and float16, and bfloat16 where the kernels are compiled (Triton's interpreter multiplies
    bfloat16 bit patterns: not the peer's arithmetic)."""
    return {"float32", "float16"} if _interpreted() else {"float32", "float16", "bfloat16"}


def _vllm_triton_op(module: str, attr: str, what: str):
    """``vllm.v1.attention.ops.<module>.<attr>`` with the real Triton given back to vLLM first, launches
    wrapped for the interpreter.

    Raises:
        BackendUnavailableError: vLLM (or the module) is not installed, naming the install recipe.
    """
    import importlib

    try:
        _real_triton_in_vllm()
        op = getattr(importlib.import_module(f"vllm.v1.attention.ops.{module}"), attr)
    except ImportError as exc:
        raise _unavailable(what, exc) from exc
    wrap_interpreted_launches()
    return op


# -- vLLM: triton_decode_attention.decode_attention_fwd --------------------------------------------------------
class VllmTritonDecode:
    """vLLM's Triton split-KV decode (``decode_attention_fwd``) as ``paged_attention``, with its LSE.

    Called as ``TritonMLAImpl.forward_mqa`` calls it: pagedkv's NHD pools as vLLM's paged buffers
    (``[num_blocks, block_size, num_kv_heads, head_dim]``, any block stride), ``req_to_token`` the block
    tables as ``int32``, ``page_size = block_size``, one decode row per query token (module docstring),
    ``attn_logits float32 [rows, num_q_heads, num_kv_splits, head_dim_v + 1]`` filled with NaN (vLLM's is
    a reused workspace: a split read that nothing wrote shows). ``is_mla=True`` exactly when ``v_cache``
    is the first ``head_dim_v`` columns of ``k_cache`` with one kv head (the kernel then reads V from K's
    tile and never loads ``v_cache``); otherwise the plain path, MHA (``_fwd_kernel_stage1``) or GQA
    (``_fwd_grouped_kernel_stage1``) by the group size.

    ``num_splits`` is ``num_kv_splits`` (one count for the batch); ``None`` is vLLM's
    ``next_power_of_2(max(1, max_seq_len // 512))``. The LSE is stage 2's, natural log, one per row and
    head (``[total_q, num_q_heads]``, FlashInfer's token-major layout), in float32 (vLLM's backend
    allocates it in the query dtype; the adapter keeps the kernel's float32). No features:
    ``TritonMLAImpl`` refuses a window, soft-cap and ALiBi.

    Raises: pagedkv's validation errors (``check_paged_attention``, V's width free) before any launch.
    """

    name = "vllm_triton_decode"

    def __init__(self) -> None:
        self._decode = _vllm_triton_op("triton_decode_attention", "decode_attention_fwd",
                                       "Triton decode attention (triton_decode_attention)")
        self.capabilities = Capabilities(dtypes=_judged_dtypes(), split_k=True, head_dims_v=ANY,
                                         lse="token_major", lse_base="e")

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, *,
                        num_splits=None, return_lse=False):
        """``decode_attention_fwd(q, k_cache, v_cache, o, lse, req_to_token, b_seq_len, attn_logits,
        num_kv_splits, scale, block_size, is_mla=)`` over one row per query token.

        Returns ``out [total_q, num_q_heads, head_dim_v]`` in the query dtype, and with ``return_lse``
        also ``lse float32 [total_q, num_q_heads]`` (natural log)."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        splits = check_num_splits(num_splits)
        total_q, heads = query.shape[:2]
        head_dim_v, device = v_cache.shape[3], query.device
        out = torch.zeros((total_q, heads, head_dim_v), dtype=query.dtype, device=device)
        lse = torch.full((total_q, heads), float("-inf"), dtype=torch.float32, device=device)
        if total_q:
            seqs, keys = decode_rows(args, device)
            if splits is None:
                splits = 1 << max(0, (max(1, int(keys.max()) // MIN_WORK_PER_SPLIT) - 1).bit_length())
            logits = torch.full((total_q, heads, splits, head_dim_v + 1), float("nan"), dtype=torch.float32,
                                device=device)
            mla = k_cache.shape[2] == 1 and shares_storage(k_cache, v_cache)
            self._decode(query.contiguous(), k_cache, v_cache, out, lse,
                         args.block_tables[seqs].to(torch.int32).contiguous(), keys, logits, splits, args.scale,
                         k_cache.shape[1], is_mla=mla)
        return (out, lse) if return_lse else out


# -- vLLM: triton_merge_attn_states.merge_attn_states ----------------------------------------------------------
def check_merge_states(prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """Outputs ``[num_tokens, num_heads, head_dim]`` alike (shape, dtype, device); LSEs float32
    ``[num_heads, num_tokens]`` (head-major, vLLM's layout) on the outputs' device.

    Raises: ``ShapeError`` / ``DTypeMismatchError`` naming the argument."""
    for name, x in (("prefix_out", prefix_out), ("suffix_out", suffix_out)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ShapeError(f"{name} must be a [num_tokens, num_heads, head_dim] tensor")
    if suffix_out.shape != prefix_out.shape:
        raise ShapeError(f"suffix_out {tuple(suffix_out.shape)} != prefix_out {tuple(prefix_out.shape)}")
    if suffix_out.dtype != prefix_out.dtype or suffix_out.device != prefix_out.device:
        raise DTypeMismatchError(f"suffix_out is {suffix_out.dtype} on {suffix_out.device}, prefix_out "
                                 f"{prefix_out.dtype} on {prefix_out.device}")
    tokens, heads = prefix_out.shape[:2]
    for name, x in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (heads, tokens):
            raise ShapeError(f"{name} must be [num_heads, num_tokens] = [{heads}, {tokens}]")
        if x.dtype != torch.float32 or x.device != prefix_out.device:
            raise DTypeMismatchError(f"{name} must be float32 on {prefix_out.device}, got {x.dtype} on {x.device}")


class VllmMergeAttnStates:
    """vLLM's Triton ``merge_attn_states`` as the contract's merge (section 2.2 of arXiv:2501.01005).

    ``merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse) -> (out, lse)``: outputs
    ``[num_tokens, num_heads, head_dim]``, LSEs float32 ``[num_heads, num_tokens]`` natural log (vLLM's
    head-major layout); every token merged (``prefill_tokens_with_context`` = all), no FP8 output. An LSE of
    ``+inf`` is taken as "no keys" (FlashAttention 2's), as ``-inf`` is; both sides empty give out 0 and
    LSE ``-inf``. The kernel addresses ``suffix_out`` with ``prefix_out``'s strides (vLLM's dispatcher
    asserts equal head strides), so both are passed contiguous. No ``paged_attention``: the suite's
    producers are pagedkv's own.

    Raises: :func:`check_merge_states`'s errors before the launch.
    """

    name = "vllm_merge_attn_states"

    def __init__(self) -> None:
        self._merge = _vllm_triton_op("triton_merge_attn_states", "merge_attn_states", "Triton merge_attn_states")
        self.capabilities = Capabilities(dtypes=_judged_dtypes(), lse="head_major", lse_base="e")

    def merge_attn_states(self, prefix_out, prefix_lse, suffix_out, suffix_lse):
        """``merge_attn_states(out, prefix_out, prefix_lse, suffix_out, suffix_lse, out_lse)``; returns
        ``(out like prefix_out, lse float32 [num_heads, num_tokens])``."""
        check_merge_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
        out = torch.empty_like(prefix_out, memory_format=torch.contiguous_format)
        out_lse = torch.empty_like(prefix_lse, memory_format=torch.contiguous_format)
        if out.numel():
            self._merge(out, prefix_out.contiguous(), prefix_lse, suffix_out.contiguous(), suffix_lse, out_lse)
        elif out_lse.numel():  # head_dim 0: no launch, the LSE is still the merge's
            out_lse.copy_(torch.logaddexp(prefix_lse, suffix_lse))
        return out, out_lse


# -- SGLang: decode_attention.decode_attention_fwd -------------------------------------------------------------
class SglangTritonDecode(SglangTriton):
    """SGLang's Triton split-KV decode (``decode_attention_fwd``) as ``paged_attention``, MLA shapes included.

    The pool as SGLang's token pool (``[num_blocks * block_size, num_kv_heads, head_dim]``, a view where
    the strides allow, page size 1), token-level CSR ``kv_indptr`` / ``kv_indices`` built by SGLang's
    ``create_flashinfer_kv_indices_triton`` from a ``req_to_token`` table of slots (one row per query token,
    module docstring), ``attn_logits float32 [rows, H, max_kv_splits, head_dim_v]`` and ``attn_lse float32
    [rows, H, max_kv_splits]`` NaN-filled. ``has_mla=True`` when ``v_cache`` is the first ``head_dim_v``
    columns of ``k_cache`` and SGLang's MLA tiles take the widths (:func:`mla_tiles_fit`: 576 / 512 and
    288 / 256 among them; V read from K's tile); a latent pool of other widths runs the plain path, V read
    through its view.

    Splits: ``num_splits`` is ``max_kv_splits`` (``None``: SGLang's 8), and each request's count is
    SGLang's ``get_num_kv_splits_triton`` on the rows' key counts with :data:`SGLANG_CORE_COUNT` cores, so
    requests of one batch get different counts, as on a GPU. SGLang's stage 2 writes no LSE: none is
    declared. No features (the decode kernel's window is the caller's buffer; see ``sglang_triton``).
    ``max_pool_bytes`` as ``sglang_triton``'s at page size 1 (2**32): SGLang's ``ReqToTokenPool.req_to_token``,
    which the token slots come from, is int32, so SGLang names no slot past 2**31 (``INT32_TOKEN_TABLE``).
    ``write_kv`` is SGLang's, as in :class:`~pagedkv.tools.peers.sglang.SglangTriton`.
    """

    def __init__(self) -> None:
        super().__init__("one")
        try:
            from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
        except ImportError as exc:
            raise BackendUnavailableError(f"sglang has no get_num_kv_splits_triton ({exc}); install: "
                                          f"{SGLANG_RECIPE}") from exc
        self._num_splits = get_num_kv_splits_triton
        self.name = "sglang_triton_decode"
        # the token table is SGLang's int32 req_to_token (INT32_TOKEN_TABLE): the parent's max_pool_bytes holds
        self.capabilities = Capabilities(dtypes=self.capabilities.dtypes, split_k=True, head_dims_v=ANY,
                                         max_pool_bytes=self.capabilities.max_pool_bytes)

    def split_counts(self, keys: torch.Tensor, heads: int, kv_heads: int, max_splits: int) -> torch.Tensor:
        """Per-row split counts, ``int32 [rows]``, from SGLang's ``get_num_kv_splits_triton``."""
        counts = torch.empty_like(keys)
        rows = keys.numel()
        self._num_splits[(1,)](counts, keys, rows, 1, heads, kv_heads, max_splits, SGLANG_CORE_COUNT,
                               MAX_NUM_SEQ=max(256, 1 << (rows - 1).bit_length()))
        return counts

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, *,
                        num_splits=None):
        """``decode_attention_fwd(q, k_pool, v_pool, o, kv_indptr, kv_indices, attn_logits, attn_lse,
        num_kv_splits, max_kv_splits, scale, 1.0, 1.0, has_mla=)`` over one row per query token; returns
        ``out [total_q, num_q_heads, head_dim_v]``."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        max_splits = check_num_splits(num_splits) or SGLANG_MAX_KV_SPLITS
        total_q, heads = query.shape[:2]
        nb, bs, kv_heads, _ = k_cache.shape
        head_dim_v, device = v_cache.shape[3], query.device
        out = torch.zeros((total_q, heads, head_dim_v), dtype=query.dtype, device=device)
        if not total_q:
            return out
        mla = shares_storage(k_cache, v_cache) and mla_tiles_fit(k_cache.shape[3], head_dim_v)
        k_pool = _token_pool(k_cache)
        v_pool = k_pool[..., :head_dim_v] if mla else _token_pool(v_cache)
        seqs, keys = decode_rows(args, device)
        indptr, indices = self._kv_indices(args.block_tables[seqs], [0] * total_q, keys.tolist(), bs, nb * bs)
        nan = dict(fill_value=float("nan"), dtype=torch.float32, device=device)
        logits = torch.full((total_q, heads, max_splits, head_dim_v), **nan)
        lse = torch.full((total_q, heads, max_splits), **nan)
        self._decode(query.contiguous(), k_pool, v_pool, out, indptr, indices, logits, lse,
                     self.split_counts(keys, heads, kv_heads, max_splits), max_splits, args.scale, 1.0, 1.0,
                     has_mla=mla)
        return out


def mla_tiles_fit(head_dim: int, head_dim_v: int) -> bool:
    """Whether SGLang's ``has_mla`` stage 1 takes these widths: its K tile (512 for 576, 256 for 288, else the
    next power of two of ``head_dim``) is read back as V, so it must be V's tile (the next power of two of
    ``head_dim_v``); other shapes fail to launch (``Cannot make_shape_compatible``) and run the plain path."""
    tile = {576: 512, 288: 256}.get(head_dim, 1 << (head_dim - 1).bit_length())
    return tile == 1 << (head_dim_v - 1).bit_length()


def _token_pool(cache: torch.Tensor) -> torch.Tensor:
    """NHD ``[nb, bs, H, D]`` as ``[nb * bs, H, D]``: a view when the strides allow, else a contiguous copy."""
    nb, bs, h, d = cache.shape
    try:
        return cache.view(nb * bs, h, d)
    except RuntimeError:
        return cache.reshape(nb * bs, h, d).contiguous()


def sglang_triton_decode() -> SglangTritonDecode:
    return SglangTritonDecode()


def peer_classes() -> dict[str, Any]:
    """name -> factory, for :data:`pagedkv.tools.peers.PEERS`."""
    return {"vllm_triton_decode": VllmTritonDecode, "vllm_merge_attn_states": VllmMergeAttnStates,
            "sglang_triton_decode": sglang_triton_decode}


__all__ = ["VllmTritonDecode", "VllmMergeAttnStates", "SglangTritonDecode", "check_merge_states", "decode_rows",
           "mla_tiles_fit", "shares_storage"]
