"""The kernel property ``cache_state_machine_holds_its_invariants``: the cache-manager machine
(:mod:`.machine`, with :class:`~.api_rules.ApiRules`) over pagedkv's own cache
(:class:`~.own.OwnCacheManager`, or the candidate's ``cache_class``), every K/V write and read through
the candidate's ``write_kv`` and ``gather`` (its ``write_kv`` only, read by indexing, where it has no
``gather``), at a geometry inside its declared space. The gate runs it under the guard
(:func:`pagedkv.testing.execute.run`), so every call is checked as a kernel property's is.

The machine judges, after every step, every live request's K/V read back bit for bit in every layer,
the slots handed out, hits, counts and the cache's own invariants; the API rules add pagedkv's declared
refusals (double frees, bad arguments, oversized reservations), failed and partial writes and forks
that diverge at once (copy-on-write). A failure raises what the shrunk program raised, the program
printed beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import settings

from pagedkv.cache.config import CacheConfig, dtype_from_name
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.testing.managers.own import OwnCacheManager, cache_manager_windows
from pagedkv.testing.managers.protocol import ManagerConfig

#: Rules per run of the machine.
STEPS = 50
#: How many runs of the machine have started in this process (``execute.run`` reports the runs that ran).
RUNS_STARTED = [0]
PREFERRED_BLOCK_SIZES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
    """The pools' per-token shape, dtype, device and poison a kernel's declared space allows."""

    num_kv_heads: int = 1
    head_dim: int = 2
    dtype: str = "float32"
    device: str = "cpu"
    poison: str = "nan"


def own_manager_for(geometry: KernelGeometry, cache_class: type = PagedKVCache) -> type[OwnCacheManager]:
    """:class:`~.own.OwnCacheManager` over ``cache_class`` whose pools have ``geometry`` (in the pool
    layout the gate sets: :func:`pagedkv.testing.cases.memory.pool_layout`)."""
    from pagedkv.testing.cases.case import Geometry

    def cache_config(self, config: ManagerConfig) -> CacheConfig:
        g = Geometry(config.num_blocks, config.block_size, geometry.num_kv_heads, geometry.head_dim, 1, geometry.dtype)
        return dataclasses.replace(g.cache_config(geometry.device, config.num_layers), window_left=config.window_left,
                                   debug_poison=geometry.poison)

    def __init__(self, config: ManagerConfig) -> None:
        OwnCacheManager.__init__(self, config)
        # without extra keys (a cache_key of all of them is coarser than each position's), what was
        # committed and not evicted hits: the promise is judged
        self.capabilities = dataclasses.replace(self.capabilities, extra_keys=False, hit_promise=True)

    return type(f"Own{cache_class.__name__}", (OwnCacheManager,), {"cache_class": cache_class, "__init__": __init__,
                                                                   "cache_config": cache_config})


def machine_for_backend(backend: Any = None, device: str = "cpu", caps: Any = None,
                        cache_class: type | None = None) -> type:
    """The machine over pagedkv's own cache (``cache_class``, else the backend's ``cache_class``, else
    :class:`PagedKVCache`) with K/V through ``backend`` (``None``: pagedkv's ``indexed``), at a geometry
    inside ``caps`` (block sizes 1, 2, 4, head_dim 2, one kv head, float32 where it allows them)."""
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.managers.api_rules import ApiRules
    from pagedkv.testing.managers.machine import machine_for

    cls = cache_class or getattr(backend, "cache_class", None) or PagedKVCache
    block_sizes, geometry = PREFERRED_BLOCK_SIZES, KernelGeometry(device=device)
    if caps is not None:
        block_sizes = caps.block_sizes.choose(PREFERRED_BLOCK_SIZES)[:3]
        geometry = KernelGeometry(caps.num_kv_heads.choose((1, 2))[0], caps.head_dims.choose((2, 4, 8))[0],
                                  next(d for d in ("float32", "float16", "bfloat16") if d in caps.dtypes), device)
    if backend is not None and "finite_unused_slots" in capabilities_of(backend).preconditions:
        geometry = dataclasses.replace(geometry, poison="max")  # unused slots are loaded: they must be finite
    # pagedkv's own cache is not what this property judges (the kernel is, under the kernel guard), and its own
    # searches run it under the pool guard: the guard is on only for a candidate's own cache_class
    return machine_for(own_manager_for(geometry, cls), block_sizes=block_sizes, windows=cache_manager_windows,
                       name=f"CacheMachine_{cls.__name__}", rule_sets=(ApiRules,), kv_backend=backend,
                       num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                       dtype=dtype_from_name(geometry.dtype), guard_manager_pools=cls is not PagedKVCache)


def cache_state_machine(backend: Any, device: str = "cpu", chosen: settings | None = None, caps: Any = None) -> None:
    """Run the machine over ``backend`` inside ``caps`` (the registered property of kind ``"machine"``):
    ``chosen`` (``None``: the loaded profile) with :data:`STEPS` rules per run.

    Raises:
        AssertionError, or what the backend raised (a guard's ``ContractViolation``): the shrunk
        program's failure, with the program as a note.
    """
    from pagedkv.testing.managers import programs
    from pagedkv.testing.settings import machine_settings

    machine = machine_for_backend(backend, device, caps)
    try:
        steps = programs.run_recorded(machine, machine_settings(chosen, STEPS))
    finally:
        RUNS_STARTED[0] += getattr(machine, "examples_run", 0)
    if steps is not None:
        exc = steps.exception or AssertionError(steps.error)
        exc.add_note(f"the shrunk program ({len(steps)} steps):\n{programs.as_text(steps)}")
        raise exc
