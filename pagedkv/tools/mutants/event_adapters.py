"""Planted faults of a KV-event adapter: vLLM's manager (:mod:`pagedkv.tools.peers.vllm_hybrid_manager`) whose
translation of its KV cache events (:func:`~pagedkv.tools.peers.vllm_manager.protocol_events`) loses or bends one
kind, as a router's event consumer might. Each name here is a manager factory a program file may name
(``pagedkv.tools.mutants.event_adapters:NAME``); the machine's event index
(:mod:`pagedkv.testing.managers.kv_events`) catches each within a short search, and the shipped program
(``pagedkv/testing/casefiles/events/NAME.json``) replays it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pagedkv.testing.managers import kv_events as pk
from pagedkv.testing.managers.protocol import ManagerConfig


def _with_events(translate: Callable[[list], list], doc: str) -> Callable[[ManagerConfig], object]:
    """A factory of vLLM's manager (every layout of the vLLM peer) whose ``take_events`` passes the protocol's events
    through ``translate``."""
    def cache_manager(config: ManagerConfig):
        from pagedkv.tools.peers import vllm_hybrid_manager

        manager = vllm_hybrid_manager.cache_manager(config)
        take = manager.take_events
        manager.take_events = lambda: translate(take())
        return manager

    cache_manager.__doc__ = doc
    return cache_manager


drops_removed_events = _with_events(
    lambda events: [e for e in events if not isinstance(e, pk.BlockRemoved)],
    "BlockRemoved events are dropped: a router keeps sending prompts to blocks the cache evicted.")

salt_not_translated = _with_events(
    lambda events: [dataclasses.replace(e, salt=None) if isinstance(e, pk.BlockStored) else e for e in events],
    "A stored run's cache salt is not read from its first block's extra keys: a router files salted prefixes as "
    "unsalted ones (a tenant's prompt routed to another tenant's cache).")

#: ``{name: manager factory}``: the planted event-adapter faults (program files may name them).
EVENT_ADAPTER_MUTANTS: dict[str, Callable] = {"drops_removed_events": drops_removed_events,
                                              "salt_not_translated": salt_not_translated}

#: The layouts each is searched in (the vLLM peer's one-group manager).
cache_manager_layouts = ("one-group",)
