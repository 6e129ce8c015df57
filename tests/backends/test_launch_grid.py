"""Launch grids of the Triton kernels stay within CUDA's limits at any batch (up to 2**20 sequences) and
any number of query tiles, and the packed-tile grid serves every query tile exactly once. Pure
arithmetic (:mod:`pagedkv.backends.triton.launch_grid`): nothing is launched, no Triton needed. The
65,537-sequence decode itself (case C15) runs on a GPU, or on CPU under the ``nightly`` profile."""

from __future__ import annotations

import bisect
import os
import random

import pytest
import torch

from pagedkv.backends.triton.launch_grid import (MAX_GRID, MAX_SPLITS, attention_grid, cdiv, check_grid,
                                                 choose_num_splits,
                                          copy_grid, merge_grid)

BATCHES = (1, 2, 3, 1000, 65535, 65536, 65537, 2**17 + 3, 2**20)
Q_LENS = (0, 1, 2, 4, 15, 16, 17, 64, 65, 4096, 2**16 + 1, 2**20)
BLOCK_QS = (1, 2, 4, 5, 8, 16, 32, 64)  # BLOCK_M // group: 16 // 16 .. 64 // 1 (decode and prefill tiles)


def _within(grid):
    assert len(grid) <= 3 and all(0 <= n <= lim for n, lim in zip(grid, MAX_GRID)), grid


def test_attention_grid_is_within_cuda_limits_for_every_batch_and_query_length():
    for batch in BATCHES:
        for max_q_len in Q_LENS:
            # the worst packing: every sequence at max_q_len, capped at 2**30 query tokens (a query tensor
            # of 2**30 tokens is already 2 TiB at 16 heads x 64 dims in bfloat16)
            total_q = min(batch * max_q_len, 2**30)
            for block_q in BLOCK_QS:
                for splits in (1, 2, MAX_SPLITS):
                    grid, search = attention_grid(batch, total_q, 8, max_q_len, block_q, splits)
                    _within(grid)
                    assert search == (max_q_len > block_q)
                    assert grid[0] >= (batch if not search else cdiv(total_q, block_q))


def test_decode_grid_is_one_program_per_sequence_on_axis_0():
    grid, search = attention_grid(65537, 65537, 8, 1, 4, 1)
    assert grid == (65537, 8, 1) and not search
    grid, search = attention_grid(2**20, 2**20, 64, 1, 1, 1)
    assert grid == (2**20, 64, 1) and not search


def _programs_of(query_start_loc: list[int], block_q: int, programs: int) -> dict[tuple[int, int], int]:
    """(sequence, q tile) -> program, as the kernel maps them (binary search over tile starts)."""
    starts = [q // block_q + s for s, q in enumerate(query_start_loc[:-1])]
    served: dict[tuple[int, int], int] = {}
    for pid in range(programs):
        seq = bisect.bisect_right(starts, pid) - 1
        q_tile = pid - starts[seq]
        q_len = query_start_loc[seq + 1] - query_start_loc[seq]
        if q_tile * block_q >= q_len:
            continue  # past the sequence's last tile: returns at once
        assert (seq, q_tile) not in served
        served[(seq, q_tile)] = pid
    return served


@pytest.mark.parametrize("seed", range(20))
def test_packed_query_tiles_serve_every_tile_exactly_once(seed):
    rng = random.Random(seed)
    batch = rng.randint(1, 40)
    q_lens = [rng.choice([0, 1, 2, 3, 7, 16, 17, 33, 100]) for _ in range(batch)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    block_q = rng.choice(BLOCK_QS)
    grid, search = attention_grid(batch, qsl[-1], 2, max(q_lens), block_q)
    if not search:  # every query fits one tile: program b is sequence b
        assert grid[0] == batch and max(q_lens) <= block_q
        return
    served = _programs_of(qsl, block_q, grid[0])
    needed = {(s, t) for s, q in enumerate(q_lens) for t in range(cdiv(q, block_q))}
    assert set(served) == needed


def test_split_count_fills_the_sms_and_stays_within_the_grid():
    assert choose_num_splits(1, 8, 65536, 132) == cdiv(2 * 132, 8)
    assert choose_num_splits(64, 8, 65536, 132) == 1  # 512 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 300, 132) == 1  # too short to split
    assert choose_num_splits(1, 1, 2**20, 132) == MAX_SPLITS
    for batch in (1, 4, 16, 2**20):
        for heads in (1, 8, 64):
            for ctx in (1, 255, 256, 16384, 131072, 2**24):
                n = choose_num_splits(batch, heads, ctx, 132)
                assert 1 <= n <= MAX_SPLITS
                _within(attention_grid(batch, batch, heads, 1, 4, n)[0])


def test_merge_and_copy_grids_are_within_limits():
    _within(merge_grid(2**20, 128))
    _within(copy_grid(2**31, 8, 64, 1))
    with pytest.raises(ValueError, match="axis 1"):
        merge_grid(1, 70000)
    with pytest.raises(ValueError, match="axis 0"):
        check_grid((2**31, 1, 1))


_C15_SLOW = ("65,537 sequences through Triton's interpreter take about 12 minutes on 2 cores (2,000 took 21 s): "
             "runs on CUDA (the gpu profile's machines), or on CPU with PAGEDKV_PROFILE=nightly")


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("PAGEDKV_PROFILE") != "nightly", reason=_C15_SLOW)
def test_c15_decode_of_65537_sequences_of_context_2():
    """Case C15: 65,537 decode sequences of context 2 (one past a 16-bit grid axis) in one launch."""
    from pagedkv import get_backend
    from pagedkv.attention.dense import reference_attention
    from pagedkv.errors import BackendUnavailableError
    from pagedkv.testing.compare import assert_attention_close

    try:
        backend = get_backend("triton")
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, ctx, hkv, group, d = 65537, 2, 1, 2, 16
    g = torch.Generator().manual_seed(15)
    k = torch.randn(batch, ctx, hkv, d, generator=g)
    v = torch.randn(batch, ctx, hkv, d, generator=g)
    perm = torch.randperm(batch, generator=g)
    k_cache = torch.empty_like(k)
    v_cache = torch.empty_like(v)
    k_cache[perm], v_cache[perm] = k, v  # sequence b lives in block perm[b]
    query = torch.randn(batch, hkv * group, d, generator=g)
    tables = perm[:, None].to(torch.int32)
    out = backend.paged_attention(query.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                                  torch.full((batch,), ctx, dtype=torch.int32, device=device),
                                  torch.arange(batch + 1, dtype=torch.int32, device=device))
    sample = torch.randperm(batch, generator=g)[:256].sort().values.tolist() + [0, batch - 1]
    expected = reference_attention(query[sample], [k[b] for b in sample], [v[b] for b in sample],
                                   list(range(len(sample) + 1)), d ** -0.5)
    assert_attention_close(out[sample].cpu(), expected)
