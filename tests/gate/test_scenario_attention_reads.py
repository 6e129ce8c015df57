"""A backend without ``gather`` (an attention kernel with its own KV write, as SGLang's and vLLM's decode
peers) is read back in the cache scenarios through its ``paged_attention``: every live sequence, every
layer, after every op, in one batch a layer, against the fp64 reference over the sequence's own tokens."""

from __future__ import annotations

import pytest

from pagedkv import get_backend
from pagedkv.testing.cases.case import CacheScenario, Geometry
from pagedkv.testing.properties.scenarios import Mismatch, sharing_isolated

INDEXED = get_backend("indexed")
# two prompts sharing a 4-token prefix, a fork with an append on each side, a free: 2-3 live sequences
SCENARIO = CacheScenario(Geometry(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=4, num_queries_per_kv=2),
                         (("add", 0, (1, 2, 3, 4, 5, 6)), ("add", 1, (1, 2, 3, 4, 7)), ("fork", 0, 2),
                          ("append", 0, (3,)), ("append", 2, (4, 5)), ("free", 1), ("append", 2, (6,))),
                         seed=3, num_layers=2)


class NoGather:
    """The indexed backend's write and attention, no gather; counts the attention calls."""

    name = "no_gather"

    write_kv = staticmethod(INDEXED.write_kv)

    def __init__(self, skew_batch_row: int | None = None):
        self.calls, self.skew = 0, skew_batch_row

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs):
        self.calls += 1
        out = INDEXED.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs)
        if self.skew is not None and self.skew < seq_lens.numel():  # a kernel wrong for one request of a batch
            out[int(query_start_loc[self.skew]):int(query_start_loc[self.skew + 1])] += 0.5
        return out


def test_every_live_sequence_is_read_back_through_attention_in_one_call_a_layer():
    backend = NoGather()
    sharing_isolated(backend, SCENARIO)
    checks = len(SCENARIO.ops)  # one check after each op, every op with a live sequence written
    assert backend.calls == checks * SCENARIO.num_layers


def test_a_wrong_output_for_one_request_of_the_batch_names_that_sequence():
    # the second live sequence of the batch is sequence 1 (added second): the first check with two live
    with pytest.raises(Mismatch, match=r"paged_attention over sequence 1's blocks \[.*\] \(layer 0, 5 written tokens\) "
                                       r"differs from attention over its own tokens' K/V"):
        sharing_isolated(NoGather(skew_batch_row=1), SCENARIO)


class FirstBlockOnly(NoGather):
    """Attention that reads only each sequence's first block (a table walk that never advances)."""

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *args, **kwargs):
        clipped = seq_lens.clamp(max=k_cache.shape[1])
        return INDEXED.paged_attention(query, k_cache, v_cache, block_tables, clipped, query_start_loc, *args, **kwargs)


def test_one_decode_row_a_sequence_sees_a_kernel_that_reads_only_the_first_block():
    with pytest.raises(Mismatch, match=r"sequence 0's blocks .* \(layer 0, 6 written tokens\)"):
        sharing_isolated(FirstBlockOnly(), SCENARIO)
