"""The cache manager as the machine calls it: what a manager says about itself is checked against what it was
asked, and a test runner's control signal raised from inside a call is a failure.

A manager could otherwise turn a failing program green without serving it: raise ``pytest.skip`` (the
layout's search skipped and gone from the verdict) or Hypothesis's ``reject()`` / ``assume(False)`` (the
failing program discarded as invalid) from a protocol call, declare groups or a window other than the ones
asked for (judged against its own choice), or refuse a connector or drafts with ``ValueError`` while declaring
them (reported as served).
"""

from __future__ import annotations

import functools
from typing import Any

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


class ManagerCalls:
    """``manager`` with every attribute look-up and method call passed through :func:`call_manager`."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        value = call_manager(f"looking up {name}", getattr, self._manager, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def method(*args, **kwargs):
            __tracebackhide__ = True
            return call_manager(name, value, *args, **kwargs)

        object.__setattr__(self, name, method)
        return method


def check_served(caps: Any, asked: Any, served: Any) -> None:
    """The manager's capabilities ``caps`` describe what it was ``asked`` (a :class:`~.protocol.ManagerConfig`),
    as far as it ``served`` it (the config it was built with after refusals, :meth:`~.machine.ManagerMachine.
    make_served`): the groups asked (kind, block size, window, chunk, layers, in order), or for one group its
    window;
    the retention interval asked; no connector or drafts declared where they were refused.

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
    else:
        assert not caps.groups and caps.window == asked.window_left, \
            "capabilities: the manager declares " + (f"groups {caps.groups}" if caps.groups else
                                                      f"window {caps.window!r}") + \
            f" where one group of window {asked.window_left!r} was asked for: it is judged on what it is asked for"
    assert caps.retention_interval == asked.retention_interval, \
        f"capabilities.retention_interval: the manager declares {caps.retention_interval!r} where " \
        f"{asked.retention_interval!r} was asked for (ManagerConfig.retention_interval): the hit promise follows " \
        f"the retention asked"
    for name, refused in (("connector", asked.connector and not served.connector),
                          ("speculative", asked.num_speculative_tokens and not served.num_speculative_tokens)):
        assert not (refused and getattr(caps, name)), \
            f"capabilities.{name}: declared, but the manager refused it with ValueError: a manager that cannot " \
            f"serve it leaves the capability off"
