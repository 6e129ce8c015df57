"""A manager's declarations in the verdict: each promise it leaves off waives a judgement, and the verdict
(JSON and summary) names it; a missing dependency of one declared layout fails at once, not as a shrunk
program."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from pagedkv.errors import BackendUnavailableError
from pagedkv.testing import report
from pagedkv.testing.managers import declarations
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import GroupSpec, ManagerCapabilities
from pagedkv.testing.managers.reference import ReferenceManager
from pagedkv.testing.settings import manager_settings
from pagedkv.testing.suite.test_managers import probe_manager
from pagedkv.testing.verdict import Verdict

GEMMA3 = (GroupSpec("full", 2), GroupSpec("sliding_window", 2, window=1, num_layers=2))


class NoHitPromise(ReferenceManager):
    """The reference manager declaring neither a hit promise nor window release."""

    def __init__(self, config):
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, hit_promise=False, window_release=False)


def test_each_promise_left_off_is_waived_where_it_applies_and_inputs_not_declared_are_not_drawn():
    full = ManagerCapabilities(block_size=2, hit_promise=True, admission="chunk", eviction_order="lru",
                               cached_prompt=True)
    windowed = ManagerCapabilities(block_size=2, groups=GEMMA3, hit_promise=False, namespaces=False)
    summary = declarations.summarize([(full, 3), (windowed, 2)])
    promises = summary["promises"]
    assert summary["programs"] == 5
    assert promises["hit_promise"]["declared_in"] == 3 and promises["hit_promise"]["applicable_in"] == 5
    assert promises["window_release"] == {**promises["window_release"], "declared_in": 0, "applicable_in": 2}
    assert summary["waived"] == ["hit_promise", "admission", "window_release", "eviction_order", "cached_prompt"]
    assert "namespaces" not in summary["not_drawn"] and "fork" in summary["not_drawn"]  # one program drew salts
    line = declarations.describe(summary)
    assert "waived (not declared): hit_promise (2 of 5 programs)" in line and "window_release (2 of 2" in line
    honest = declarations.summarize([(dataclasses.replace(windowed, hit_promise=True, admission="chunk",
                                                          window_release=True, eviction_order="lru",
                                                          cached_prompt=True), 1)])
    assert honest["waived"] == [] and "namespaces" in honest["not_drawn"]
    # declarations that turn on a judgement of their own are named where no program declared them
    assert {"kv_events", "misuse"} <= set(honest["not_drawn"])
    own = declarations.summarize([(dataclasses.replace(full, kv_events=True, misuse=True), 1)])
    assert not {"kv_events", "misuse"} & set(own["not_drawn"])


def test_the_machine_records_each_programs_declarations_and_the_json_verdict_names_the_waiver():
    machine = machine_for(NoHitPromise, layouts=("gemma3",), name="NoHitPromiseMachine")
    run_state_machine_as_test(machine, settings=settings(manager_settings(5, 10), phases=(Phase.generate,)))
    summary = declarations.summarize(tuple(seen) for seen in machine.capabilities_seen.values())
    assert summary["programs"] >= 5  # every program that started, each counted once
    assert summary["waived"] == ["hit_promise", "window_release", "eviction_order"], summary
    verdict = Verdict("passed", "manager", measured={"examples": 5}, declarations=summary)
    run = report.TestRun.__new__(report.TestRun)
    run.node = types.SimpleNamespace(user_properties=[])
    backend = types.SimpleNamespace(__name__="no_hit_promise", cache_manager=NoHitPromise)
    run.record("cache_manager", backend, verdict)
    stats = {"passed": [types.SimpleNamespace(when="call", user_properties=run.node.user_properties)]}
    (candidate,) = report.verdict(stats, [backend], "no_hit_promise")["candidates"]
    assert json.loads(json.dumps(candidate))["manager_declarations"]["waived"] == summary["waived"]
    (line,) = [x for x in report.summary_lines(stats, [backend], None) if "manager promises" in x]
    assert "waived (not declared): hit_promise" in line, line


def test_a_dependency_missing_in_one_layout_is_found_before_the_search():
    def factory(config):
        if config.groups:
            raise BackendUnavailableError("no module named 'triton'; install: pip install triton")
        return ReferenceManager  # never used

    found = probe_manager(factory, "gemma3", 1, None).missing
    assert isinstance(found, BackendUnavailableError) and "triton" in str(found)
    assert probe_manager(factory, "one-group", 1, None).missing is None

    def refuses(config):
        raise ValueError("groups: not served")  # left to the search, which reports it with its program

    assert probe_manager(refuses, "gemma3", 1, None) == (None, False)


@pytest.mark.parametrize("layout", ["gemma3", "one-group"])
def test_the_reference_and_own_managers_build_for_the_probe(layout):
    from pagedkv.testing.managers import own

    factory = ReferenceManager if layout == "gemma3" else own.cache_manager
    assert probe_manager(factory, layout, 2, None).missing is None


# -- declarations that would game the verdict --------------------------------------------------------------------
def _one_start(layout="gemma3", window=1, features=0):
    return [("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": window, "layout": 0,
                       "features": features})]


def _run(factory, steps, layouts=("gemma3",), windows=(None,)):
    from pagedkv.testing.managers import programs

    programs.run_program(machine_for(factory, layouts=layouts, windows=windows), steps)


def test_groups_other_than_the_layout_asked_for_fail():
    """A manager serving gemma3's full group as a sliding window, declaring the groups it serves: judged on its
    own choice, its frees of blocks full attention reads passed (found as a green run). Fails before."""
    def windowed_full(config):
        groups = tuple(dataclasses.replace(g, kind="sliding_window", window=1) for g in config.groups)
        return ReferenceManager(dataclasses.replace(config, groups=groups))

    with pytest.raises(AssertionError, match="capabilities.groups: the manager declares groups"):
        _run(windowed_full, _one_start())
    with pytest.raises(AssertionError, match="capabilities.groups"):  # one group served of the two asked
        _run(lambda config: ReferenceManager(dataclasses.replace(config, groups=config.groups[:1])), _one_start())


def test_a_one_group_window_other_than_the_one_asked_for_fails():
    from pagedkv.testing.managers.own import cache_manager

    def window_zero(config):
        return cache_manager(dataclasses.replace(config, window_left=0))

    with pytest.raises(AssertionError, match="declares window 0 where one group of window None was asked for"):
        _run(window_zero, _one_start(), layouts=("one-group",))


def test_a_connector_refused_but_declared_fails():
    """Refusing a connector with ``ValueError`` is allowed; declaring it then is not (the verdict would report
    it served). Fails before (the machine asked again without it and judged a connector never drawn)."""
    class Declares(ReferenceManager):
        def __init__(self, config):
            if config.connector:
                raise ValueError("connector: not served")
            super().__init__(config)
            self.capabilities = dataclasses.replace(self.capabilities, connector=True)

    with pytest.raises(AssertionError, match="capabilities.connector: declared, but the manager refused it"):
        _run(Declares, _one_start(features=1))


@pytest.mark.parametrize("signal", ["reject", "skip", "exit"])
def test_a_control_signal_from_a_protocol_call_is_a_failure_with_its_program(signal):
    """``block_table`` raising Hypothesis's rejection (the failing program discarded: a green run), pytest's
    skip (the layout gone from the verdict) or ``SystemExit``: each is the manager's failure, its program kept.
    Fails before."""
    from hypothesis import reject

    from pagedkv.testing.managers import programs

    def raise_signal():
        if signal == "reject":
            reject()
        if signal == "skip":
            pytest.skip("hidden")
        raise SystemExit(0)

    class Signals(ReferenceManager):
        def block_table(self, request_id):
            if request_id >= 1:
                raise_signal()
            return super().block_table(request_id)

    machine = machine_for(Signals, layouts=("gemma3",), name="signals")
    steps = programs.run_recorded(machine, settings(manager_settings(30, 30), derandomize=True,
                                                    phases=(Phase.explicit, Phase.generate)))
    assert steps is not None and "ManagerRaisedControlSignal" in steps.error and "block_table" in steps.error, \
        getattr(steps, "error", None)


REFUSES_ALL = '''
import dataclasses

from pagedkv.testing.managers.reference import ReferenceManager


class RefusesAll(ReferenceManager):
    def __init__(self, config):
        super().__init__(config)
        # no admission promise: under it a refused admit fails at once
        self.capabilities = dataclasses.replace(self.capabilities, admission=None)

    def admit(self, *args, **kwargs):
        return None


cache_manager = RefusesAll
cache_manager_layouts = ("gemma3",)
'''

REFUSES_HITS = '''
import dataclasses

from pagedkv.testing.managers.reference import ReferenceManager


class RefusesHits(ReferenceManager):
    def __init__(self, config):
        super().__init__(config)
        # no admission promise: under it a refused admit fails at once
        self.capabilities = dataclasses.replace(self.capabilities, admission=None)

    def admit(self, request_id, *args, **kwargs):
        got = super().admit(request_id, *args, **kwargs)
        if got[1]:
            del self.requests[request_id]
            return None
        return got


cache_manager = RefusesHits
cache_manager_layouts = ("gemma3",)
'''


@pytest.mark.parametrize("source, message", [
    (REFUSES_ALL, "*the manager served no request in * programs*"),
    (REFUSES_HITS, "*the hit promise gave * admissions a hit in * programs, but the manager served none*")],
                         ids=["refuses-all", "refuses-hits"])
def test_a_manager_that_serves_no_request_or_no_promised_hit_fails_the_gate(pytester, monkeypatch, source, message):
    """Every ``admit`` refused (no token read back, nothing judged), or every one the hit promise gives a hit
    (the promise never met, any fault on a hit hidden): the layout's search fails, naming it. Fails before (a
    green run, every promise listed as judged)."""
    pytester.makepyfile(refuses_all=source)
    pytester.makeini("[pytest]\npagedkv_report_json = out/verdict.json\n")
    monkeypatch.setenv("PAGEDKV_PROFILE", "smoke")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    result = pytester.runpytest_subprocess("--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "refuses_all",
                                           "-k", "test_cache_manager", "-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([message])
    (candidate,) = json.loads((pytester.path / "out" / "verdict.json").read_text())["candidates"]
    assert "cache_manager[gemma3]" not in candidate["passed"], candidate["passed"]


def test_declarations_that_narrow_a_promise_are_named_in_the_verdict():
    """A manager declaring EAGLE's dropped block, a longer minimum to compute or sparse retention keeps a
    narrower hit promise: the summary names each, with its programs, beside the waivers; the engine default
    (``min_computed_on_full_hit`` 1, no drop, dense) names none. Fails before (no such entry)."""
    plain = ManagerCapabilities(block_size=2, hit_promise=True, admission="chunk")
    narrowed = dataclasses.replace(plain, eagle_drop=True, min_computed_on_full_hit=3)
    summary = declarations.summarize([(plain, 4), (narrowed, 1)])
    assert set(summary["qualified"]) == {"eagle_drop", "min_computed_on_full_hit"}, summary["qualified"]
    assert summary["qualified"]["eagle_drop"]["declared_in"] == 1
    assert "narrowed (declared): min_computed_on_full_hit (1 of 5 programs), eagle_drop (1 of 5" in \
        declarations.describe(summary)
    merged = declarations.merge([summary, declarations.summarize([(narrowed, 2)])])
    assert merged["qualified"]["eagle_drop"]["declared_in"] == 3
    assert declarations.summarize([(plain, 2)])["qualified"] == {}


def test_a_retention_interval_other_than_the_one_asked_for_fails():
    """Declaring sparse retention on a dense layout narrows the hit promise to the kept boundaries: judged on
    the layout asked, it fails. Fails before."""
    class Sparse(ReferenceManager):
        def __init__(self, config):
            super().__init__(config)
            self.capabilities = dataclasses.replace(self.capabilities, retention_interval=0)

    with pytest.raises(AssertionError, match="capabilities.retention_interval: the manager declares 0 where None"):
        _run(Sparse, _one_start())


def _served_twice():
    return [("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": 1, "layout": 0, "features": 0}),
            ("system_prompts", {"prompts": [[1, 2, 3, 4]]}),
            *[("serve", {"system": [1, 2, 3, 4], "suffix": [], "namespace": None, "extra": None, "image_at": 0,
                         "tail": 0, "tokens": [1], "reply": [2]})] * 2]


def test_groups_of_fewer_layers_than_asked_fail():
    """gemma3's window group declared with one layer of its two: the second layer's reads never judged. Fails
    before (the layers were not compared)."""
    def one_layer(config):
        groups = tuple(dataclasses.replace(g, num_layers=1) for g in config.groups)
        return ReferenceManager(dataclasses.replace(config, groups=groups))

    with pytest.raises(AssertionError, match="capabilities.groups: the manager declares groups"):
        _run(one_layer, _one_start())


def test_a_pool_that_shrinks_its_total_fails():
    """``counts()`` under-reporting free blocks while in use, its total shrunk to keep ``free + used == total``:
    refusals then look like a short pool to the admission promise. Fails before."""
    class Shrinks(ReferenceManager):
        def counts(self):
            free, used, total = super().counts()
            return (free - 1, used, total - 1) if self.requests and free else (free, used, total)

    with pytest.raises(AssertionError, match="a pool does not resize"):
        _run(Shrinks, _served_twice())


def test_a_promise_judged_against_the_free_count_needs_the_count():
    """``admission`` declared, ``counts()`` None: the admission promise was silently not judged. Fails before."""
    class NoCounts(_OwnsPools):
        def counts(self):
            return None

    with pytest.raises(AssertionError, match="capabilities.admission: declared, but counts\\(\\) is None"):
        _run(NoCounts, _one_start())


class _OwnsPools(ReferenceManager):
    """The reference manager holding its K/V pools (``owns_pools``: the machine then sizes nothing from
    ``counts()``)."""

    def __init__(self, config):
        super().__init__(config)
        self.page = max(g.block_size for g in config.groups)
        shape = (config.num_blocks, self.page, config.num_kv_heads, config.head_dim)
        self.pools = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                      for _ in range(config.num_layers)]
        self.capabilities = dataclasses.replace(self.capabilities, owns_pools=True)
        self.hidden = set()

    def kv_pools(self, layer):
        return self.pools[layer]


class _HidesHits(_OwnsPools):
    """Naming every hit block's pages in flight, for good."""

    def admit(self, request_id, *args, **kwargs):
        got = super().admit(request_id, *args, **kwargs)
        self.hidden |= {b * self.page + o for table in got[0] for b in table if b >= 0 for o in range(self.page)}
        return got

    def in_flight_pages(self):
        return set(self.hidden)


