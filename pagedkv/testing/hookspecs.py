"""The pagedkv plugin's own pytest hooks: how another plugin acts inside the suite without the suite
importing it (the refactor baseline of :mod:`pagedkv.tools.baseline.gate` is one; a team's own
recorder can be another). Implement them in a ``conftest.py`` or a plugin, marked
``@pytest.hookimpl(optionalhook=True)`` so that it loads where pagedkv is not installed.
"""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_pagedkv_activated(config: pytest.Config, spec: str | None) -> None:
    """The pagedkv plugin acts in this run (a candidate is named, the conformance suite is collected, or
    the ini key ``pagedkv_builtin`` is set), its profile loaded. Called once per process from the
    plugin's ``pytest_configure``.

    Args:
        spec: the candidate named with ``--pagedkv-impl`` / ``$PAGEDKV_IMPL``; ``None`` for the built-in
            backends.

    Raises:
        pytest.UsageError: a usage error of the implementing plugin's own options.
    """


@pytest.hookspec
def pytest_pagedkv_case_passed(config: pytest.Config, prop, backends: tuple, case, device: str, spec: str,
                        case_file) -> None:
    """A drawn case just passed a property's conformance check (the verdict stands whatever this does).

    Args:
        prop: the registered property (:class:`pagedkv.testing.registry.Property`).
        backends: ``(candidate,)``, or ``(reference, candidate)`` for a pair property.
        case: the case (:class:`pagedkv.testing.cases.Case` or another kind).
        device: the torch device the case ran on.
        spec: the candidate's spec (``--pagedkv-impl``) or, for a built-in backend, its name.
        case_file: the test's case file path (written while an example runs, removed when it passes).

    Raises:
        AssertionError: the implementing plugin fails this example (it is then shrunk and reported
            like any failure).
    """
