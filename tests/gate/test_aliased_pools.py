"""The aliased-pool properties (C10 past 2**31 slots) fail with a case file and a located message on
planted int32 faults, replay from that file, and pass (leaving no file) on pagedkv's own backends."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.backends import get_backend
from pagedkv.testing import execute
from pagedkv.testing.casefiles.reading import load_case_file
from pagedkv.testing.cases.limit import LimitCase
from pagedkv.testing.registry import properties

INDEXED = get_backend("indexed")


class Int32Slots:
    """``indexed`` with ``write_kv``'s slots wrapped to 32 bits (a slot past 2**32 lands 2**32 lower)."""

    name = "int32_slots"
    gather, scatter = staticmethod(INDEXED.gather), staticmethod(INDEXED.scatter)

    @staticmethod
    def write_kv(k_cache, v_cache, key, value, slot_mapping):
        wrapped = slot_mapping.to(torch.int32).to(torch.int64)  # drops the high bits; -1 stays -1
        INDEXED.write_kv(k_cache, v_cache, key, value, wrapped)


class Int32Offsets:
    """``indexed`` whose ``gather`` forms each token's slot ``block * block_size + offset`` in int32."""

    name = "int32_offsets"
    write_kv, scatter = staticmethod(INDEXED.write_kv), staticmethod(INDEXED.scatter)

    @staticmethod
    def gather(cache, table, seq_len):
        bs = cache.shape[1]
        pos = torch.arange(seq_len)
        slots = table.cpu().to(torch.int32)[pos // bs] * bs + (pos % bs).to(torch.int32)  # wraps past 2**31
        blocks, offsets = slots.to(torch.int64).div(bs, rounding_mode="floor"), slots.to(torch.int64) % bs
        return cache[blocks % cache.shape[0], offsets].clone()


@pytest.mark.parametrize("name,planted,located", [
    ("write_kv_hits_slots_past_2_31_exactly", Int32Slots, "slot"),
    ("gather_reads_the_right_block_past_2_31_slots", Int32Offsets, "position"),
])
def test_a_planted_int32_fault_fails_with_a_located_case_file_that_replays(tmp_path, name, planted, located):
    prop, path = properties()[name], tmp_path / "case.json"
    outcome = execute.run_case(prop, (planted(),), LimitCase.aliased(), spec=f"tests:{planted.__name__}",
                               case_file=path)
    assert outcome.failed and "int32" in outcome.first_line, outcome.first_line
    record = json.loads(path.read_text())
    assert record["check"] == name and record["kind"] == "LimitCase" and record["outcome"] == "failed"
    assert record["case"]["limit"] == "2_32_slots_aliased" and record["case"]["geometry"]["num_blocks"] == 2**23 + 1
    assert located in outcome.failures[0].error.where
    again = execute.run_record(load_case_file(path, check_backend=False), backend=planted(),
                               case_file=tmp_path / "again.json")
    assert again.failed and again.first_line == outcome.first_line


@pytest.mark.parametrize("name", ["gather_reads_the_right_block_past_2_31_slots",
                                  "write_kv_hits_slots_past_2_31_exactly",
                                  "scatter_writes_the_right_blocks_past_2_31_slots",
                                  "validation_bounds_are_exact_past_2_31_slots"])
@pytest.mark.parametrize("impl", ["loop", "indexed"])
def test_the_aliased_pool_properties_pass_on_our_backends_and_leave_no_file(tmp_path, name, impl):
    path = tmp_path / "case.json"
    outcome = execute.run_case(properties()[name], (get_backend(impl),), LimitCase.aliased(), case_file=path)
    assert outcome.status == "passed", outcome.first_line
    assert not path.exists()


def test_a_backend_that_accepts_a_slot_past_the_pool_is_named():
    class NoBoundCheck(Int32Slots):
        @staticmethod
        def write_kv(k_cache, v_cache, key, value, slot_mapping):  # accepts anything, writes nothing
            return None

    outcome = execute.run_case(properties()["validation_bounds_are_exact_past_2_31_slots"], (NoBoundCheck(),),
                               LimitCase.aliased())
    assert outcome.failed and "was accepted" in outcome.first_line and str(2**32 + 512) in outcome.first_line


def test_a_backend_declaring_contiguous_pools_only_is_skipped_with_the_reason():
    from pagedkv.backends.capabilities import Capabilities

    class Contiguous(Int32Slots):
        capabilities = Capabilities(strided_pools=False)

    outcome = execute.run_case(properties()["write_kv_hits_slots_past_2_31_exactly"], (Contiguous(),),
                               LimitCase.aliased())
    assert outcome.status == "skipped" and "contiguous pools only" in outcome.reason


class InsideLimits:
    """``indexed`` declaring a real kernel's limits: block sizes {16, 32}, head dims {64, 128}."""

    name = "inside_limits"
    gather, scatter, write_kv = (staticmethod(INDEXED.gather), staticmethod(INDEXED.scatter),
                                 staticmethod(INDEXED.write_kv))

    @property
    def capabilities(self):
        from pagedkv.backends.capabilities import Capabilities, Sizes

        return Capabilities(block_sizes=Sizes(values={16, 32}), head_dims=Sizes(values={64, 128}),
                            dtypes={"float16"})


@pytest.mark.parametrize("name", ["write_kv_hits_slots_past_2_31_exactly",
                                  "gather_reads_the_right_block_past_2_31_slots"])
def test_outside_the_declared_geometry_the_aliased_pool_is_not_applicable_where_the_twin_judges(name):
    outcome = execute.run_case(properties()[name], (InsideLimits(),), LimitCase.aliased())
    assert outcome.status == "skipped" and outcome.reason.startswith("not applicable"), outcome
    assert "block_size 512 is outside" in outcome.reason and "past_2_31_elements" in outcome.reason
