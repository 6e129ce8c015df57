"""SGLang's sliding-window radix cache (PureSWARadixCache, pagedkv.tools.peers.sglang_hybrid_manager) under the
cache-manager machine, where sglang is installed: the prefill-aware configuration passes with its window
evictions reached, the plain one's finding replays from its case file."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import CacheManager, ManagerConfig
from pagedkv.testing.settings import manager_settings

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (pip install --no-deps sglang==0.5.23 and the modules docs/peers.md lists)")

CASE = Path(programs.__file__).parent / "cases" / "sglang_pure_swa_reinserts_window_evicted_slots.json"


def _machine(factory, name):
    from pagedkv.tools.peers import sglang_hybrid_manager as h

    h._import_swa()  # outside the measured steps
    return machine_for(factory, block_sizes=h.cache_manager_block_sizes, windows=h.cache_manager_windows, name=name)


def test_prefill_aware_pure_swa_passes_the_manager_machine():
    from pagedkv.tools.peers.sglang_hybrid_manager import cache_manager_prefill_aware

    machine = _machine(cache_manager_prefill_aware, "SglangPureSwaPrefillAware")
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings(manager_settings(60, 60), phases=tuple(Phase)))
    seconds = time.perf_counter() - start
    print(f"SGLang PureSWARadixCache (prefill-aware): {machine.checks_run} steps in {seconds:.2f} s, "
          f"{machine.checks_run / seconds:.0f} steps/s")
    # judged, not merely run: K/V read back inside the window, prefix hits served
    assert machine.checks_run > 60 and machine.tokens_read > 0 and machine.prefix_hits > 0


def test_registered_and_satisfies_the_protocol():
    from pagedkv.tools.peers import PEERS
    from pagedkv.tools.peers.sglang_hybrid_manager import cache_manager

    assert isinstance(cache_manager(ManagerConfig(4, 1, window_left=2)), CacheManager)
    for name in ("sglang_pure_swa_radix_cache", "sglang_pure_swa_radix_cache_prefill_aware"):
        assert PEERS[name]().name == name
    with pytest.raises(ValueError, match="window_left=None"):
        cache_manager(ManagerConfig(4, 1))


def test_reinsertion_of_window_evicted_slots_replays_from_its_case_file(tmp_path):
    """SGLang's finding: an all-SWA model without ``is_prefill_aware_swa`` has ``swa_evict_floor`` 0, so
    the finished request's ``checkpoint`` inserts row slots the window already freed into the tree."""
    assert programs.replay_file(str(CASE), quiet=True) == 1
    assert "blocks still used after every request was freed" in json.loads(CASE.read_text())["error"]
    data = json.loads(CASE.read_text())
    data["manager"] = "pagedkv.tools.peers:sglang_pure_swa_radix_cache_prefill_aware"  # the floor set: passes
    fixed = tmp_path / "prefill_aware.json"
    fixed.write_text(json.dumps(data))
    assert programs.replay_file(str(fixed), quiet=True) == 0



def test_hybrid_full_and_swa_cache_passes_the_manager_machine():
    from pagedkv.tools.peers.sglang_hybrid_manager import _import_unified, hybrid_cache_manager

    _import_unified()
    machine = machine_for(hybrid_cache_manager, layouts=("gemma3",), name="SglangHybridSwa")
    start = time.perf_counter()
    run_state_machine_as_test(machine, settings=settings(manager_settings(60, 60), phases=tuple(Phase)))
    seconds = time.perf_counter() - start
    print(f"SGLang UnifiedRadixCache (full + SWA): {machine.checks_run} steps in {seconds:.2f} s, "
          f"{machine.checks_run / seconds:.0f} steps/s")
    assert machine.checks_run > 60 and machine.tokens_read > 0 and machine.prefix_hits > 0


def test_hybrid_peer_is_registered_in_the_gemma_layout():
    from pagedkv.testing.managers.protocol import layout_groups
    from pagedkv.tools.peers import PEERS
    from pagedkv.tools.peers.sglang_hybrid_manager import hybrid_cache_manager

    peer = PEERS["sglang_swa_radix_cache"]()
    assert peer.cache_manager_layouts == ("gemma3",)
    manager = hybrid_cache_manager(ManagerConfig(4, 2, groups=layout_groups("gemma3", 2, 1)))
    assert [g.kind for g in manager.capabilities.groups] == ["full", "sliding_window"]
    with pytest.raises(ValueError, match="one full-attention and one sliding-window group"):
        hybrid_cache_manager(ManagerConfig(4, 1, groups=layout_groups("jamba", 1, 1)))


def test_swa_mapping_kept_after_its_slot_is_freed_is_caught(monkeypatch):
    """A planted fault in SGLang's SWA allocator: ``clear_full_to_swa_mapping`` a no-op, so a full slot still
    names an SWA slot the allocator freed (and hands out again), which the machine sees."""
    from pagedkv.tools.peers.sglang_hybrid_manager import _import_unified, hybrid_cache_manager

    allocator = _import_unified().SWATokenToKVPoolAllocator
    monkeypatch.setattr(allocator, "clear_full_to_swa_mapping", lambda self, full_indices: None)
    machine = machine_for(hybrid_cache_manager, layouts=("gemma3",), name="SglangHybridSwaStaleMapping")
    steps = programs.run_recorded(machine, settings(manager_settings(100, 30), phases=(Phase.generate,)))
    assert steps is not None, "an SWA mapping kept after its free passed the machine"
    assert "AssertionError" in steps.error, steps.error


@pytest.mark.parametrize("hybrid", [False, True], ids=["pure_prefill_aware", "hybrid"])
def test_decode_frees_the_swa_slots_behind_the_window(hybrid):
    """What the machine seldom reaches (a request's third decode step): SGLang's ``evict_sliding_windows``
    frees the sliding-window slots behind the window (the table shows -1 there, the full group keeps its
    blocks) and they go back to SGLang's free list, while the window's own slots stay."""
    from pagedkv.testing.managers.protocol import layout_groups
    from pagedkv.tools.peers.sglang_hybrid_manager import cache_manager_prefill_aware, hybrid_cache_manager

    if hybrid:
        m = hybrid_cache_manager(ManagerConfig(20, 1, groups=layout_groups("gemma3", 1, 1)))
        free_swa = m.allocator.swa_available_size
    else:
        m = cache_manager_prefill_aware(ManagerConfig(20, 1, window_left=1))  # the plain one: the finding
        free_swa = m.allocator.available_size
    m.admit(0, [1, 2])
    m.reserve(0, [1, 2])
    m.commit(0, 2)  # the prompt, checkpointed into the tree
    for n in range(3, 8):  # five decode tokens, window 1
        before = free_swa()
        m.reserve(0, [7])
        m.commit(0, n)
    swa = m.block_table(0)[-1] if hybrid else m.block_table(0)
    assert swa[:2] != [-1, -1] and -1 not in swa[-2:], swa  # the tree's prompt and the window stay
    assert swa[2:5] == [-1, -1, -1], swa  # decode tokens 2..4 are behind the window of token 6
    assert free_swa() == before, (before, free_swa())  # the last step freed one slot and took one
    if hybrid:
        assert -1 not in m.block_table(0)[0]  # the full-attention group keeps every block
    m.free(0)
    m.self_check()