def test_pages_named_in_flight_with_no_step_in_flight_fail():
    """A manager owning its pools names the pages a copy still fills (left unread until the step it waits on
    completes); naming a hit's pages with nothing in flight would hide a wrong hit from every read. Fails
    before."""
    with pytest.raises(AssertionError, match="in_flight_pages\\(\\) names pages .* while no step is in flight"):
        _run(_HidesHits, _served_twice())


# -- a third round: answers that lie by type, capabilities that change, a watermark, refusals ---------------------
class _AlwaysAtLeast(int):
    """An ``int`` whose ``>=`` always holds: a hit "at least" any promised one."""

    __hash__ = int.__hash__

    def __ge__(self, other):
        return True


def test_an_int_subclass_whose_comparisons_always_hold_is_judged_by_its_value():
    """A manager that never serves a hit, answering its hit length as an ``int`` subclass whose ``>=`` always
    holds: the hit promise (``cached >= promised``) passed. Fails before."""
    class NeverHits(ReferenceManager):
        def _hit_blocks(self, req, n):
            return None

        def admit(self, *args, **kwargs):
            tables, hit = super().admit(*args, **kwargs)
            return tables, _AlwaysAtLeast(hit)

    with pytest.raises(AssertionError, match="a hit of 0 tokens, but its first 4 were committed"):
        _run(NeverHits, _served_twice())


