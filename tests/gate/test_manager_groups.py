"""KV-cache groups, a KV connector and speculative drafts in the cache-manager machine: the protocol's
group specs and layouts, pagedkv's HybridKVCache and the reference hybrid manager through the machine,
and planted faults of both caught, each failing program saved as a case file that replays the failure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import Phase, settings

from pagedkv.testing.managers import programs, reference
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.own import OwnHybridManager, cache_manager, cache_manager_layouts, with_cache_class
from pagedkv.testing.managers.protocol import (HYBRID_LAYOUTS, MULTI_MODULE_MTP_LAYOUTS, ONE_GROUP, CacheManager,
                                               ConnectorCalls, GroupSpec, ManagerConfig, SpeculativeCalls, as_grouped,
                                               layout_groups, manager_layouts)
from pagedkv.testing.settings import manager_settings
from pagedkv.tools.mutants.caches import HYBRID_CACHE_MUTANTS
from pagedkv.tools.mutants.hybrid_managers import HYBRID_MANAGER_MUTANTS, MUTANT_LAYOUTS


def _settings(n: int) -> settings:
    return settings(manager_settings(n, 30), derandomize=True, phases=(Phase.explicit, Phase.generate))


@pytest.mark.parametrize("kwargs, argument", [
    (dict(kind="linear"), "kind"), (dict(kind="full", block_size=0), "block_size"),
    (dict(kind="sliding_window"), "window"), (dict(kind="full", window=2), "window"),
    (dict(kind="chunked_local", chunk=3, block_size=2), "chunk"), (dict(kind="mamba", chunk=4), "chunk")])
def test_group_spec_names_the_bad_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        GroupSpec(**{"block_size": 2, **kwargs})


def test_layouts_are_real_models_and_unknown_ones_are_refused():
    assert layout_groups(ONE_GROUP, 2, 1) == ()
    for name in HYBRID_LAYOUTS:
        groups = layout_groups(name, 2, 1)
        if name in MULTI_MODULE_MTP_LAYOUTS:  # one MLA group, a block at least the drafter's 3 tokens
            assert [(g.kind, g.block_size) for g in groups] == [("full", 3)]
            continue
        assert len(groups) >= 2 and groups[0].kind == "full" and groups[0].block_size % 2 == 0
    assert [g.kind for g in layout_groups("gpt-oss-2full-sw", 2, 1)] == ["full", "full", "sliding_window"]
    assert {g.block_size for g in layout_groups("mixed-block-sizes", 2, 1)} == {2, 4}
    with pytest.raises(ValueError, match="layout"):
        layout_groups("gemma-17", 2, 1)
    with pytest.raises(ValueError, match="layout"):
        machine_for(reference.cache_manager, layouts=("gemma-17",))
    with pytest.raises(ValueError, match="cache_manager_layouts"):
        manager_layouts(type("Candidate", (), {"cache_manager_layouts": ("gemma-17",)}))
    assert manager_layouts(object()) == (ONE_GROUP,)


def test_sparse_retention_layouts_give_vllms_interval_in_tokens():
    """``layout_retention``: vLLM's ``prefix_cache_retention_interval`` in tokens, whole scheduler blocks (the
    groups' lcm), ``0`` for the engine default, ``None`` (dense) for every other layout."""
    from pagedkv.testing.managers.protocol import LAYOUT_RETENTION, layout_retention

    assert layout_retention("gemma3-sparse", 2, 1) == 0
    assert layout_retention("gemma3-interval", 2, 1) == 6 and layout_retention("gemma3-interval", 4, 3) == 12
    assert layout_retention("gemma3", 2, 1) is None and layout_retention(ONE_GROUP, 2, 1) is None
    assert layout_retention("qwen3-next-sparse", 4, 1) == 0
    # each is a dense layout's model under another retention
    assert all(layout_groups(name, 2, 1) == layout_groups(name.rsplit("-", 1)[0], 2, 1) for name in LAYOUT_RETENTION)


def test_layouts_with_three_attention_types_and_two_specs_of_one_kind():
    """Hymba's three attention types, DeepSeek-V4's windows of different sizes, two windows of different
    block sizes: fails before (unknown layouts)."""
    assert [g.kind for g in layout_groups("hymba", 2, 1)] == ["full", "sliding_window", "mamba"]
    full, *windows = layout_groups("deepseek-v4", 2, 1)
    assert full.kind == "full" and [w.kind for w in windows] == ["sliding_window"] * 2
    assert windows[0] != windows[1] and all(w.window % 2 for w in windows)  # neither a multiple of the block
    assert all(layout_groups("deepseek-v4", 2, w)[2].window % 2 for w in range(4))
    _, small, large = layout_groups("two-window-block-sizes", 2, 1)
    assert small.window == large.window and (small.block_size, large.block_size) == (2, 4)


