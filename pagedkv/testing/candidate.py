"""The candidate of one run, built once and passed down: the backend, its declarations and how its ops
are called.

:func:`candidate` reads a backend's declarations once (:func:`pagedkv.backends.capabilities.capabilities_of`
for what it declares, :func:`pagedkv.testing.space.capabilities_under_test` for the space drawn in here);
:meth:`Candidate.view` gives, per case, the backend under a fresh guard
(:class:`pagedkv.testing.guard.GuardedBackend`) seen through its declared layout and page table
(:func:`pagedkv.testing.space.as_declared_layout`), and :meth:`Candidate.bound` the bound of a declared
non-promise (:mod:`pagedkv.testing.non_promises`).

Around the guard, :class:`OpCalls` turns a :class:`~pagedkv.testing.compare.MissingOp` raised from inside
an op call into :class:`OpRaisedMissingOp` (and so an op the candidate provided when it was loaded that a
later look-up finds missing: what it provides is read once, :attr:`Candidate.provided`), and a control
signal (``pytest.skip`` / ``pytest.exit``, Hypothesis's ``reject()``, the gate's budget signal,
``SystemExit`` or any other ``BaseException`` but ``KeyboardInterrupt``) into
:class:`OpRaisedControlSignal`: the gate decides what is skipped (:func:`pagedkv.testing.compare.require`,
:meth:`pagedkv.testing.registry.Property.cannot_run`), and a candidate raising the gate's own signal for an
input in its declared space fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pagedkv.testing.compare import MissingOp
from pagedkv.testing.signals import is_control_signal

#: The contract's ops (the guard's, :data:`pagedkv.testing.guard.GUARDED_OPS`): an exception raised from inside
#: one of them, or from looking one up, is the candidate's.
OPS = ("paged_attention", "paged_attention_csr", "write_kv", "gather", "scatter", "merge_attn_states")


class OpRaisedMissingOp(RuntimeError):
    """The candidate raised ``MissingOp`` from inside an op call: a failure, not a skip."""


class OpRaisedControlSignal(RuntimeError):
    """The candidate raised a test runner's control signal from inside an op call (``pytest.skip`` /
    ``xfail`` / ``fail`` / ``exit``, Hypothesis's ``reject()`` / ``assume(False)``, the gate's budget signal,
    ``SystemExit``, ``GeneratorExit``, its own ``BaseException``): a failure with its case file, never a skip,
    a rejected case, a partial run or the end of the session."""


def provided_ops(backend: Any) -> frozenset:
    """The ops of :data:`OPS` ``backend`` provides (a callable attribute), read once when the candidate is
    loaded: an attribute that is absent, ``None``, not callable or raises ``AttributeError`` / ``MissingOp`` on
    look-up is not provided; any other error of the look-up propagates (a broken candidate)."""
    provided = set()
    for name in OPS:
        try:
            value = getattr(backend, name, None)
        except MissingOp:
            continue
        if callable(value):
            provided.add(name)
    return frozenset(provided)


class OpCalls:
    """``backend`` whose op calls re-raise a ``MissingOp`` as :class:`OpRaisedMissingOp` (the op's
    signature is kept: ``functools.wraps``); every other attribute is the backend's own. ``provided``: the ops
    the candidate provided when loaded (:func:`provided_ops`); one of them that a later look-up finds missing
    (the look-up raises, or gives something not callable) raises :class:`OpRaisedMissingOp`, so that a
    candidate cannot turn a property into a skip by hiding an op while the gate looks it up."""

    def __init__(self, backend: Any, provided: frozenset = frozenset()):
        self._backend = backend
        self._provided = provided

    def __getattr__(self, name: str) -> Any:
        try:
            value = getattr(self._backend, name)
        except Exception as exc:
            if name in self._provided:
                raise OpRaisedMissingOp(f"looking {name} up raised {type(exc).__name__} ({exc}), but the candidate "
                                        f"provided it when loaded: only the gate decides that an op is missing") \
                    from exc
            raise
        if name in self._provided and not callable(value):
            raise OpRaisedMissingOp(f"looking {name} up gave {type(value).__name__}, but the candidate provided it "
                                    f"when loaded: only the gate decides that an op is missing")
        if name not in OPS or not callable(value):
            return value

        @functools.wraps(value)
        def op(*args, **kwargs):
            __tracebackhide__ = True
            try:
                return value(*args, **kwargs)
            except MissingOp as exc:
                raise OpRaisedMissingOp(f"{name} raised MissingOp from inside the call ({exc}): an input in the "
                                        f"declared space must be judged, and only the gate skips") from exc
            except BaseException as exc:
                if not is_control_signal(exc):
                    raise  # an interrupt, or the candidate's error: judged as it is
                raise OpRaisedControlSignal(
                    f"{name} raised {type(exc).__name__} from inside the call ({exc}): a control signal (a test "
                    f"runner's, or leaving the process) from a kernel is a failure; only the gate skips, rejects "
                    f"a case or stops a search") from exc

        object.__setattr__(self, name, op)
        return op


@dataclass(frozen=True)
class Candidate:
    """One backend under test and what it declares, read once.

    Attributes:
        backend: the object the user named (or a built-in backend).
        declared: its :class:`~pagedkv.backends.capabilities.Capabilities` as declared.
        space: the space drawn in here (:func:`pagedkv.testing.space.capabilities_under_test`, drawing).
        provided: the ops it provides, read once (:func:`provided_ops`).
    """

    backend: Any
    declared: Any
    space: Any
    provided: frozenset = frozenset()

    def view(self) -> tuple[Any, Any]:
        """``(guard, ops)`` for one case: a fresh guard over the backend, and the ops a property calls (the
        guard seen through the declared layout and page table)."""
        from pagedkv.testing.guard import GuardedBackend
        from pagedkv.testing.space import as_declared_layout

        guard = GuardedBackend(self.backend, self.declared)  # on the backend itself: it counts the backend's calls
        return guard, as_declared_layout(OpCalls(guard, self.provided), self.declared)

    def bound(self, prop: str) -> Any:
        """The :class:`~pagedkv.testing.non_promises.Bound` of ``prop`` (``None``: promised)."""
        from pagedkv.testing.non_promises import bound_for

        return bound_for(self.declared, prop)

    def non_promise(self, prop: str) -> Any:
        """The declared :class:`~pagedkv.backends.capabilities.NonPromise` of ``prop``, or ``None``."""
        return self.declared.non_promise(prop)


def candidate(backend: Any, space: Any = None) -> Candidate:
    """The :class:`Candidate` of ``backend`` (``space``: the drawing space when the caller has one).

    Raises:
        TypeError: the backend's ``capabilities`` is not a Capabilities.
        ValueError: a malformed declaration (see :func:`pagedkv.backends.capabilities.capabilities_of`).
    """
    if isinstance(backend, Candidate):
        return backend
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.space import capabilities_under_test

    declared = capabilities_of(backend)
    return Candidate(backend, declared, space if space is not None else capabilities_under_test(backend,
                                                                                                 for_drawing=True),
                     provided_ops(backend))
