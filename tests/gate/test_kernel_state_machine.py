"""The kernel property ``cache_state_machine_holds_its_invariants`` is the cache-manager machine over
pagedkv's own cache with the candidate's ops (:mod:`pagedkv.testing.managers.kernel_property`): its K/V
goes through the candidate's ``write_kv`` and ``gather`` at a geometry and dtype inside the declared
space, and a program of it replays."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings

from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.testing import execute
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.kernel_property import machine_for_backend
from pagedkv.testing.registry import properties
from pagedkv.tools.mutants.backends import IndexedBackend

PROPERTY = "cache_state_machine_holds_its_invariants"


def _settings(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, stateful_step_count=30,
                    phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)


class LastTokenDropped(IndexedBackend):
    """A ``write_kv`` that writes every token of a call but the last (an off-by-one in its grid)."""

    name = "last_token_dropped"

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=True, **scales):
        if key.shape[0] > 1:
            key, value, slot_mapping = key[:-1], value[:-1], slot_mapping[:-1]
        IndexedBackend.write_kv(self, k_cache, v_cache, key, value, slot_mapping, validate=validate, **scales)


def test_the_machine_writes_with_the_candidates_write_kv():
    """Fails where the machine writes with pagedkv's own backend whatever the candidate."""
    outcome = execute.run(properties()[PROPERTY], (LastTokenDropped(),), "cpu", _settings(30))
    assert outcome.failed and "reads wrong" in outcome.first_line, outcome.first_line
    assert execute.run(properties()[PROPERTY], (IndexedBackend(),), "cpu", _settings(30)).status == "passed"


class GatherReadsBlockZero(IndexedBackend):
    """A ``gather`` that reads every position from the table's first block."""

    name = "gather_reads_block_zero"

    def gather(self, cache, table, seq_len):
        return IndexedBackend.gather(self, cache, table[:1].repeat(table.shape[0]), seq_len)


def test_the_machine_reads_with_the_candidates_gather():
    outcome = execute.run(properties()[PROPERTY], (GatherReadsBlockZero(),), "cpu", _settings(30))
    assert outcome.failed and "reads wrong" in outcome.first_line, outcome.first_line


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_geometry_inside_a_narrow_declared_space(dtype):
    """Block size 16, head_dim 8, two kv heads, a half-precision dtype: the oracle's values cut to what the
    dtype holds exactly, read back bit for bit."""
    caps = Capabilities(block_sizes=Sizes(values={16}), head_dims=Sizes(values={8}), num_kv_heads=Sizes(values={2}),
                        dtypes={dtype})
    machine = machine_for_backend(IndexedBackend(), caps=caps)
    assert machine.block_sizes == (16,) and machine.head_dim == 8 and machine.num_kv_heads == 2
    assert machine.dtype == getattr(torch, dtype)
    assert programs.run_recorded(machine, _settings(15)) is None
    assert machine.tokens_read > 0