def test_eviction_order_per_group_takes_each_groups_chain_from_its_tail():
    """Blocks one call released in several groups: any group may be reused first, but within a group the
    tail first (fails before: no per-group tier, every release one order)."""
    from pagedkv.testing.managers.machine import Chains, ManagerMachine

    tier = Chains([[5, 4], [9, 8]])  # group 0 released 5 (its tail) then 4; group 1 9 then 8
    assert ManagerMachine.judge_chains(None, "reserve", {9}, tier) and tier.chains == [[5, 4], [8]]
    assert ManagerMachine.judge_chains(None, "reserve", {5, 8}, tier) and tier.chains == [[4]]
    with pytest.raises(AssertionError, match="tail first in each group"):
        ManagerMachine.judge_chains(None, "reserve", {4}, Chains([[5, 4], [9]]))
    need = {5, 4, 9, 1}
    assert not ManagerMachine.judge_chains(None, "reserve", need, Chains([[5, 4], [9]])) and need == {1}


def test_first_read_per_kind():
    assert GroupSpec("full", 2).first_read(9) == 0
    assert GroupSpec("sliding_window", 2, window=3).first_read(9) == 6
    assert GroupSpec("chunked_local", 2, chunk=4).first_read(9) == 8
    assert GroupSpec("mamba", 2).first_read(9) == 8


def test_one_group_manager_seen_grouped():
    from pagedkv.testing.managers.own import OwnCacheManager

    m = as_grouped(OwnCacheManager(ManagerConfig(4, 2, window_left=1)))
    assert m.capabilities.groups == (GroupSpec("sliding_window", 2, window=1),)
    assert m.admit(0, [1, 2, 3]) == (([],), 0)
    assert m.reserve(0, [1, 2, 3]) == ([0, 1, 2],) and m.block_table(0) == ([0, 1],)
    assert isinstance(m.inner, CacheManager)


def test_reference_manager_answers_every_protocol():
    m = reference.cache_manager(ManagerConfig(8, 2, groups=layout_groups("jamba", 2, 1), connector=True,
                                              num_speculative_tokens=2))
    assert isinstance(m, CacheManager) and isinstance(m, ConnectorCalls) and isinstance(m, SpeculativeCalls)
    with pytest.raises(ValueError, match="groups"):
        reference.cache_manager(ManagerConfig(8, 2))


def _counting(base):
    """``base`` counting the connector's and speculative calls (what the machine reached)."""
    calls: dict[str, int] = {}

    class Counting(base):
        def __getattribute__(self, name):
            if name in ("load", "load_done", "store_done", "drop", "num_external"):
                calls[name] = calls.get(name, 0) + 1
            return super().__getattribute__(name)

    return Counting, calls


def test_reference_manager_passes_every_layout_with_connector_and_drafts():
    manager, calls = _counting(reference.ReferenceManager)
    layouts_drawn = set()

    def make(config):
        layouts_drawn.add(tuple(g.kind for g in config.groups))
        return manager(config)

    machine = machine_for(make, layouts=reference.cache_manager_layouts, name="Reference")
    assert programs.run_recorded(machine, _settings(80)) is None
    assert machine.prefix_hits > 0 and machine.tokens_read > 0
    # a layout the 80 programs did not draw (nine layouts) gets programs of its own
    for name in reference.cache_manager_layouts:
        if tuple(g.kind for g in layout_groups(name, 1, 0)) not in layouts_drawn:
            assert programs.run_recorded(machine_for(make, layouts=(name,), name=name), _settings(15)) is None
    assert len(layouts_drawn) == len({tuple(g.kind for g in layout_groups(n, 1, 0)) for n in HYBRID_LAYOUTS})
    assert calls.get("load", 0) > 0 and calls.get("store_done", 0) > 0 and calls.get("drop", 0) > 0, calls


