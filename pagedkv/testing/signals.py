"""The exceptions that steer a test run rather than report an error, which no candidate may raise to the gate."""

from __future__ import annotations

from pagedkv.testing.compare import BudgetSpent


def control_signals() -> tuple[type[BaseException], ...]:
    """The ``Exception`` types that steer a test run rather than report an error: pytest's outcomes and
    ``pytest.exit``, Hypothesis's rejection, the gate's budget signal (read lazily: the gate imports neither
    pytest nor Hypothesis to replay a case). Every ``BaseException`` that is not an ``Exception``
    (``SystemExit``, ``GeneratorExit``, a candidate's own) is one too (:func:`is_control_signal`): it would
    otherwise leave the search without a case file. ``KeyboardInterrupt`` is not: Ctrl-C stops the run wherever
    it lands."""
    signals: list[type[BaseException]] = [BudgetSpent]
    try:
        from _pytest.outcomes import Exit, OutcomeException
        signals += [OutcomeException, Exit]
    except ImportError:
        pass
    try:
        from hypothesis.errors import UnsatisfiedAssumption
        signals.append(UnsatisfiedAssumption)
    except ImportError:
        pass
    return tuple(signals)


def is_control_signal(exc: BaseException) -> bool:
    """``exc`` steers the run (:func:`control_signals`, or any ``BaseException`` but ``KeyboardInterrupt`` that is
    not an ``Exception``) rather than reports a candidate's error."""
    return not isinstance(exc, KeyboardInterrupt) and (
        not isinstance(exc, Exception) or isinstance(exc, control_signals()))