def test_capabilities_that_change_while_a_manager_serves_fail():
    """``capabilities`` answering the checks one way and the machine's later reads another (gemma3's groups to
    ``check_served``, no hit promise afterwards): each read must agree with the first. Fails before."""
    class Flips(ReferenceManager):
        reads = 0

        @property
        def capabilities(self):
            Flips.reads += 1
            caps = self.__dict__["declared"]
            return caps if Flips.reads <= 1 else dataclasses.replace(caps, hit_promise=False)

        @capabilities.setter
        def capabilities(self, value):
            self.__dict__["declared"] = value

    with pytest.raises(AssertionError, match="capabilities: the manager declared .* and later"):
        _run(Flips, _one_start())


def test_a_pool_smaller_than_asked_for_fails_even_with_the_difference_named_reserved():
    """Two blocks kept aside as ``reserved_blocks`` out of the pool asked for (a watermark: refusals with
    blocks free look like a short pool to the admission promise). Fails before."""
    class Watermark(ReferenceManager):
        reserved_blocks = 2

        def counts(self):
            free, used, total = super().counts()
            return free - 2, used, total - 2

    with pytest.raises(AssertionError, match=r"counts\(\): a pool of 6 blocks where 8 were asked for"):
        _run(Watermark, _one_start())


def test_an_admit_refused_under_the_admission_promise_fails():
    """``admit`` takes no block: under the admission promise a refused one escapes every judgement of the
    request (a stale hit hidden behind refusals of the requests that would read it). Fails before."""
    class RefusesSecond(ReferenceManager):
        admits = 0

        def admit(self, request_id, *args, **kwargs):
            self.admits += 1
            return None if self.admits > 1 else super().admit(request_id, *args, **kwargs)

    with pytest.raises(AssertionError, match="admit refused, but it takes no block"):
        _run(RefusesSecond, _served_twice())
    summary = declarations.summarize([(ManagerCapabilities(block_size=2, hit_promise=True), 3)])
    assert summary["qualified"]["hit_promise without admission"]["declared_in"] == 3  # named where unjudged


