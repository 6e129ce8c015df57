"""Put a vLLM-style paged KV implementation under the pagedkv property suite.

Engines expose their KV ops with vLLM's signatures, not pagedkv's. This file shows the adapter that
turns such an implementation into a pagedkv backend, so the whole suite gates it::

    python -m examples.vllm_style_adapter                  # a smoke run (from the repository root)
    PAGEDKV_IMPL=examples/vllm_style_adapter.py:backend pytest -n auto
    python -m pagedkv replay .pagedkv-failures/<file>.json --impl examples/vllm_style_adapter.py:backend

The implementation here (:class:`VllmStyleOps`) is a small pure-torch stand-in so the example runs
anywhere; replace it with your kernels (``vllm._custom_ops``, your own extension) and keep the
adapter. The stand-in deliberately differs from pagedkv where real kernels do:

- its caches are ``[num_blocks, num_kv_heads, block_size, head_dim]`` ("HND"), where pagedkv's are
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD"): the adapter passes permuted *views*
  (no copy), so the kernels write straight into the suite's pools;
- ``paged_attention`` is decode-only (one query token per sequence) and writes into ``out``: the
  adapter runs prefill over a cached prefix as one decode row per query token, each with its own
  context length (causal attention is exactly that);
- it checks no arguments (kernels don't): the adapter runs pagedkv's argument checks first, so the
  contract's error rules (``IndexError`` / ``ValueError`` / ``TypeError``, nothing written) hold.
"""

from __future__ import annotations


import torch

from pagedkv.adapter import check_gather, check_paged_attention, check_scatter, check_write_kv


