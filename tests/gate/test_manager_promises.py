"""What a manager declares, judged: the step count and the failing example are measured, and planted
faults of vLLM's KVCacheManager in the classes the declarations cover (an identity that collides only in
its encoding, the lru eviction order, the hit promise, frees under in-flight steps) are caught."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
from hypothesis import Phase, settings

from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.own import OwnCacheManager
from pagedkv.testing.managers.reference import ReferenceManager
from pagedkv.testing.settings import manager_settings
from pagedkv.tools.mutants.managers import FreesSharedBlocksUnchecked

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _settings(n: int) -> settings:
    return settings(manager_settings(n, 30), derandomize=True, phases=(Phase.explicit, Phase.generate))


def test_steps_and_first_failing_example_are_measured():
    machine = machine_for(OwnCacheManager, name="Counted")
    assert programs.run_recorded(machine, _settings(20)) is None
    assert machine.checks_run > 20 and machine.examples_run >= 20
    faulty = machine_for(FreesSharedBlocksUnchecked, name="CountedFault")
    steps = programs.run_recorded(faulty, _settings(100))
    assert steps is not None and 1 <= steps.first_failing_example <= faulty.examples_run <= 101  # +1: the replay


def test_decode_runs_on_after_the_steps_in_flight_complete():
    """``decode``: a request whose prefill step is still in flight (a manager that defers commits) completes it
    and then decodes, so output fills blocks (a preemption with output, a window passing a long chunk's blocks).
    Fails before: nothing happened while a step was in flight (most decode draws did nothing)."""
    machine = machine_for(OwnCacheManager, name="DecodeInFlight")()  # defers commits: a step stays in flight
    machine.start(num_blocks=12, block_size=1, num_layers=2, window=0)
    (rid,) = machine.add(system=[1, 2, 3], suffix=[0], namespace=None, extra=None, chunk=12, write_now=False).values
    assert machine.live[rid].in_flight  # the prefill step not written yet
    machine.decode(rid, tokens=[3, 1, 2])
    req = machine.live[rid]
    assert not req.in_flight and req.tokens == [1, 2, 3, 0, 3, 1, 2] and req.written == req.committed == 7
    machine.check()
    machine.teardown()


class AsyncReference(ReferenceManager):
    """The reference manager with asynchronous steps, honestly: a window group keeps what every uncommitted token
    reads, and a free while reserved tokens are uncommitted waits for their ``commit``, which caches them like any
    commit (a finished request's last step inserted as it completes, as SGLang's radix cache does)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, async_steps=True)
        self._uncommitted_from = None

    def reserve(self, request_id, token_ids, num_draft=0):
        self._uncommitted_from = self.requests[request_id].computed
        try:
            return super().reserve(request_id, token_ids, num_draft)
        finally:
            self._uncommitted_from = None

    def _first_read(self, g, position):
        if self._uncommitted_from is not None:
            position = min(position, self._uncommitted_from)
        return super()._first_read(g, position)

    def commit(self, request_id, num_tokens):
        super().commit(request_id, num_tokens)
        self._settle(request_id)

    def _settle(self, request_id):
        req = self.requests.get(request_id)
        if req is None or req.freed and req.reserved > req.computed:
            return  # steps in flight: the free waits for their commit
        super()._settle(request_id)


def test_a_freed_requests_last_step_cached_as_it_completes_is_hittable():
    """An honest asynchronous manager caches a freed request's in-flight step when it commits (the free deferred
    until then); a later prompt hitting it is served what was committed. Fails before (shrunk from a search of
    llama4: "a hit on its first 1 tokens, which no request committed"): the machine registered no committed
    tokens of a request already freed."""
    machine = machine_for(AsyncReference, layouts=("llama4",), name="AsyncDeferredFree")
    add = {"system": [0], "suffix": [], "namespace": None, "extra": None, "chunk": 1, "write_now": False,
           "image_at": 0, "stored": 0, "tail": 0}
    programs.run_program(machine, [
        ("start", {"num_blocks": 4, "block_size": 0, "num_layers": 2, "window": 0, "layout": 0, "features": 0}),
        ("system_prompts", {"prompts": [[0]]}), ("add", add), ("free", {"rid": 0}), ("write_pending_rid", {"rid": 0}),
        ("serve", {"system": [0], "suffix": [0], "namespace": None, "extra": None, "image_at": 0, "tail": 0,
                   "tokens": [0], "reply": [0]})])
    assert programs.run_recorded(machine_for(AsyncReference, layouts=("gpt-oss-2full-sw",), name="AsyncSearch"),
                                 _settings(60)) is None


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (see docs/peers.md)")
def test_a_one_group_window_promises_the_blocks_its_hit_reads():
    """A sliding-window manager's hit promise: the blocks a hit's window reads, as a hybrid layout's window
    group's (vLLM's ``SlidingWindowManager`` serves a hit whose leading blocks were evicted). Fails before: one
    group promised a hit only where every leading block was still cached, so a window's request promised 0."""
    from pagedkv.testing.managers.machine import Request
    from pagedkv.tools.peers import vllm_manager

    machine = machine_for(vllm_manager.cache_manager, windows=(1,), block_sizes=(2,), name="WindowPromise")()
    machine.start(num_blocks=8, block_size=0, num_layers=2, window=0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 0]
    (first,) = machine.add(system=prompt, suffix=[], namespace=None, extra=None, chunk=12, write_now=True).values
    machine.free(first)
    machine.evict(n=1)  # the lowest cached block: the prompt's first, tokens 0..1
    req = Request(None, [], {}, [], len(prompt))
    req.extend(prompt)
    # a hit of 6 tokens reads tokens 5.. (window_left 1): block 2 (tokens 4..5) is still cached
    assert machine.promised_hit(req) == 6
    machine.add(system=prompt, suffix=[], namespace=None, extra=None, chunk=12, write_now=True)  # vLLM hits them
    machine.check()
    machine.teardown()