def test_whole_prompt_admission_declared_where_the_prompt_need_not_fit_fails():
    """``admission="sequence"`` (a refusal excused by the whole prompt's need) on a pool asked with
    ``full_sequence_must_fit`` off: more refusals pass as promised. Fails before."""
    class Sequence(ReferenceManager):
        def __init__(self, config):
            super().__init__(config)
            self.capabilities = dataclasses.replace(self.capabilities, admission="sequence")

    with pytest.raises(AssertionError, match="capabilities.admission: 'sequence' declared where"):
        _run(Sequence, _one_start())


def test_a_manager_declaring_misuse_is_searched_with_the_api_rules():
    """The suite mixes the API rules (:mod:`~pagedkv.testing.managers.api_rules`) into the machine of a manager
    that declares ``misuse`` (pagedkv's own cache), and only there."""
    from pagedkv.testing.managers import own

    assert probe_manager(own.cache_manager, "one-group", 2, None).misuse
    assert not probe_manager(ReferenceManager, "gemma3", 2, None).misuse
    assert not probe_manager(lambda config: 1 / 0, "gemma3", 2, None).misuse  # the search reports that one


def test_a_failure_that_depends_on_state_shared_across_managers_says_so():
    """A manager whose fault fires on the fifth admission of the whole search (a class attribute): the failing
    program goes another way when run again, and the finding names shared state, not only Hypothesis's
    ``Flaky`` error. Fails before (the error was Hypothesis's alone)."""
    from pagedkv.testing.managers import programs

    class SharedCounter(ReferenceManager):
        admits = 0

        def admit(self, *args, **kwargs):
            SharedCounter.admits += 1
            return None if SharedCounter.admits == 5 else super().admit(*args, **kwargs)

    steps = programs.run_recorded(machine_for(SharedCounter, layouts=("gemma3",), name="shared"),
                                  settings(manager_settings(30, 30), derandomize=True))
    assert steps is not None and "share state (a module or class attribute)" in steps.error, \
        getattr(steps, "error", None)


