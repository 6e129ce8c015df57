"""Limits every implementation must respect, checked on fixed inputs: each fault kind rejected on a
case that carries them all, C9 capacity before any write, and C10 slot arithmetic past 2**31 slots
on an aliased pool (no such pool is allocated).

The *aliased pool* is a ``[2**23 + 1, 512, 1, 1]`` float32 view of a 32 MiB buffer with block stride
1, so ``pool[b, o]`` is buffer element ``b + o`` and holds the value ``b + o``. It has more than 2**32
slots, so every op's validation, slot formation and indexing runs at slots past 2**31 (int32 would
wrap to a negative or a wrong block), while reads and writes stay checkable.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
from pagedkv.testing.compare import bits, require
from pagedkv.testing import execute
from pagedkv.testing.cases.invalid_call import FAULTS, InvalidCall, fault_sites
from pagedkv.testing.registry import properties
from pagedkv.testing.report import failure_text
from pagedkv.testing.space import as_declared_layout

pytestmark = pytest.mark.pagedkv

BLOCK_SIZE = 512
NUM_BLOCKS = 2**23 + 1  # num_slots = 2**32 + 512
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


@pytest.mark.parametrize("op,fault", sorted(FAULTS))
def test_every_fault_is_rejected_on_a_fixed_case(pagedkv_run, backend, device, op, fault):
    """Each fault kind at least once, on a case that can carry every fault."""
    case = Case(Geometry(num_blocks=6, block_size=2, num_kv_heads=2, num_queries_per_kv=2),
                (SeqSpec((4, 1), 3, 2, 1), SeqSpec((0, 3, 5), 5, 1, 0)), values="identity", poison="nan")
    sites = fault_sites(op, fault, case)
    assert sites, f"the fixed case cannot carry {op}/{fault}"
    prop = properties()[f"{op}_rejects_bad_arguments_and_writes_nothing"]
    outcome = execute.run_case(prop, (backend,), InvalidCall(op, fault, case, sites[-1]), device,
                               spec=pagedkv_run.spec, case_file=pagedkv_run.case_file)
    if outcome.status == "skipped":
        pytest.skip(outcome.reason)
    if outcome.failed:
        pytest.fail(failure_text(prop.sentence, outcome), pytrace=False)


def test_c9_capacity_is_checked_before_any_write(backend, device):
    """C9: a 2-block table (block_size 4) cannot hold seq_len 9, nor 3 tokens scattered at start 6."""
    cache = torch.full((4, 4, 1, 4), float("nan"), device=device)
    cache[2] = 1.0
    cache[0] = 2.0
    table = torch.tensor([2, 0, -1], dtype=torch.int32, device=device)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"block_table has 2 entries.*seq_len 9"):
        require(as_declared_layout(backend), "gather")(cache, table[:2], 9)
    with pytest.raises(IndexError, match=r"block_table has block id -1 at entry 2"):
        require(as_declared_layout(backend), "gather")(cache, table, 9)
    values = torch.ones((3, 1, 4), dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"start \+ n = 6 \+ 3 = 9"):
        require(as_declared_layout(backend), "scatter")(cache, table[:2], values, 6)
    assert torch.equal(bits(cache.cpu()), bits(before.cpu()))


# -- an aliased pool with more than 2**32 slots --------------------------------------------------------
def _aliased_pool(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, buffer)``: ``pool[b, o, 0, 0]`` is ``buffer[b + o]``, which holds ``b + o`` (exact in float32)."""
    buffer = torch.arange(NUM_BLOCKS + BLOCK_SIZE - 1, dtype=torch.float32, device=device)
    return buffer.as_strided((NUM_BLOCKS, BLOCK_SIZE, 1, 1), (1, 1, 1, 1)), buffer


def _skip_outside_declared_space(backend) -> None:
    """The aliased pool is a strided ``float32`` view with block size 512, one kv head and head_dim 1:
    skip (with the reason) a backend whose declared space excludes it."""
    from pagedkv.testing.space import capabilities_under_test

    caps = capabilities_under_test(backend)
    reason = caps.rejects(Geometry(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads=1, head_dim=1)) or (
        None if caps.strided_pools else "the backend declares contiguous pools only")
    if reason:
        pytest.skip(f"the aliased pool past 2**31 slots: {reason}")


@pytest.fixture(scope="module")
def pools():
    return {}


def _pool(pools, device, key="k"):
    if (device, key) not in pools:
        pools[(device, key)] = _aliased_pool(device)
    pool, buffer = pools[(device, key)]
    buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32, device=buffer.device))  # reset after writes
    return pool, buffer