class _SkipsWindowHits(reference.ReferenceManager):
    """The reference manager leaving a hit block its window already left behind untouched, as vLLM's
    ``add_local_computed_blocks`` skips one: ``-1`` in the table, the block left in the free queue."""

    def _adopt_hits(self, req):
        for g, block in req.pending_hits:
            group, table = self.groups[g], req.tables[g]
            i = table.index(block)
            if group.kind != "full" and (i + 1) * group.block_size <= group.first_read(req.reserved):
                table[i] = -1
            else:
                self._adopt(block)
        req.pending_hits = []


def test_a_hit_block_the_window_left_behind_stays_free_until_handed_out():
    """A one-token window (``window_left`` 0) hits the last cached token's block (its key chains the hit) that
    the first computed token no longer reads; a manager that never touches it leaves it in the free queue, where
    the same reservation may take it. Fails before (the machine took every admitted block for adopted, so the
    block handed out again was "not free")."""
    steps = [("start", {"num_blocks": 9, "block_size": 2, "num_layers": 2, "window": 0, "layout": 0, "features": 0}),
             ("system_prompts", {"prompts": [[0, 0, 0, 0, 0]]}),
             *[("serve", {"system": [0, 0, 0, 0, 0], "suffix": [], "namespace": None, "extra": None, "image_at": 0,
                          "tail": 0, "tokens": [0], "reply": [0]})] * 2]
    machine = machine_for(_SkipsWindowHits, layouts=("gpt-oss-2full-sw",), windows=(None, 0, 1, 4))
    programs.run_program(machine, steps)
    assert machine.prefix_hits > 0


def test_a_manager_refusing_a_connector_or_drafts_is_judged_without_them():
    """``ManagerConfig`` lets a manager refuse what it cannot serve with ``ValueError``: the machine asks again
    without drafts, then without the connector, and judges what is served. Fails before (the ValueError failed
    the first program asking for either)."""
    asked = []

    def plain_only(config):
        asked.append((config.connector, config.num_speculative_tokens))
        if config.connector or config.num_speculative_tokens:
            raise ValueError("connector / num_speculative_tokens: not served")
        return reference.ReferenceManager(config)

    assert programs.run_recorded(machine_for(plain_only, layouts=("gemma3",), name="plain_only"), _settings(20)) is None
    assert (True, 0) in asked and (False, 0) in asked and any(k for _, k in asked)


def test_own_hybrid_cache_passes_the_machine():
    assert cache_manager_layouts == (ONE_GROUP, "gemma3")
    machine = machine_for(cache_manager, layouts=("gemma3",), name="OwnHybrid")
    assert programs.run_recorded(machine, _settings(60)) is None
    assert machine.checks_run > 60 and machine.prefix_hits > 0
    m = cache_manager(ManagerConfig(4, 2, groups=layout_groups("gemma3", 2, 1)))
    assert isinstance(m, OwnHybridManager) and m.capabilities.groups == layout_groups("gemma3", 2, 1)
    with pytest.raises(ValueError, match="groups"):
        cache_manager(ManagerConfig(4, 2, groups=layout_groups("llama4", 2, 1)))


def _caught_and_replayed(tmp_path, spec: str, machine, n: int) -> str:
    steps = programs.run_per_layout(machine, _settings(n))
    assert steps is not None, f"{spec} passed {n} programs in each layout"
    path = programs.save(tmp_path / "case.json", spec, steps.machine_class, steps, steps.error)
    assert programs.replay_file(str(path), quiet=True) == 1, steps.error  # the case file reproduces it
    return steps.error


#: Programs each layout of a planted fault of the reference manager gets: the suite's per-layout searches under
#: ``ci`` (``programs.run_per_layout``), what a user's gate of that manager runs.
HYBRID_FAULT_EXAMPLES = 100


#: Missed by the per-layout ``ci`` searches (100 derandomized programs a layout): searched in the nightly tier, replayed
#: per push from its shipped program (``test_committed_hybrid_program_replays_its_fault``).
SLOW_PLANTED = {"drafts_cached_before_verification"}
#: The nightly tier's budget a layout (derandomized, a search depends on its budget: 100 misses it, 1,000 finds it
#: at program 71, in gemma3).
SLOW_FAULT_EXAMPLES = 1000


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow(reason="found past 100 programs a layout: its program replays per push"))
    if n in SLOW_PLANTED else n for n in sorted(HYBRID_MANAGER_MUTANTS)])