def test_a_prompt_shorter_than_min_computed_on_full_hit_is_computed_whole():
    """A manager leaving 2 tokens to compute on a full hit (``min_computed_on_full_hit=2``, an honest narrowing
    the verdict names) admits a one-token prompt with no hit: it computes the prompt whole. Before, any prompt
    shorter than the declared count failed ("at least 2 must be computed")."""
    class ComputesTwo(ReferenceManager):
        def __init__(self, config):
            super().__init__(config)
            self.capabilities = dataclasses.replace(self.capabilities, min_computed_on_full_hit=2)

    _run(ComputesTwo, [*_one_start(), ("add", {"system": [0], "suffix": [], "namespace": None, "extra": None,
                                               "chunk": 1, "write_now": True})])


def test_a_manager_declaring_misuse_other_than_before_the_search_fails():
    """The suite mixes the API rules in by the manager it builds before the search (``probe_manager``); a manager
    declaring ``misuse`` in the search's builds only would be searched without them (a manager telling the two
    builds apart by its call stack hid a double free that way, green)."""
    from pagedkv.testing.managers import own, programs

    machine = machine_for(own.cache_manager, layouts=("one-group",), probed_misuse=False)
    with pytest.raises(AssertionError, match="capabilities.misuse: True here, False for the manager built"):
        programs.run_program(machine, _one_start())
    programs.run_program(machine_for(own.cache_manager, layouts=("one-group",), probed_misuse=True), _one_start())


