"""The ``loop`` backend: Python loops over blocks, one ``torch.cat`` per gather.

The simple design from the paged-attention tutorial: a gather slices each logical block out of the
pool and concatenates; a scatter writes block-sized slices; ``write_kv`` writes token by token. It
is the readable baseline the other backends are proved equal to, not a fast path: it reads block
ids, slots and lengths on the host at every validation level (no custom ops, not sync-free).
The ops' arguments, results and errors are the contract's
(:class:`pagedkv.backends.contract.PagedKVBackend`); :func:`pagedkv.backends.ops.backend_op` validates.
"""

from __future__ import annotations

import torch

from pagedkv.attention.dense import paged_attention_by_gather
from pagedkv.attention.merge import merge_attn_states as _merge
from pagedkv.backends.capabilities import Sizes
from pagedkv.backends.ops import backend_op
from pagedkv.cache.config import blocks_needed
from pagedkv.attention.fp8 import quantize
from pagedkv.validation.calls import AttentionArgs, WriteArgs

name = "loop"
#: Optional attention features this backend supports (see ``docs/contract.md``).
FEATURES = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})
#: ``paged_attention(..., return_lse=True)`` returns ``(out, lse)``, lse ``float32 [num_q_heads, total_q]``
#: (vLLM's layout) in natural log; V may be narrower or wider than K (``head_dim_v``), or a view of K (MLA).
LSE, LSE_BASE, HEAD_DIMS_V = "head_major", "e", Sizes()


@backend_op(FEATURES)
def gather(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Slice each logical block out of the pool and ``torch.cat`` the slices."""
    block_size = cache.shape[1]
    ids = table[: blocks_needed(seq_len, block_size)].tolist()
    parts = [cache[b, : min(block_size, seq_len - i * block_size)] for i, b in enumerate(ids)]
    if not parts:
        return cache.new_empty((0, *cache.shape[2:]))
    return torch.cat(parts)


@backend_op(FEATURES)
def scatter(cache: torch.Tensor, table: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """One block slice at a time."""
    n = values.shape[0]
    block_size = cache.shape[1]
    ids = table.tolist()
    pos = start
    while pos < start + n:
        offset = pos % block_size
        count = min(block_size - offset, start + n - pos)
        cache[ids[pos // block_size], offset : offset + count] = values[pos - start : pos - start + count]
        pos += count


@backend_op(FEATURES)
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             w: WriteArgs) -> None:
    """Token by token (fp8 pools: :func:`pagedkv.attention.fp8.quantize` first, as vLLM's ``kv_cache_dtype="fp8"``)."""
    slots = w.slots
    if w.k_scale is not None:  # fp8 pools: stored = sat(x / scale) (pagedkv.attention.fp8.quantize)
        key, value = quantize(key, w.k_scale, k_cache.dtype), quantize(value, w.v_scale, v_cache.dtype)
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[i]
            v_cache[slot // block_size, slot % block_size] = value[i]


@backend_op(FEATURES)
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    args: AttentionArgs) -> torch.Tensor:
    """Loop-gather each sequence (blocks before every row's window are not gathered), then dense
    attention in float32 (:func:`pagedkv.attention.dense.attend`; vLLM unified attention's order of operations)."""
    result = paged_attention_by_gather(gather, query, k_cache, v_cache, args)
    if not args.return_lse:
        return result
    out, lse = result
    return out, lse.transpose(0, 1).contiguous()  # vLLM's [num_q_heads, total_q]


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pagedkv.attention.merge.merge_attn_states` with this backend's LSE layout and base (head-major,
    natural log): ``(out [total_q, num_heads, head_dim_v], lse float32 [num_heads, total_q])``."""
    return _merge(prefix_out, prefix_lse, suffix_out, suffix_lse, layout=LSE, base=LSE_BASE)