def test_planted_hybrid_manager_fault_is_caught(name, tmp_path):
    """Fails on the machine before groups, a connector and drafts (no layouts to draw, no load, drop or
    store calls): each fault lives only there."""
    machine = machine_for(HYBRID_MANAGER_MUTANTS[name], layouts=MUTANT_LAYOUTS.get(name, ("gemma3", "jamba")),
                          name=name)
    error = _caught_and_replayed(tmp_path, f"pagedkv.tools.mutants.hybrid_managers:{name}", machine,
                                 SLOW_FAULT_EXAMPLES if name in SLOW_PLANTED else HYBRID_FAULT_EXAMPLES)
    assert "AssertionError" in error, error  # the machine's checks, not a crash


#: 10-15 s each here (100+ examples); per push each is replayed from its shipped program
#: (pagedkv/testing/casefiles/hybrid/, tests/tools/test_hybrid_cache_mutants.py). full_group_untruncated:
#: found at example 145-150 since the machine draws among twelve layouts (at 8 before, among eight).
SLOW_HERE = {"window_lookup_needs_chain", "window_off_by_one", "full_group_untruncated"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow(reason="10-15 s: 100+ examples of the manager machine"))
    if n in SLOW_HERE else n for n in sorted(HYBRID_CACHE_MUTANTS)])
def test_hybrid_cache_mutant_is_caught_by_the_manager_machine(name):
    """pagedkv's own faulty hybrid caches (``HYBRID_CACHE_MUTANTS``), gated as managers in the gemma3
    layout: fails before (no layout to gate them in)."""
    machine = machine_for(with_cache_class(HYBRID_CACHE_MUTANTS[name], OwnHybridManager), layouts=("gemma3",),
                          name=name)
    assert programs.run_recorded(machine, _settings(HYBRID_FAULT_EXAMPLES)) is not None


def test_reference_counts_are_judged():
    """A manager whose exposed reference counts drift from its tables (a block counted once too often)."""

    class Drifting(reference.ReferenceManager):
        def reference_counts(self):
            refs = super().reference_counts()
            return {b: n + (b == min(refs)) for b, n in refs.items()} if refs else refs

    steps = programs.run_recorded(machine_for(Drifting, layouts=("gemma3",)), _settings(20))
    assert steps is not None and "reference counts" in steps.error


def test_capabilities_summary_names_groups_and_features():
    caps = dataclasses.replace(reference.cache_manager(ManagerConfig(
        8, 2, groups=layout_groups("llama4", 2, 1), connector=True, num_speculative_tokens=1)).capabilities)
    text = caps.summary()
    assert "chunked_local chunk 4" in text and "connector" in text and "speculative" in text


@pytest.mark.parametrize("case", ["mamba_state_cached_where_no_step_ended", "allocation_evicts_another_groups_hit",
                                  "rejected_drafts_cached_before_verification", "failed_load_cached_then_hit"])
def test_committed_hybrid_program_replays_its_fault(case, capsys):
    """The programs of four planted faults (a Mamba state cached where no step ended, vllm#48375's
    class; an allocation taking another group's hit block, vllm#44409's; draft tokens cached before their
    verification, a hit on a rejected draft; a failed connector load's blocks cached, a hit on what it left)
    replay to their failure from the committed case file, in the layouts it records."""
    from pathlib import Path

    path = Path(programs.__file__).parent / "cases" / f"{case}.json"
    assert programs.replay_file(str(path), quiet=True) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_traced_replay_prints_each_step_and_the_protocol_calls_it_made(capsys):
    """``replay --trace``: the program's steps, each followed by the calls the machine made and what the manager
    answered, up to the failure; the checks' queries are left out."""
    from pathlib import Path

    path = Path(programs.__file__).parent / "cases" / "allocation_evicts_another_groups_hit.json"
    assert programs.replay_file(str(path), trace=True) == 1
    lines = capsys.readouterr().out.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("state.")]
    calls = [line for line in lines if line.startswith("  ")]
    fail = next(i for i, line in enumerate(lines) if line.startswith("FAIL"))
    assert steps and steps[0] == 0 and steps[-1] < fail
    assert any(line.startswith("  admit(") and " -> ((" in line for line in calls)
    assert any(line.startswith("  reserve(") or line.startswith("  load(") for line in calls)
    assert not any(line.startswith(f"  {query}(") for line in calls for query in programs.QUERIES)


