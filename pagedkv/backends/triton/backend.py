"""The ``triton`` backend: fused paged attention and token-tiled copies as Triton kernels.

``paged_attention`` reads K/V straight from the cache blocks through the block table, with an online
softmax, as vLLM's paged attention does (no gather); one kernel serves decode and prefill over a
cached prefix. ``gather``, ``scatter`` and ``write_kv`` (vLLM ``reshape_and_cache``) are copy kernels.
The kernels live in :mod:`pagedkv.backends.triton.kernels`; the readable torch version of the attention
algorithm is :mod:`pagedkv.attention.blockwise`.

Without a CUDA device the kernels run on the CPU in Triton's interpreter: importing this module sets
``TRITON_INTERPRET=1`` (unless already set) before Triton defines any kernel. Importing it raises
``ImportError`` when Triton is missing and :class:`~pagedkv.errors.BackendUnavailableError` when
there is no CUDA device and Triton is not in interpreter mode (``TRITON_INTERPRET=0``, or ``triton``
imported before the variable was set: set it before importing triton).
"""

from __future__ import annotations

import torch

from pagedkv.backends.interpreter import choose_interpreter

choose_interpreter()

import triton  # noqa: E402,F401  (ImportError here: the registry reports the backend unavailable)

from pagedkv.backends.triton import kernels as _kernels  # noqa: E402
from pagedkv.backends.capabilities import Sizes  # noqa: E402
from pagedkv.backends.ops import backend_op  # noqa: E402
from pagedkv.backends.triton.merge import merge_attn_states as _merge_kernel  # noqa: E402
from pagedkv.attention.merge import check_merge_attn_states  # noqa: E402
from pagedkv.validation.calls import AttentionArgs, WriteArgs, check_write_overlap  # noqa: E402

_kernels.check_runnable()  # BackendUnavailableError: no CUDA and triton was imported without the interpreter

name = "triton"
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})
#: What specialises the kernels (``tl.constexpr``: BLOCK_SIZE, HEAD_DIM, QUERIES_PER_KV, the dtype, the
#: feature flags): the suite draws them from a per-run palette (``Capabilities.specialize_on``).
SPECIALIZE_ON = frozenset({"block_size", "head_dim", "gqa_group", "dtype", "features"})
#: ``paged_attention`` takes ``num_splits`` (split-K decode); the conformance suite draws split counts.
SPLIT_K = True
#: ``paged_attention(..., return_lse=True)`` returns ``(out, lse)``: lse ``float32 [num_q_heads, total_q]`` in
#: base 2 (the kernel's exp2 softmax), as ``merge_attn_states`` takes it; V may differ in width from K or be a
#: view of K's first columns (MLA's latent cache: K 576 = 512 + 64 rope, V its first 512).
LSE, LSE_BASE, HEAD_DIMS_V = "head_major", "2", Sizes()