def _vllm_fault(name: str):
    from pagedkv.tools.peers import vllm_manager

    class Faulty(vllm_manager.VllmCacheManager):
        def __init__(self, config):
            super().__init__(config)
            pool, single = self.pool, self.manager.coordinator.single_type_managers[0]
            if name == "free-not-reversed":  # a request's blocks released head first
                single.free = lambda rid: pool.free_blocks(single.pop_blocks_for_free(rid))
            elif name == "cache-one-block-late":  # a full block is cached only once the next one fills
                coordinator, bs = self.manager.coordinator, config.block_size
                cache_blocks = coordinator.cache_blocks
                coordinator.cache_blocks = lambda request, n: cache_blocks(request, max(0, n - bs))
            elif name == "resumed-hit-capped-at-prompt":  # a lookup's limit from the prompt, not every token
                manager, coordinator = self.manager, self.manager.coordinator
                lookup, find = manager.get_computed_blocks, coordinator.find_longest_cache_hit
                looked_up = []

                def capped_lookup(request):
                    looked_up[:] = [request]
                    return lookup(request)

                manager.get_computed_blocks = capped_lookup
                coordinator.find_longest_cache_hit = lambda hashes, max_length: find(
                    hashes, min(max_length, looked_up[0].num_prompt_tokens - 1))

        def _request(self, request_id, token_ids, namespace, extra_keys):
            if name == "lora-path-dropped" and isinstance(namespace, tuple) and namespace[:1] != ("lora",):
                # one adapter name at two paths keyed as one
                namespace = tuple((p[0], p[1], "/lora") if p[0] == "lora" else p for p in namespace)
            return super()._request(request_id, token_ids, namespace, extra_keys)

        def reserve(self, request_id, token_ids):
            if name == "window-frees-in-flight":  # the window frees on the optimistic basis
                self.settled[request_id] = self.requests[request_id].num_computed_tokens
            return super().reserve(request_id, token_ids)

    return Faulty


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (see docs/peers.md)")
@pytest.mark.parametrize("fault", [
    pytest.param("lora-path-dropped", marks=pytest.mark.slow(reason="40 s: 100+ examples of vLLM's manager")),
    "free-not-reversed",
    "cache-one-block-late",
    pytest.param("window-frees-in-flight", marks=pytest.mark.slow(reason="20 s: dozens of examples of vLLM's manager")),
    # a preempted request resumed as vLLM resumes it, its output's blocks promised (decode runs on after its steps
    # in flight complete; a window's promise asks for the blocks its hit reads, not every leading one)
    pytest.param("resumed-hit-capped-at-prompt", marks=pytest.mark.slow(reason="10 s: 230 examples of vLLM's manager")),
])
def test_planted_vllm_faults_are_caught(fault):
    """Before the machine judged these declarations (the lru order, the hit promise, asynchronous steps,
    LoRA adapters by name and path), each of these ran 100 examples clean; ``resumed-hit-capped-at-prompt``
    (vLLM's own tests miss it) ran 150 clean before decode completed a request's steps in flight and a
    window's promise left out the blocks its hit does not read."""
    from pagedkv.tools.peers import vllm_manager

    machine = machine_for(_vllm_fault(fault), windows=vllm_manager.cache_manager_windows, name=fault)
    steps = programs.run_recorded(machine, _settings(int(os.environ.get("PAGEDKV_FAULT_EXAMPLES", 150))))
    assert steps is not None, f"{fault}: survived {machine.examples_run} examples"
    assert "AssertionError" in steps.error or "ValueError" in steps.error, steps.error



class _RaisesFreeingAHit(OwnCacheManager):
    """Frees a request that was admitted on a prefix hit with an exception: a failure inside a rule."""

    def admit(self, request_id, token_ids, namespace=None, extra_keys=()):
        table, cached = super().admit(request_id, token_ids, namespace, extra_keys)
        self.hits = {**getattr(self, "hits", {}), request_id: cached}
        return table, cached

    def free(self, request_id):
        if getattr(self, "hits", {}).get(request_id):
            raise RuntimeError(f"request {request_id} was admitted on a hit")
        super().free(request_id)


def test_first_failing_example_is_where_the_search_failed_not_where_shrinking_ended():
    """A failure raised inside a rule (the machine's assertions on a write, a manager's exception) counts at the
    program where the search first failed, the count a run without shrinking stops at, although shrinking then
    runs more programs. Fails before: it counted every program shrinking ran."""
    unshrunk = machine_for(_RaisesFreeingAHit, name="FirstFailureUnshrunk")
    found = programs.run_recorded(unshrunk, _settings(100))
    shrinking = machine_for(_RaisesFreeingAHit, name="FirstFailureShrunk")
    shrunk = programs.run_recorded(shrinking, settings(manager_settings(100, 30), derandomize=True,
                                                       phases=(Phase.explicit, Phase.generate, Phase.shrink)))
    assert found is not None and shrunk is not None and "admitted on a hit" in shrunk.error
    assert shrinking.examples_run > found.first_failing_example  # shrinking ran programs after the first failure
    assert shrunk.first_failing_example == found.first_failing_example, (shrunk.first_failing_example,
                                                                         found.first_failing_example)
