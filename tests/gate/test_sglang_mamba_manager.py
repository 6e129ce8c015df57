"""SGLang's Mamba radix cache (the unified cache's MAMBA component over its real HybridReqToTokenPool and
MambaPool, pagedkv.tools.peers.sglang_mamba_manager) under the cache-manager machine, where sglang is
installed: the release passes with state reads and hits judged, and faults planted in SGLang's state
copy-on-write and checkpointing are found."""

from __future__ import annotations

import importlib.util
import time

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import CacheManager, ManagerConfig, layout_groups
from pagedkv.testing.settings import manager_settings

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23 and the modules docs/peers.md lists)")


def _machine(name: str, factory=None):
    from pagedkv.tools.peers import sglang_mamba_manager as mm

    mm._import_mamba()  # outside the measured steps
    return machine_for(factory or mm.cache_manager, block_sizes=mm.cache_manager_block_sizes,
                       layouts=mm.cache_manager_layouts, name=name)


def _finds_fault(name: str, factory=None) -> str:
    machine = _machine(name, factory)  # found within 49 programs in 30 runs: 200 leave room
    steps = programs.run_recorded(machine, settings(manager_settings(200, 30), phases=(Phase.generate,)))
    assert steps is not None, f"{name}: the planted fault passed the machine"
    return steps.error


def test_mamba_radix_cache_passes_the_manager_machine():
    machine = _machine("SglangMamba")
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings(manager_settings(60, 50), phases=tuple(Phase)))
    seconds = time.perf_counter() - start
    print(f"SGLang UnifiedRadixCache (full + Mamba): {machine.checks_run} steps in {seconds:.2f} s, "
          f"{machine.checks_run / seconds:.0f} steps/s")
    assert machine.checks_run > 60 and machine.tokens_read > 0 and machine.prefix_hits > 0


def test_registered_in_the_jamba_layouts_and_satisfies_the_protocol():
    from pagedkv.tools.peers import PEERS
    from pagedkv.tools.peers.sglang_mamba_manager import cache_manager

    peer = PEERS["sglang_mamba_radix_cache"]()
    assert peer.cache_manager_layouts == ("jamba", "qwen3-next") and peer.cache_manager_block_sizes == (1,)
    manager = cache_manager(ManagerConfig(4, 1, groups=layout_groups("qwen3-next", 1, 0), num_layers=2))
    assert isinstance(manager, CacheManager)
    assert [g.kind for g in manager.capabilities.groups] == ["full", "mamba"]
    with pytest.raises(ValueError, match="one full-attention and one Mamba group of block size 1"):
        cache_manager(ManagerConfig(4, 2, groups=layout_groups("jamba", 2, 0)))
    with pytest.raises(ValueError, match="one full-attention and one Mamba group"):
        cache_manager(ManagerConfig(4, 1, groups=layout_groups("gemma3", 1, 1)))


def test_admission_is_bounded_as_sglang_sizes_its_running_requests():
    """SGLang caps running requests at a third of the Mamba slots (no_buffer) through its request rows, so
    a checkpoint's copy always finds a slot; requests sharing one cached prompt are not bounded by the
    token pool (the case the machine drew: SGLang's "Can not alloc mamba cache" with 64 rows)."""
    from pagedkv.tools.peers.sglang_mamba_manager import cache_manager

    m = cache_manager(ManagerConfig(4, 1, groups=layout_groups("jamba", 1, 0)))
    assert m.mamba_size == 12
    for rid in range(4):  # a cached prompt shared by every request: the token pool is not the bound
        _, hit = m.admit(rid, [0, 0])
        assert m.reserve(rid, [0]) is not None
        m.commit(rid, hit + 1)
    assert m.admit(4, [0, 0]) is None  # no row: the scheduler keeps it waiting
    for rid in range(4):
        m.free(rid)
    m.self_check()
    assert m.admit(4, [0, 0]) is not None


def test_a_hit_copies_the_cached_state_and_the_tree_keeps_its_own():
    """SGLang's copy-on-write, through its own pools: the checkpoint gives the tree a copy of the request's
    state, a hit gives the next request a copy of the tree's, and steps on either copy leave the others."""
    from pagedkv.tools.peers.sglang_mamba_manager import cache_manager

    m = cache_manager(ManagerConfig(8, 1, groups=layout_groups("jamba", 1, 0)))
    k = m.kv_pools(0)[0]
    m.admit(0, [1, 2, 3, 4])
    first = m.reserve(0, [1, 2, 3, 4])[1][-1]
    k[first] = 4.0  # the state after the prompt, where the step wrote it
    m.commit(0, 4)  # cache_unfinished_req: the tree takes a copy
    blocks, hit = m.admit(1, [1, 2, 3, 4, 5])
    assert hit == 4 and blocks[1][-1] not in (-1, first), blocks  # the tree's copy, not request 0's slot
    k[first] = 5.0  # request 0 decodes on: its own slot only
    assert float(k[blocks[1][-1]].flatten()[0]) == 4.0
    own = m.reserve(1, [5])[1][-1]
    assert own not in (first, blocks[1][-1]) and float(k[own].flatten()[0]) == 4.0  # the copy, before its step
    assert m.block_table(1)[1][3] == own
    m.free(0)
    m.free(1)
    m.self_check()
    assert m.counts()[1] == 0