@backend_op(FEATURES)
def gather(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A token-tiled copy kernel (any pool strides; a contiguous output)."""
    return _kernels.gather(cache, table, int(seq_len))


@backend_op(FEATURES)
def scatter(cache: torch.Tensor, table: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """A token-tiled copy kernel (any strides)."""
    _kernels.scatter(cache, table, values, int(start))


@backend_op(FEATURES)
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             w: WriteArgs) -> None:
    """One copy kernel for both pools (into an fp8 pool it stores ``sat(x / scale)`` rounded to nearest
    even, :func:`pagedkv.attention.fp8.quantize`); the custom op ``pagedkv::triton_write_kv`` under
    ``torch.compile``."""
    call = torch.ops.pagedkv.triton_write_kv if torch.compiler.is_compiling() else write_kv_eager
    call(k_cache, v_cache, key, value, w.slots, w.k_scale, w.v_scale, w.check_overlap)


def write_kv_eager(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slots: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                   check_overlap: bool) -> None:
    """The write kernel's launcher as an opaque op (negative slots are skipped in the kernel: no host read).

    A ``custom_op``, not a ``triton_op``: Triton's interpreter (the CPU) cannot run under fake tensors,
    and the launchers in :mod:`pagedkv.backends.triton.kernels` call their kernels without ``wrap_triton``.
    """
    if check_overlap:
        check_write_overlap(k_cache, v_cache, key, value)
    _kernels.write_kv(k_cache, v_cache, key, value, slots.contiguous(), k_scale, v_scale)


#: The registered op (``torch.ops.pagedkv.triton_write_kv``): the graph node under ``torch.compile``.
write_kv_op = torch.library.custom_op("pagedkv::triton_write_kv", mutates_args=("k_cache", "v_cache"))(
    write_kv_eager)


@write_kv_op.register_fake
def _(k_cache, v_cache, key, value, slots, k_scale, v_scale, check_overlap) -> None:
    return None


@backend_op(FEATURES)
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    args: AttentionArgs) -> torch.Tensor:
    """One fused kernel (vLLM paged attention, flash-attn varlen): K/V are read block by block through
    the table inside the kernel (never gathered) with an online softmax in float32; decode and prefill
    share it. Each program serves one sequence, one kv head and a tile of query tokens with the kv
    head's whole GQA group, so K/V are read once per group. No slot at a position ``>= seq_len`` is
    loaded, nor any before the first visible key of a query tile. Below level ``"full"`` the grid is
    sized for ``max_q_len = total_q`` (no host read of ``query_start_loc``; tiles past a sequence's
    queries exit at once); under ``torch.compile`` the custom op ``pagedkv::triton_paged_attention``.

    Split-K (flash-decoding, as vLLM's and FlashInfer's decode kernels): ``num_splits`` cuts each
    query tile's context into that many parts, computed by separate programs and merged by a second
    kernel (their partial max, sum and accumulator, in float32): equal to the unsplit kernel within
    float32 rounding. ``None`` (the default): ``$PAGEDKV_NUM_SPLITS`` when set (an int ``>= 1``, read at
    each call; :func:`pagedkv.backends.triton.kernels.splits` sets it for a block of code), else on CUDA
    :func:`pagedkv.backends.launch_grid.choose_num_splits` for decode batches too small to fill the
    SMs, else 1. ``1``: never split."""
    max_q_len = -1
    if args.host_q_starts is not None:
        max_q_len = max((hi - lo for lo, hi in zip(args.host_q_starts, args.host_q_starts[1:])), default=0)
    if args.return_lse:  # two outputs: the launcher itself (not the registered single-output op)
        dense = (lambda x: None if x is None else x.contiguous())
        return _kernels.paged_attention(
            query, k_cache, v_cache, args.block_tables, args.seq_lens_tensor.contiguous(),
            args.query_start_loc.contiguous(), args.scale, query.shape[0] if max_q_len < 0 else max_q_len,
            window_left=args.window_left, softcap=args.softcap, alibi_slopes=dense(args.alibi_slopes),
            sinks=dense(args.sinks), k_scale=dense(args.k_scale), v_scale=dense(args.v_scale),
            num_splits=args.num_splits, return_lse=True)
    call = torch.ops.pagedkv.triton_paged_attention if torch.compiler.is_compiling() else paged_attention_eager
    return call(query, k_cache, v_cache, args.block_tables, args.seq_lens_tensor, args.query_start_loc, args.scale,
                max_q_len, args.window_left, args.softcap, args.alibi_slopes, args.sinks, args.k_scale, args.v_scale,
                args.num_splits)


def paged_attention_eager(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, max_q_len: int, window_left: int, softcap: float,
                          alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
                          k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                          num_splits: int | None = None) -> torch.Tensor:
    """The attention kernel's launcher as an opaque op (``max_q_len < 0``: bounded by ``total_q``;
    ``num_splits``: as :func:`paged_attention`)."""
    # The kernel indexes seq_lens, query_start_loc, slopes, sinks and scales as dense arrays.
    dense = (lambda x: None if x is None else x.contiguous())
    return _kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens.contiguous(),
                                    query_start_loc.contiguous(), scale, query.shape[0] if max_q_len < 0 else max_q_len,
                                    window_left=window_left, softcap=softcap, alibi_slopes=dense(alibi_slopes),
                                    sinks=dense(sinks), k_scale=dense(k_scale), v_scale=dense(v_scale),
                                    num_splits=num_splits)


#: The registered op (``torch.ops.pagedkv.triton_paged_attention``): the graph node under ``torch.compile``.
paged_attention_op = torch.library.custom_op("pagedkv::triton_paged_attention", mutates_args=())(
    paged_attention_eager)


@paged_attention_op.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len, window_left, softcap,
      alibi_slopes, sinks, k_scale, v_scale, num_splits=None) -> torch.Tensor:
    return query.new_empty((*query.shape[:2], v_cache.shape[-1]))


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton merge of two partial attention states (vLLM ``merge_attn_states``), this backend's LSE layout
    and base (head-major, base 2): ``(out [total_q, num_heads, head_dim_v], lse float32 [num_heads, total_q])``.
    Checked first (:func:`pagedkv.attention.merge.check_merge_attn_states`); the definition is
    :func:`pagedkv.attention.merge.merge_states`."""
    check_merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, LSE)
    return _merge_kernel(prefix_out, prefix_lse, suffix_out, suffix_lse)
