"""The kit's one door to Hypothesis's private API: what Hypothesis does not offer publicly yet the kit
needs. Every other module uses Hypothesis's public API only, so a Hypothesis release that moves one of
these names breaks this module alone (each function falls back where a fallback is fair).
"""

from __future__ import annotations

import contextlib

from typing import Any


def registered_profiles() -> list[str]:
    """The names of every registered settings profile, sorted (Hypothesis has a public lookup,
    ``settings.get_profile``, but no public listing)."""
    from hypothesis import settings

    return sorted(getattr(settings, "_profiles", {}))


def failure_origin(exc: BaseException) -> Any:
    """Which failure ``exc`` is, the way Hypothesis tells distinct failures apart (the exception's type
    and raising line, ``InterestingOrigin``); a hashable key."""
    try:
        from hypothesis.internal.escalation import InterestingOrigin

        return InterestingOrigin.from_exception(exc)
    except Exception:  # noqa: BLE001 - another Hypothesis: the innermost frame is a fair key
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return (type(exc), tb.tb_frame.f_code.co_filename if tb else "", tb.tb_lineno if tb else 0)


def set_database_key(test: Any, key: bytes) -> None:
    """Key ``test``'s examples in the example database by ``key`` instead of the test function's name
    (the kit builds one test function per run, so the name would be the same for every property)."""
    test._hypothesis_internal_database_key = key


def state_machine_test(machine: Any, chosen: Any, key: bytes) -> Any:
    """The test function ``run_state_machine_as_test(machine, settings=chosen)`` runs, its examples keyed
    in the example database by ``key`` (Hypothesis keys a state machine by a digest of its class, the
    same for every candidate the kit builds a machine for). ``hypothesis.stateful.get_state_machine_test``
    is public in name, not documented."""
    from hypothesis.stateful import get_state_machine_test

    test = get_state_machine_test(machine, settings=chosen)
    set_database_key(test, key)
    return test


@contextlib.contextmanager
def forced_seed(seed: int):
    """Seed every Hypothesis test built inside the block (``hypothesis.core.global_force_seed``, what
    ``--hypothesis-seed`` sets): a state machine's test is built inside Hypothesis, where no ``@seed``
    decorator can reach it."""
    import hypothesis.core

    before, hypothesis.core.global_force_seed = hypothesis.core.global_force_seed, seed
    try:
        yield
    finally:
        hypothesis.core.global_force_seed = before


@contextlib.contextmanager
def salted_search(machine: type, salt: str):
    """Make the search of state machine class ``machine`` built inside the block its own for ``salt``: a
    derandomized search seeds from a digest of the class's source and ``salt``
    (``_hypothesis_internal_add_digest``, which Hypothesis sets on a parametrized test), and a forced seed
    (:func:`forced_seed`) is hashed with ``salt``. Without it every class built from one source (one machine
    over several layouts) draws one stream of programs."""
    import hashlib

    import hypothesis.core

    machine._hypothesis_internal_add_digest = salt.encode()
    forced = hypothesis.core.global_force_seed
    if forced is None:
        yield
        return
    with forced_seed(int.from_bytes(hashlib.blake2b(f"{forced}:{salt}".encode(), digest_size=8).digest(),
                                    "little")):
        yield


@contextlib.contextmanager
def without_local_constants():
    """Generate inside the block without the constants Hypothesis harvests from every imported local module
    (``providers._get_local_constants``: the literals of the code under test, drawn now and then): with them
    a derandomized run draws other examples depending on which modules the process imported first (another
    test file, a peer), so its verdict is not one fixed search. Hypothesis's own constants stay."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # another Hypothesis: nothing to pin
        yield
        return
    harvest = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if harvest is None or cache is None or not hasattr(cache, "cache"):
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()  # (choice type, constraints) -> constants allowed, computed with the harvest
    try:
        yield
    finally:
        providers._get_local_constants = harvest
        cache.cache.clear()