# block ids whose slots lie past 2**31 (and past 2**32), spaced so their buffer elements never alias
HIGH_BLOCKS = (NUM_BLOCKS - 1, 2**22 + 7, 2**23 - 3 * BLOCK_SIZE, 2**22 + 2 * BLOCK_SIZE + 5)


def test_gather_reads_the_right_block_past_2_31_slots(backend, device, pools):
    gather = require(as_declared_layout(backend), "gather")
    _skip_outside_declared_space(backend)
    pool, _ = _pool(pools, device)
    table = torch.tensor(HIGH_BLOCKS, dtype=torch.int32, device=device)
    seq_len = 3 * BLOCK_SIZE + 17
    assert HIGH_BLOCKS[2] * BLOCK_SIZE > 2**31 and HIGH_BLOCKS[0] * BLOCK_SIZE >= 2**32
    out = gather(pool, table, seq_len).cpu()
    expected = torch.tensor([HIGH_BLOCKS[p // BLOCK_SIZE] + p % BLOCK_SIZE for p in range(seq_len)],
                            dtype=torch.float32).view(-1, 1, 1)
    assert torch.equal(bits(out), bits(expected))


def test_write_kv_hits_slots_past_2_31_exactly(backend, device, pools):
    write_kv = require(as_declared_layout(backend), "write_kv")
    _skip_outside_declared_space(backend)
    k_pool, k_buffer = _pool(pools, device, "k")
    v_pool, v_buffer = _pool(pools, device, "v")
    slots = [b * BLOCK_SIZE + o for b, o in zip(HIGH_BLOCKS, (0, 0, 5, 300))] + [-1, NUM_SLOTS - 1]
    key = torch.tensor([-(i + 1.0) for i in range(len(slots))], device=device).view(-1, 1, 1)
    value = -2 * key
    k_expected, v_expected = k_buffer.cpu().clone(), v_buffer.cpu().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            b, o = divmod(s, BLOCK_SIZE)
            k_expected[b + o], v_expected[b + o] = key[i, 0, 0].item(), value[i, 0, 0].item()
    write_kv(k_pool, v_pool, key, value, torch.tensor(slots, dtype=torch.int64, device=device))
    assert torch.equal(bits(k_buffer.cpu()), bits(k_expected))
    assert torch.equal(bits(v_buffer.cpu()), bits(v_expected))


def test_scatter_writes_the_right_blocks_past_2_31_slots(backend, device, pools):
    scatter = require(as_declared_layout(backend), "scatter")
    _skip_outside_declared_space(backend)
    pool, buffer = _pool(pools, device)
    table = torch.tensor(HIGH_BLOCKS, dtype=torch.int64, device=device)
    start, n = BLOCK_SIZE - 2, BLOCK_SIZE + 4  # the end of block 0, all of block 1, the start of block 2
    values = -torch.arange(1, n + 1, dtype=torch.float32, device=device).view(-1, 1, 1)
    expected = buffer.cpu().clone()
    for j in range(n):
        p = start + j
        expected[HIGH_BLOCKS[p // BLOCK_SIZE] + p % BLOCK_SIZE] = values[j, 0, 0].item()
    scatter(pool, table, values, start)
    assert torch.equal(bits(buffer.cpu()), bits(expected))


def test_validation_bounds_are_exact_past_2_31_slots(backend, device, pools):
    """The last slot and block are accepted; one past them is an IndexError naming the bound."""
    gather, write_kv = require(as_declared_layout(backend), "gather"), require(as_declared_layout(backend), "write_kv")
    _skip_outside_declared_space(backend)
    k_pool, k_buffer = _pool(pools, device, "k")
    v_pool, _ = _pool(pools, device, "v")
    before = k_buffer.cpu().clone()
    one = torch.ones((1, 1, 1), device=device)
    with pytest.raises(IndexError, match=str(NUM_SLOTS)):
        write_kv(k_pool, v_pool, one, one, torch.tensor([NUM_SLOTS], dtype=torch.int64, device=device))
    with pytest.raises(IndexError, match=str(NUM_SLOTS)):  # 2**32 + 512 + 2**32: wraps to 512 in 32 bits
        write_kv(k_pool, v_pool, one, one, torch.tensor([NUM_SLOTS + 2**32], dtype=torch.int64, device=device))
    with pytest.raises(IndexError, match=str(NUM_BLOCKS)):
        gather(k_pool, torch.tensor([NUM_BLOCKS], dtype=torch.int64, device=device), 1)
    assert torch.equal(bits(k_buffer.cpu()), bits(before))
    out = gather(k_pool, torch.tensor([NUM_BLOCKS - 1], dtype=torch.int64, device=device), BLOCK_SIZE).cpu()
    assert out[-1].item() == NUM_BLOCKS - 1 + BLOCK_SIZE - 1
