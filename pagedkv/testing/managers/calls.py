"""The cache manager as the machine calls it: what a manager says about itself is checked against what it was
asked, and a test runner's control signal raised from inside a call is a failure.

A manager could otherwise turn a failing program green without serving it: raise ``pytest.skip`` (the
layout's search skipped and gone from the verdict) or Hypothesis's ``reject()`` / ``assume(False)`` (the
failing program discarded as invalid) from a protocol call, declare groups or a window other than the ones
asked for (judged against its own choice), refuse a connector or drafts with ``ValueError`` while declaring
them (reported as served), answer with an ``int`` subclass whose comparisons always hold (a hit "at least"
the promised one, a free count "at least" any need), or declare one set of capabilities to the checks and
another to the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from typing import Any

import torch

from pagedkv.testing.signals import is_control_signal


class ManagerRaisedControlSignal(RuntimeError):
    """The manager raised a test runner's control signal (``pytest.skip`` / ``xfail`` / ``fail`` / ``exit``,
    Hypothesis's ``reject()`` / ``assume(False)``, ``SystemExit``, its own ``BaseException``) from a call: a
    failure with its program, never a skip or a discarded program."""


def _signal(where: str, exc: BaseException) -> ManagerRaisedControlSignal:
    return ManagerRaisedControlSignal(
        f"{where} raised {type(exc).__name__} ({exc}): a control signal (a test runner's, or leaving the process) "
        f"from a cache manager is a failure; only the gate skips a search or discards a program")


def call_manager(where: str, function, *args, **kwargs) -> Any:
    """``function(*args, **kwargs)``, a control signal it raises re-raised as :class:`ManagerRaisedControlSignal`
    naming ``where``; every other exception (the manager's error, judged as it is) and ``KeyboardInterrupt``
    propagate unchanged."""
    __tracebackhide__ = True
    try:
        return function(*args, **kwargs)
    except BaseException as exc:
        if is_control_signal(exc):
            raise _signal(where, exc) from exc
        raise


def exact(value: Any) -> Any:
    """``value`` as plain data: every integer an exact ``int`` (an ``int`` subclass or a NumPy integer by its
    value, never its own comparisons), every list, tuple, set and dict (a subclass too) rebuilt from its items,
    and the protocol's dataclasses (capabilities, groups) field by field. Tensors, ``bool``, ``None``, strings
    and other objects pass unchanged (a tensor is the manager's pool, written through)."""
    kind = type(value)
    if kind is int or kind is bool or value is None or isinstance(value, (str, bytes, float, torch.Tensor)):
        return value
    if isinstance(value, int):
        return int.__index__(value)  # the stored value: an override of __index__ or __eq__ is not called
    if isinstance(value, numbers.Integral):
        return int.__index__(operator.index(value))
    if isinstance(value, tuple):
        items = [exact(v) for v in tuple.__iter__(value)]
        return tuple(items)  # a named tuple's class too is the manager's (its __getitem__ could run its code)
    if isinstance(value, list):
        return [exact(v) for v in list.__iter__(value)]
    if isinstance(value, set):
        return {exact(v) for v in set.__iter__(value)}
    if isinstance(value, frozenset):
        return frozenset(exact(v) for v in frozenset.__iter__(value))
    if isinstance(value, dict):
        return {exact(k): exact(v) for k, v in dict.items(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and \
            type(value).__module__ == "pagedkv.testing.managers.protocol":
        return dataclasses.replace(value, **{f.name: exact(getattr(value, f.name)) for f in dataclasses.fields(value)
                                             if f.init})
    return value


class ManagerCapabilitiesChanged(AssertionError):
    """The manager's ``capabilities`` read differently within one program."""


#: Protocol calls that read a manager's state: a manager owning its pools (``capabilities.owns_pools``) must not
#: write them there, or it could write, as the machine asks where to read, what the machine is about to read.
READ_ONLY_CALLS = frozenset({"block_table", "counts", "holds", "reference_counts", "self_check",
                             "cached_prompt_tokens", "num_external", "in_flight_pages", "take_events", "cached_keys",
                             "snapshot", "misuses"})


class ManagerWroteInARead(AssertionError):
    """A call of :data:`READ_ONLY_CALLS` changed the K/V pools the manager owns."""


class ManagerCalls:
    """``manager`` with every attribute look-up and method call passed through :func:`call_manager`, and every
    answer through :func:`exact`; ``capabilities`` is read once per manager, and a later read that differs
    fails (:class:`ManagerCapabilitiesChanged`); once :meth:`guard_pools` names the pools it owns, a call of
    :data:`READ_ONLY_CALLS` that changes them fails (:class:`ManagerWroteInARead`)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._capabilities = None
        self._pools: tuple = ()
        self._dtypes: tuple = ()
        self._verified: tuple | None = None  # (version counters, bytes) the pools last held, or None: unknown

    def guard_pools(self, pools) -> None:
        """Compare ``pools`` (the K/V tensors the manager owns, read by the machine) bit for bit after every
        call of :data:`READ_ONLY_CALLS` from now on, against the bytes they held before it. Those bytes are
        copied again only where the pools may have changed since the last compare: after a call that may
        write, after :meth:`pools_written`, or where a pool's version counter moved. So a manager's own write
        to its pools lands inside a call that may write (an asynchronous copy it queues there completes before
        that call returns, or moves the version counter): one landing later is blamed on the next read."""
        self._pools = tuple(pools)
        self._dtypes = tuple(pool.dtype for pool in self._pools)
        self._verified = None

    def pools_written(self) -> None:
        """The machine wrote the guarded pools (through a K/V backend, which need not move a version counter):
        the next read-only call copies them afresh."""
        self._verified = None

    def _pool_bytes(self) -> list:
        """Each guarded pool's bytes as they are now (NaN compares equal to itself bit for bit), read afresh from
        the pool tensors the machine reads: a view kept across calls would miss a pool moved onto other memory
        (``set_``, a storage swapped or relocated) at the same address."""
        return [pool.view(torch.uint8) if pool.dim() and pool.stride(-1) == 1  # one op: the guard's hot path
                else pool.detach().reshape(-1).view(torch.uint8) for pool in self._pools]

    def _versions(self) -> tuple:
        return tuple(pool._version for pool in self._pools)

    def _unchanged(self, name: str, before: list) -> None:
        for i, (now, old) in enumerate(zip(self._pool_bytes(), before)):
            # the same bytes read as another dtype are another value
            if not torch.equal(now, old) or self._pools[i].dtype != self._dtypes[i]:
                raise ManagerWroteInARead(
                    f"{name}: the call changed the K/V pools the manager owns (pool {i}); a call that reads the "
                    f"manager's state must not write what the machine reads")

    def _read(self, name: str, call: Any, *args, **kwargs) -> Any:
        """``call(*args, **kwargs)``'s exact answer, the guarded pools compared after it against their bytes before."""
        versions = self._versions()
        if self._verified is None or self._verified[0] != versions:
            self._verified = (versions, [pool.clone() for pool in self._pool_bytes()])
        answer = exact(call(*args, **kwargs))
        self._unchanged(name, self._verified[1])  # the whole compare, every read-only call
        self._verified = (self._versions(), self._verified[1])  # equal bytes: a rewrite of the same values
        return answer

    def __getattr__(self, name: str) -> Any:
        lookup = (f"looking up {name}", getattr, self._manager, name)
        guarded = self._pools and name in READ_ONLY_CALLS  # a look-up runs the manager's code too (a property)
        value = self._read(name, call_manager, *lookup) if guarded else call_manager(*lookup)
        if not callable(value):
            value = exact(value)
            if name == "capabilities":
                if self._capabilities is None:
                    self._capabilities = value
                elif value != self._capabilities:
                    raise ManagerCapabilitiesChanged(
                        f"capabilities: the manager declared {self._capabilities!r} and later {value!r}: what it "
                        f"declares is read once per manager and must not change while it serves a program")
                return self._capabilities
            return value

        @functools.wraps(value)
        def method(*args, **kwargs):
            __tracebackhide__ = True
            if self._pools and name in READ_ONLY_CALLS:
                return self._read(name, call_manager, name, value, *args, **kwargs)
            self._verified = None  # a call that may write: the pools are copied afresh before the next read
            return exact(call_manager(name, value, *args, **kwargs))

        object.__setattr__(self, name, method)
        return method


def check_served(caps: Any, asked: Any, served: Any) -> None:
    """The manager's capabilities ``caps`` describe what it was ``asked`` (a :class:`~.protocol.ManagerConfig`),
    as far as it ``served`` it (the config it was built with after refusals, :meth:`~.machine.ManagerMachine.
    make_served`): the groups asked (kind, block size, window, chunk, layers, in order) with the hash block size
    (the prefix-match unit asked, or the groups' gcd) and a hit alignment of that unit or none, or for one group its
    window; the retention interval asked; no connector or drafts declared where they were refused.

    Raises:
        AssertionError: a mismatch, naming the capability.
    """
    if asked.groups:
        declared = tuple((g.kind, g.block_size, g.window, g.chunk, g.num_layers) for g in caps.groups or ())
        wanted = tuple((g.kind, g.block_size, g.window, g.chunk, g.num_layers) for g in asked.groups)
        assert declared == wanted, \
            f"capabilities.groups: the manager declares groups {declared} (kind, block size, window, chunk, " \
            f"layers) for " \
            f"the layout asked, {wanted}: it is judged on the layout it is asked for, or refuses it (ValueError)"
        # the hash block: the prefix-match unit asked, or (a manager not looking up inside blocks) the groups' gcd
        coarse = math.gcd(*(g.block_size for g in asked.groups))
        assert caps.block_size in (asked.prefix_match_unit or coarse, coarse), \
            f"capabilities.block_size: the manager declares {caps.block_size!r} where the layout's hash block is " \
            f"{asked.prefix_match_unit or coarse} (or {coarse}, its groups' gcd): the promises are judged in it"
        assert caps.hit_alignment in (None, asked.prefix_match_unit), \
            f"capabilities.hit_alignment: the manager declares {caps.hit_alignment!r} where the prefix-match unit " \
            f"asked is {asked.prefix_match_unit!r} (ManagerConfig.prefix_match_unit): hits land on the unit asked, " \
            f"or on whole blocks (None)"
    else:
        assert not caps.groups and caps.window == asked.window_left, \
            "capabilities: the manager declares " + (f"groups {caps.groups}" if caps.groups else
                                                      f"window {caps.window!r}") + \
            f" where one group of window {asked.window_left!r} was asked for: it is judged on what it is asked for"
    assert caps.retention_interval == asked.retention_interval, \
        f"capabilities.retention_interval: the manager declares {caps.retention_interval!r} where " \
        f"{asked.retention_interval!r} was asked for (ManagerConfig.retention_interval): the hit promise follows " \
        f"the retention asked"
    assert caps.admission != "sequence" or served.full_sequence_must_fit, \
        "capabilities.admission: 'sequence' declared where ManagerConfig.full_sequence_must_fit is off: the whole " \
        "prompt's need is a refusal's excuse only where the prompt must fit (declare 'chunk')"
    for name, refused in (("connector", asked.connector and not served.connector),
                          ("speculative", asked.num_speculative_tokens and not served.num_speculative_tokens)):
        assert not (refused and getattr(caps, name)), \
            f"capabilities.{name}: declared, but the manager refused it with ValueError: a manager that cannot " \
            f"serve it leaves the capability off"