def test_a_store_ahead_of_the_device_cache_meets_a_local_hit_with_a_load():
    """``store_ahead``: the connector's store holds the whole prompt, so a prompt whose leading blocks hit the
    device cache loads the rest beside that hit (the ground of vllm#44409, a load's blocks allocated while the
    hit's still sit in the free queue). Fails before: no such draw; a store held the prompt's first 0-3 blocks,
    which a local hit mostly covers already (no load)."""
    loads = []
    for ahead in (False, True):
        machine = machine_for(reference.cache_manager, layouts=("gemma3",), name="StoreAhead")()
        machine.start(num_blocks=12, block_size=1, num_layers=2, window=3, layout=0, features=1)
        (first,) = machine.add(system=[1, 2, 3, 0], suffix=[], namespace=None, extra=None, chunk=12,
                               write_now=True).values
        machine.free(first)
        (second,) = machine.add(system=[1, 2, 3, 0], suffix=[1, 2, 3], namespace=None, extra=None, chunk=12,
                                write_now=True, store_ahead=ahead).values
        loading = machine.live[second].loading
        loads.append(loading and (loading[0], machine.m.num_external(second)))
        machine.check()
        if loading:
            machine.finish_load_rid(second, True)
            machine.check()
        machine.teardown()
    assert loads == [None, (4, 2)], loads  # a 4-token local hit, the 2 tokens past it loaded


def test_each_declared_layout_is_searched_with_the_whole_budget(tmp_path):
    """``run_per_layout``: one search per declared layout with the profile's whole program count, so a fault
    living in one layout of nine is searched there as fully as a one-group manager's (gpt-oss-2full-sw's planted
    second_full_group_untruncated), and its case file records that one layout and replays the failure. Fails
    before: one budget shared among the layouts by their KV-cache groups (60 programs over these three: 10, 20
    and 30). The one-group layout gets four times the profile's programs up to 400 (``ci``: 400; ``nightly``:
    its 2000); fails before that: 60 there too."""
    assert programs.layout_shares((ONE_GROUP, "gemma3", "hymba"), 60) == [(ONE_GROUP, 240), ("gemma3", 60),
                                                                          ("hymba", 60)]
    assert [programs.one_group_programs(n) for n in (2, 100, 150, 2000)] == [8, 400, 400, 2000]
    drawn = set()

    def make(config):
        drawn.add(tuple(g.kind for g in config.groups))
        return reference.cache_manager(config)

    machine = machine_for(make, layouts=reference.cache_manager_layouts, name="PerLayout")
    assert programs.run_per_layout(machine, _settings(2)) is None  # two programs each
    assert drawn == {tuple(g.kind for g in layout_groups(n, 1, 1)) for n in reference.cache_manager_layouts}
    assert machine.examples_run >= 18 and machine.checks_run > machine.examples_run
    faulty = machine_for(HYBRID_MANAGER_MUTANTS["second_full_group_untruncated"],
                         layouts=reference.cache_manager_layouts, name="PerLayout")
    steps = programs.run_per_layout(faulty, _settings(15))
    assert steps is not None and "agreed hit" in steps.error, steps and steps.error
    assert steps.machine_class.layouts == ("gpt-oss-2full-sw",) and steps.first_failing_example <= faulty.examples_run
    path = programs.save(tmp_path / "case.json", "pagedkv.tools.mutants.hybrid_managers:second_full_group_untruncated",
                         steps.machine_class, steps, steps.error)
    assert programs.replay_file(str(path), quiet=True) == 1


def test_each_layouts_search_draws_its_own_programs():
    """Two layouts built on one model (jamba and qwen3-next: full attention beside one or two Mamba layers) draw
    their own programs in the derandomized search and under one forced seed, each the same again on a rerun. Fails
    before: the search seeded from the machine class's source alone, so every layout drew the same pools,
    block sizes and windows in the same order."""
    from pagedkv.testing.hypothesis_internals import forced_seed

    def starts(layout: str, seed: int | None = None) -> list[dict]:
        seen = []

        class Logging(machine_for(reference.cache_manager, layouts=(layout,), name="Logging")):
            def log(self, name, **kwargs):
                if name == "start":
                    seen.append(kwargs)
                super().log(name, **kwargs)

        if seed is None:
            assert programs.run_recorded(Logging, _settings(12)) is None
        else:
            with forced_seed(seed):
                assert programs.run_recorded(Logging, settings(_settings(12), derandomize=False)) is None
        return seen

    assert starts("jamba") == starts("jamba") and starts("jamba", 7) == starts("jamba", 7)
    assert starts("jamba") != starts("qwen3-next")
    assert starts("jamba", 7) != starts("qwen3-next", 7)