def test_a_hit_stops_at_the_deepest_node_that_kept_its_state():
    """A state-only eviction of an interior node leaves its full K/V without its state (a tombstone): a hit
    over that prefix stops at the deepest node still holding a state, never at the tombstone."""
    from pagedkv.tools.peers.sglang_mamba_manager import cache_manager

    m = cache_manager(ManagerConfig(12, 1, groups=layout_groups("jamba", 1, 0)))
    m.admit(0, [1, 2, 3, 4, 5])
    m.reserve(0, [1, 2])
    m.commit(0, 2)  # a chunk: the state after [1, 2] cached
    m.reserve(0, [3, 4, 5])
    m.commit(0, 5)  # the prompt: the state after [1, 2, 3, 4, 5] cached
    m.free(0)
    assert m.admit(1, [1, 2, 3, 4, 5, 6])[1] == 5  # the deeper state used last
    m.free(1)
    m.tree.evict(m.s.EvictParams(num_tokens=0, mamba_num=1))  # the least recently used state: [1, 2]'s
    assert m.tree.full_evictable_size() == 5 and m.tree.mamba_evictable_size() == 1  # every token's K/V stays
    assert m.admit(2, [1, 2, 7])[1] == 0  # [1, 2]'s K/V is cached, its state is not
    blocks, hit = m.admit(3, [1, 2, 3, 4, 5, 6])
    assert hit == 5 and blocks[1][4] >= 0, (blocks, hit)
    m.free(2)
    m.free(3)
    m.self_check()


def test_the_path_cap_evicts_unlocked_interior_states():
    """``--mamba-max-states-per-path 1`` (``:sglang_mamba_radix_cache_path_cap``): an insert evicts the
    shallowest unlocked interior states beyond the cap (locked ones and the tail stay, full K/V stays), so a
    prompt sharing just that prefix misses; unlimited, it hits."""
    from pagedkv.tools.peers import PEERS

    for spec, hit in (("sglang_mamba_radix_cache", 2), ("sglang_mamba_radix_cache_path_cap", 0)):
        peer = PEERS[spec]()
        assert peer.name == spec
        m = peer.cache_manager(ManagerConfig(12, 1, groups=layout_groups("jamba", 1, 0)))
        m.admit(0, [1, 2, 3, 4, 5])
        m.reserve(0, [1, 2])
        m.commit(0, 2)  # a state at [1, 2]
        m.reserve(0, [3, 4, 5])
        m.commit(0, 5)  # and at [1 .. 5] (the request still locked [1, 2]: kept)
        m.free(0)
        assert m.admit(1, [1, 2, 3, 4, 5, 6, 7, 8])[1] == 5
        m.reserve(1, [6, 7])
        m.commit(1, 7)  # a third state on the path; [1, 2]'s is unlocked now
        assert m.admit(2, [1, 2, 9])[1] == hit, spec
        assert m.tree.full_evictable_size() + m.tree.full_protected_size() == 7  # the K/V stays
        m.free(1)
        m.free(2)
        m.self_check()


def test_a_hit_whose_state_is_not_copied_is_caught(monkeypatch):
    """Planted: ``copy_mamba_state`` a no-op, so a hit continues from its fresh slot, not the cached state."""
    from pagedkv.tools.peers.sglang_mamba_manager import _import_mamba

    pool = _import_mamba().memory_pool.HybridReqToTokenPool
    monkeypatch.setattr(pool, "copy_mamba_state", lambda self, src, dst: None)
    assert "reads wrong state" in _finds_fault("SglangMambaNoCow")


def test_a_checkpoint_that_donates_the_live_slot_is_caught(monkeypatch):
    """Planted: an unfinished request's checkpoint gives the tree the request's own state slot instead of a
    copy, so the request's next step overwrites the state the tree serves."""
    from pagedkv.tools.peers.sglang_mamba_manager import _import_mamba

    _import_mamba()
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    real = MambaComponent.prepare_for_caching_req

    def donate_live(self, req, insert_params, token_ids_len, is_finished):
        if is_finished:
            return real(self, req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(-1).clone()
        return token_ids_len

    monkeypatch.setattr(MambaComponent, "prepare_for_caching_req", donate_live)
    error = _finds_fault("SglangMambaDonatesLive")
    assert "AssertionError" in error, error


def test_a_split_that_hands_the_child_state_to_the_new_parent_is_caught(monkeypatch):
    """Planted in SGLang's Python tree core (its Rust core splits nodes itself): a node split keeps the
    child's state on the new parent, so a hit at the split point serves the state of the longer prefix
    (node splits are where SGLang's Mamba tree has had fixes: #22935, #36696)."""
    from pagedkv.tools.peers.sglang_mamba_manager import SglangMambaRadixCache, _import_mamba

    _import_mamba()
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

    real = MambaComponent.redistribute_on_node_split

    def split_keeps_state(self, new_parent, child):
        real(self, new_parent, child)
        new_parent.component_data[self.component_type].value = child.component_data[self.component_type].value

    monkeypatch.setattr(MambaComponent, "redistribute_on_node_split", split_keeps_state)
    python_core = type("PythonCore", (SglangMambaRadixCache,), {"tree_core_backend": "python"})
    error = _finds_fault("SglangMambaSplitKeepsState", python_core)
    # the longer prefix's state read at the split point, or its slot named by two nodes (both live, or one of them
    # evicted and the slot freed while the other still names it)
    assert ("reads wrong state" in error or "in the tree (Mamba) and in the tree (Mamba)" in error
            or "both free in the Mamba allocator and in the tree (Mamba)" in error), error