def test_a_manager_writing_its_pools_in_a_call_that_reads_fails():
    """A manager owning its pools could write, in ``block_table`` (which the machine calls right before it reads
    a request's K/V), the K/V the machine expects there, hiding a stale hit (a red-team manager did; its fault then
    showed only as an in-flight hand-out). Every call that reads the manager's state is now checked to leave the
    pools bit for bit as they were."""
    from pagedkv.testing.managers import own, programs
    from pagedkv.testing.managers.calls import ManagerWroteInARead

    class WritesOnRead(own.OwnCacheManager):
        def block_table(self, request_id):
            table = super().block_table(request_id)
            for layer in range(self.cache.config.num_layers if table else 0):
                self.kv_pools(layer)[0][table[0]].zero_()
            return table

    start = [*_one_start(), ("add", {"system": [0, 1], "suffix": [2], "namespace": None, "extra": None,
                                     "chunk": 3, "write_now": True})]
    with pytest.raises(ManagerWroteInARead, match="block_table: the call changed the K/V pools"):
        programs.run_program(machine_for(WritesOnRead, layouts=("one-group",)), start)
    programs.run_program(machine_for(own.OwnCacheManager, layouts=("one-group",)), start)


def test_the_kernel_property_guards_a_candidates_cache_class_and_not_pagedkvs_own():
    """Under ``cache_state_machine_holds_its_invariants`` the kernel is judged; the pool guard judges the manager,
    so it is on for a candidate's own ``cache_class`` and off for pagedkv's ``PagedKVCache`` (its own searches
    run it under the guard)."""
    from pagedkv.cache.paged_cache import PagedKVCache
    from pagedkv.testing.managers import kernel_property, programs
    from pagedkv.testing.managers.calls import ManagerWroteInARead

    class WritesOnRead(PagedKVCache):
        def block_table(self, seq_id):
            table = super().block_table(seq_id)
            for layer in range(self.config.num_layers if len(table) else 0):
                self.k_cache(layer)[int(table[0])].zero_()
            return table

    start = [("start", {"num_blocks": 8, "block_size": 0, "num_layers": 2, "window": 0}),
             ("add", {"system": [0, 1], "suffix": [2], "namespace": None, "extra": None, "chunk": 3,
                      "write_now": True})]
    with pytest.raises(ManagerWroteInARead, match="block_table: the call changed the K/V pools"):
        programs.run_program(kernel_property.machine_for_backend(cache_class=WritesOnRead), start)
    assert not kernel_property.machine_for_backend().guard_manager_pools
    programs.run_program(kernel_property.machine_for_backend(), start)


class _OwnsOnePool:
    """A manager owning one pool whose ``counts`` (a read-only call) writes it as ``write`` says."""

    def __init__(self) -> None:
        self.pool, self.write = torch.zeros(4, 2), None

    def counts(self):
        if self.write == "in place":
            self.pool[0] = 1.0
        elif self.write == "through .data":  # moves no version counter
            self.pool.data[0] = 1.0
        elif self.write == "set_":  # the same tensor now reads other memory
            self.pool.set_(torch.ones(4, 2))
        elif self.write == "relocated":  # other memory at the same address: views kept across calls read a copy
            spare = self.pool.clone()
            self.pool.untyped_storage()._swap_data_ptr_(spare.untyped_storage())
            spare[0] = 1.0
            self.pool.set_(spare)
        elif self.write == "retyped":  # the same bytes, read as other values
            self.pool.data = self.pool.view(torch.int32)
        elif self.write == "snapshot":
            self.snapshot()
        return (0, 0, 4)

    def snapshot(self):
        self.pool[0] += 1.0

    def reserve(self):
        self.pool[1] = 2.0


