"""The 2**24-slot large-pool properties at a kernel's declared geometry: where head_dim 1 is not
declared, the head_dim-1 properties are not applicable (not skipped) because their declared-geometry
twins judge the same slot arithmetic, for gather and scatter as for write_kv; a layout declared as a
copy pair is judged there too."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.layouts import PoolLayout
from pagedkv.tools.mutants import MUTANTS
from pagedkv.tools.mutants.kill_table import run_property
from pagedkv.testing.registry import properties
from pagedkv.validation.calls import check_scatter

LIMITED = Capabilities(block_sizes=Sizes(values={16, 32}), head_dims=Sizes(values={64, 128}), dtypes={"float16"})


class Limited:
    """pagedkv's indexed backend inside a real kernel's limits."""

    name = "limited"
    capabilities = LIMITED
    gather, scatter, write_kv = (staticmethod(op) for op in (indexed.gather, indexed.scatter, indexed.write_kv))


class Float32SlotGather(Limited):
    name = "limited_float32_slot_gather"

    def gather(self, cache, block_table, seq_len):
        return MUTANTS["float32_slot_gather"]().gather(cache, block_table, seq_len)


class Float32SlotScatter(Limited):
    """Each position's flat slot computed in float32 (exact only below 2**24 slots)."""

    name = "limited_float32_slot_scatter"

    def scatter(self, cache, block_table, values, start=0):
        table, start, _ = check_scatter(cache, block_table, values, start)
        bs = cache.shape[1]
        pos = torch.arange(start, start + values.shape[0])
        slots = (table[pos // bs].float() * bs + (pos % bs).float()).long()  # FAULT: float32 slots
        cache[slots // bs, slots % bs] = values


@pytest.mark.parametrize("op", ["gather", "scatter", "write_kv"])
def test_the_head_dim_1_property_is_not_applicable_where_its_twin_runs(op):
    old, twin = properties()[f"{op}_is_exact_on_pools_past_2_24_slots"], \
        properties()[f"{op}_is_exact_past_2_24_slots_at_a_declared_geometry"]
    reason = old.cannot_run((), LIMITED)
    assert reason.startswith("not applicable") and twin.name in reason
    assert twin.cannot_run((), LIMITED) is None
    assert old.cannot_run((), Capabilities()) is None  # head_dim 1 declared: the cheap cases run
    no_16_bit = Capabilities(head_dims=Sizes(values={64}), dtypes={"float32"}, max_pool_bytes=1 << 20)
    assert not old.cannot_run((), no_16_bit).startswith("not applicable")  # no twin either: a real skip


@pytest.mark.parametrize("op,bug", [("gather", Float32SlotGather), ("scatter", Float32SlotScatter)])
def test_float32_slot_arithmetic_in_a_head_dim_64_kernel_is_caught_at_its_geometry(op, bug):
    name = f"{op}_is_exact_past_2_24_slots_at_a_declared_geometry"
    outcome = run_property(Limited(), properties()[name], "dev")
    assert outcome.status == "passed", outcome.first_line
    outcome = run_property(bug(), properties()[name], "dev")
    assert outcome.failed and "float32 or int32 slot arithmetic" in outcome.first_line, outcome.first_line


LAZY_POOLS_AFTER_A_DIRTY_HEAP = """
import sys, torch
from pagedkv.cli.bench.timing import retain_freed_memory
from pagedkv.testing.cases.memory import new_lazy_pools, pool_layout
from pagedkv.testing.properties.large_pools import nonzero_slots
assert retain_freed_memory()  # glibc serves every block from the heap and reuses what was freed
for _ in range(3):
    torch.full(((33 << 20) // 2,), 7.0, dtype=torch.float16)  # written, then freed
with pool_layout(sys.argv[1]):
    k_cache, v_cache = new_lazy_pools((1 << 20, 16, 1, 1), torch.float16)  # 32 MiB each
assert k_cache.shape == v_cache.shape == (1 << 20, 16, 1, 1)
assert nonzero_slots(k_cache) == [] and nonzero_slots(v_cache) == [], "a lazy pool reads non-zero"
k_cache[-1, 3] = 1.0
assert nonzero_slots(k_cache) == [((1 << 20) - 1) * 16 + 3] and nonzero_slots(v_cache) == []
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt sets up the dirty heap")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_lazy_pools_read_as_zeros_whatever_the_allocator_freed_before(layout):
    """The declared-geometry properties skip on pools that do not read as zeros. Their pools sit on fresh
    pages, so even an allocator that hands freed heap blocks back (glibc told to, in a child process)
    never gives them a block an earlier test wrote."""
    proc = subprocess.run([sys.executable, "-c", LAZY_POOLS_AFTER_A_DIRTY_HEAP, layout], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


#: A copy pair (no strided view reverses a dim): each block's slots stored last to first.
SLOTS_REVERSED = PoolLayout("slots_reversed", to_storage=lambda t: t.flip(1), to_logical=lambda s: s.flip(1))


class SlotsReversed:
    """A kernel keeping each block's slots last to first, its slot arithmetic on that storage (int64)."""

    name = "slots_reversed"
    capabilities = Capabilities(block_sizes=Sizes(values={16}), head_dims=Sizes(values={8}), dtypes={"float16"},
                                layout=SLOTS_REVERSED)

    def _slots(self, table, positions, block_size):
        return table.long()[positions // block_size], block_size - 1 - positions % block_size

    def gather(self, cache, block_table, seq_len):
        blocks, offsets = self._slots(torch.as_tensor(block_table), torch.arange(int(seq_len)), cache.shape[1])
        return cache[blocks, offsets]

    def scatter(self, cache, block_table, values, start=0):
        table, start, _ = check_scatter(cache, block_table, values, start)
        blocks, offsets = self._slots(table, torch.arange(start, start + values.shape[0]), cache.shape[1])
        cache[blocks, offsets] = values

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        keep = slot_mapping >= 0
        slots, bs = slot_mapping[keep].long(), k_cache.shape[1]
        for cache, rows in ((k_cache, key), (v_cache, value)):
            cache[slots // bs, bs - 1 - slots % bs] = rows[keep]


class SlotsReversedFloat32Scatter(SlotsReversed):
    name = "slots_reversed_float32_scatter"

    def _slots(self, table, positions, block_size):
        slots = (table[positions // block_size].float() * block_size + (positions % block_size).float()).long()
        return slots // block_size, block_size - 1 - slots % block_size  # FAULT: float32 slots


@pytest.mark.parametrize("op", ["gather", "scatter", "write_kv"])
def test_a_copy_pair_layout_is_judged_past_2_24_slots(op):
    """A copy pair (no view) is converted block by block around each call, only the blocks holding anything:
    its pools past 2**24 slots stay lazily backed, the honest kernel passes and float32 slots fail."""
    name = f"{op}_is_exact_past_2_24_slots_at_a_declared_geometry"
    outcome = run_property(SlotsReversed(), properties()[name], "dev")
    assert outcome.status == "passed", outcome.first_line
    if op != "write_kv":  # the planted fault is in gather's and scatter's slot arithmetic
        outcome = run_property(SlotsReversedFloat32Scatter(), properties()[name], "dev")
        assert outcome.failed and "float32 or int32 slot arithmetic" in outcome.first_line, outcome.first_line


def _flip_bits(t):
    return (t.view(torch.int16) ^ 0x3C00).view(t.dtype)


def test_a_copy_pair_that_mixes_blocks_fails_and_one_storing_zeros_as_nonzero_is_a_machine_limit():
    name = "write_kv_is_exact_past_2_24_slots_at_a_declared_geometry"
    mixed = PoolLayout("blocks_reversed", to_storage=lambda t: t.flip(0), to_logical=lambda s: s.flip(0))
    outcome = run_property(type("BlocksReversed", (SlotsReversed,), {"capabilities": dataclasses.replace(
        SlotsReversed.capabilities, layout=mixed)})(), properties()[name], "dev")
    assert outcome.failed and "does not convert block by block" in outcome.first_line, outcome.first_line
    flipped = PoolLayout("bits_flipped", to_storage=_flip_bits, to_logical=_flip_bits)  # zero stored as 0x3C00
    outcome = run_property(type("BitsFlipped", (SlotsReversed,), {"capabilities": dataclasses.replace(
        SlotsReversed.capabilities, layout=flipped)})(), properties()[name], "dev")
    assert outcome.status == "skipped" and outcome.skip == "machine_limit", (outcome.status, outcome.first_line)