class VllmStyleOps:
    """A stand-in for an engine's paged KV kernels, with vLLM's signatures and an HND cache layout.

    ``key_cache``, ``value_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
    """

    @staticmethod
    def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
        """Write token ``i`` of ``key``/``value`` (``[num_tokens, num_kv_heads, head_dim]``) to slot
        ``slot_mapping[i]`` (``int64 [num_tokens]``; negative: padding, skipped)."""
        block_size = key_cache.shape[2]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.int64)
        blocks, offsets = slots // block_size, slots % block_size
        # advanced indices separated by a slice: the indexed dims come first -> [n, num_kv_heads, head_dim]
        key_cache[blocks, :, offsets] = key[keep]
        value_cache[blocks, :, offsets] = value[keep]

    @staticmethod
    def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        num_kv_heads: int, scale: float, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        block_size: int, max_seq_len: int, alibi_slopes: torch.Tensor | None = None) -> None:
        """Decode attention: ``query[i]`` (``[num_seqs, num_heads, head_dim]``) attends to the first
        ``seq_lens[i]`` tokens of row ``i`` of ``block_tables``; the result goes to ``out[i]``."""
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        for i, seq_len in enumerate(seq_lens.tolist()):
            if seq_len == 0:
                continue
            pos = torch.arange(seq_len, device=query.device)
            blocks = block_tables[i].to(torch.int64)[pos // block_size]
            k = key_cache[blocks, :, pos % block_size].float()  # [seq_len, num_kv_heads, head_dim]
            v = value_cache[blocks, :, pos % block_size].float()
            q = query[i].float().view(num_kv_heads, group, -1)  # head h -> kv head h // group
            logits = torch.einsum("kgd,lkd->kgl", q, k) * scale
            probs = torch.softmax(logits, dim=-1)
            out[i] = torch.einsum("kgl,lkd->kgd", probs, v).reshape(num_heads, -1).to(out.dtype)

    @staticmethod
    def gather_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                     batch_size: int) -> None:
        """Copy sequence ``b``'s tokens (rows ``cu_seq_lens[b]:cu_seq_lens[b+1]`` of ``dst``,
        ``[total_tokens, num_kv_heads, head_dim]``) out of the paged ``src_cache``."""
        block_size = src_cache.shape[2]
        bounds = cu_seq_lens.tolist()
        for b in range(batch_size):
            pos = torch.arange(bounds[b + 1] - bounds[b], device=src_cache.device)
            blocks = block_table[b].to(torch.int64)[pos // block_size]
            dst[bounds[b]:bounds[b + 1]] = src_cache[blocks, :, pos % block_size]


class VllmStyleBackend:
    """The adapter: pagedkv's four ops on top of :class:`VllmStyleOps` (or any object with its methods).

    Args:
        ops: the vLLM-style implementation.
    """

    name = "vllm_style"

    def __init__(self, ops=VllmStyleOps) -> None:
        self.ops = ops

    @staticmethod
    def _hnd(cache: torch.Tensor) -> torch.Tensor:
        """pagedkv's ``[num_blocks, block_size, H, D]`` pool as the kernels' ``[num_blocks, H, block_size, D]``
        (a view)."""
        return cache.permute(0, 2, 1, 3)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping) -> None:
        """pagedkv ``write_kv`` = vLLM ``reshape_and_cache`` (same arguments, reordered)."""
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        self.ops.reshape_and_cache(key, value, self._hnd(k_cache), self._hnd(v_cache), slots)

    def scatter(self, cache, block_table, values, start=0) -> None:
        """pagedkv ``scatter`` = ``reshape_and_cache`` with the slots of positions ``start ..``.

        The kernel writes K and V together; the suite's ``scatter`` writes one pool, so the same pool
        is passed twice (the second write stores the same values again).
        """
        table, start, n = check_scatter(cache, block_table, values, start)
        bs = cache.shape[1]
        pos = torch.arange(start, start + n, device=cache.device)
        slots = table[pos // bs] * bs + pos % bs
        self.ops.reshape_and_cache(values, values, self._hnd(cache), self._hnd(cache), slots)

    def gather(self, cache, block_table, seq_len):
        """pagedkv ``gather`` = ``gather_cache`` of a batch of one."""
        table, seq_len = check_gather(cache, block_table, seq_len)
        out = cache.new_empty((seq_len, *cache.shape[2:]))
        cu = torch.tensor([0, seq_len], dtype=torch.int32, device=cache.device)
        self.ops.gather_cache(self._hnd(cache), out, table.unsqueeze(0), cu, 1)
        return out

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        """pagedkv's varlen causal ``paged_attention`` as one decode call: query row ``i`` of sequence
        ``b`` becomes a decode row with context length ``seq_lens[b] - q_len_b + i + 1``."""
        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        rows, ctx = [], []
        for b, seq_len in enumerate(args.seq_lens):
            q_len = args.q_starts[b + 1] - args.q_starts[b]
            rows += [b] * q_len
            ctx += [seq_len - q_len + i + 1 for i in range(q_len)]
        out = torch.empty_like(query)
        if not rows:
            return out
        device = query.device
        tables = args.block_tables[torch.tensor(rows, device=device)]
        self.ops.paged_attention(out, query, self._hnd(k_cache), self._hnd(v_cache), k_cache.shape[2], args.scale,
                                 tables, torch.tensor(ctx, dtype=torch.int32, device=device), k_cache.shape[1],
                                 max(ctx))
        return out


#: ``PAGEDKV_IMPL=examples/vllm_style_adapter.py:backend``
backend = VllmStyleBackend()


if __name__ == "__main__":  # a smoke run of a few properties, without pytest
    from pagedkv.testing.properties import definitions as checks, invariances
    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec

    case = Case(Geometry(8, 4, 2, 8, num_queries_per_kv=3), (SeqSpec((6, 1), 5, 2, 3), SeqSpec((0, 4, 2, 7), 13, 4, 9)),
                values="identity", poison="nan", pad_columns=1)
    for check in (checks.gather_matches_definition, checks.scatter_round_trip, checks.write_kv_matches_definition,
                  checks.attention_matches_reference, invariances.decode_matches_prefill):
        check(backend, case)
        print(f"{check.__name__}: passes")
    print("run the full suite: PAGEDKV_IMPL=examples/vllm_style_adapter.py:backend pytest")