@pytest.mark.parametrize("write", ["in place", "through .data", "set_", "relocated", "retyped", "snapshot"])
def test_the_pool_guard_catches_a_write_in_a_read_after_earlier_reads(write):
    """The guard copies the pools only where they may have changed (a call that may write, the machine's own
    write, a version counter moved) and compares them after every read-only call: a write in a read that follows
    other reads is caught whether or not it moves a version counter or the pool's memory (other memory put at the
    same address, which byte views kept across calls missed, and the same bytes read as another dtype); the
    machine's writes and a writing call's are not taken for the manager's."""
    from pagedkv.testing.managers.calls import ManagerCalls, ManagerWroteInARead

    manager = _OwnsOnePool()
    calls = ManagerCalls(manager)
    calls.guard_pools([manager.pool])
    calls.counts()
    calls.reserve()  # may write: not a finding
    calls.counts()
    manager.pool.data[2] = 3.0  # the machine writes through a K/V backend that moves no version counter ...
    calls.pools_written()  # ... and says so
    calls.counts()
    calls.counts()
    manager.write = write
    with pytest.raises(ManagerWroteInARead, match="counts: the call changed the K/V pools"):
        calls.counts()
    if write == "snapshot":  # a query of the API rules reads too
        with pytest.raises(ManagerWroteInARead, match="snapshot: the call changed the K/V pools"):
            calls.snapshot()


def test_the_pool_guard_reads_through_properties_and_answers_classes():
    """A read-only name the manager serves as a property runs its code at the look-up (the machine looks up
    ``in_flight_pages`` itself): guarded too. A named tuple answered is rebuilt as a plain tuple, so its class's
    ``__getitem__`` (the manager's code) never runs when the machine indexes it."""
    import collections

    from pagedkv.testing.managers.calls import ManagerCalls, ManagerWroteInARead

    class Counts(collections.namedtuple("Counts", "free used total")):
        def __getitem__(self, i):
            owner.pool[0] += 1.0
            return tuple.__getitem__(self, i)

    class Sneaky(_OwnsOnePool):
        def counts(self):
            return Counts(0, 0, 4)

        @property
        def in_flight_pages(self):
            self.pool[1] += 1.0

    owner = Sneaky()
    calls = ManagerCalls(owner)
    calls.guard_pools([owner.pool])
    assert calls.counts()[2] == 4 and type(calls.counts()) is tuple and not owner.pool.any()
    with pytest.raises(ManagerWroteInARead, match="in_flight_pages: the call changed the K/V pools"):
        getattr(calls, "in_flight_pages", None)


@pytest.mark.parametrize("declared", [{"block_size": 10**9}, {"hit_alignment": 1}])
def test_a_hash_block_or_hit_alignment_other_than_the_layout_asks_fails(declared):
    """A grouped manager's ``block_size`` is the hash block the promises are judged in: declared huge, EAGLE's
    promise capped every hit at 0 and a manager caching nothing under drafts passed. ``hit_alignment`` is the
    prefix-match unit asked, or none."""
    def declares(config):
        manager = ReferenceManager(config)
        manager.capabilities = dataclasses.replace(manager.capabilities, **declared)
        return manager

    with pytest.raises(AssertionError, match=f"capabilities.{next(iter(declared))}: the manager declares"):
        _run(declares, _one_start())


def test_promises_declared_beside_a_mamba_group_are_named_not_judgeable():
    """Beside a Mamba group no hit is promised (the replay promise of ``hit_alignment`` aside) and the cached-prompt
    count is not judged: a manager declaring both there is not listed as judged on them (a manager caching nothing
    passed ``qwen3-next-fine`` with both shown as judged), but under "declared, not judgeable here"."""
    from pagedkv.testing.managers.protocol import layout_groups

    caps = ManagerCapabilities(block_size=1, groups=layout_groups("jamba", 1, 1), hit_promise=True, cached_prompt=True)
    summary = declarations.summarize([(caps, 5)])
    assert summary["promises"]["hit_promise"]["declared_in"] == summary["promises"]["hit_promise"]["applicable_in"] == 0
    assert set(summary["unjudged"]) == {"hit_promise", "cached_prompt"}
    line = declarations.describe(summary)
    assert "judged: none" in line and "not judgeable here: hit_promise (5 of 5 programs)" in line, line
    aligned = dataclasses.replace(caps, hit_alignment=1)  # the replay promise judges a hit
    assert declarations.summarize([(aligned, 5)])["promises"]["hit_promise"]["declared_in"] == 5
