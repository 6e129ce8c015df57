"""One test per registered property (:mod:`pagedkv.testing.registry`), named ``test_<property>``.

Each draws its cases inside the backend's declared space
(:class:`~pagedkv.backends.capabilities.Capabilities`), always runs the explicit examples that fit it,
and skips with the reason when the backend lacks an op or its declared space cannot run the property.

A backend that declares a *precondition* (for example ``finite_unused_slots``) is also run, by
``test_finding_outside_declared_preconditions``, on cases that break it: a failure there is reported
as a finding (an ``xfail`` naming what happened, plus the case file), never hidden and never passed
off as conformance.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import example, given, settings

from pagedkv.backends import backend_name
from pagedkv.backends.capabilities import Capabilities
from pagedkv.testing.databases import property_key
from pagedkv.testing.registry import Property, missing_ops_for, properties
from pagedkv.testing.plugin import INTERPRETED_MAX_EXAMPLES, capabilities_under_test, interpreted

pytestmark = pytest.mark.pagedkv

#: What a precondition forbids, as the strategy override that draws cases breaking it.
VIOLATIONS = {"finite_unused_slots": {"poisons": ("nan", "inf")}}


def _geometry(case):
    return getattr(case, "geometry", None) or case.case.geometry


def _fits(case, caps: Capabilities, violating: bool = False) -> bool:
    """Whether an explicit example lies in the declared space (and breaks the precondition when
    ``violating``, keeps it otherwise)."""
    if caps.rejects(_geometry(case)):
        return False
    if getattr(case, "features", frozenset()) - caps.features:  # a feature the backend does not declare
        return False
    poison = getattr(case, "poison", None) or getattr(getattr(case, "case", None), "poison", None)
    breaks = "finite_unused_slots" in caps.preconditions and poison in ("nan", "inf")
    return breaks if violating else not breaks


@cache
def _hypothesis_test(prop: Property, caps: Capabilities, violation: str | None = None, cap: int | None = None):
    """The property as a Hypothesis test over cases inside ``caps`` (breaking ``violation`` if given),
    drawing at most ``cap`` examples when given."""
    def body(check, backends, device, case):
        check(prop, *backends, case, device)

    overrides = VIOLATIONS.get(violation, {})
    test = given(case=prop.strategy(caps, **overrides))(body)
    for case in reversed(prop.examples()):
        if _fits(case, caps, violating=violation is not None):
            test = example(case=case)(test)
    limit = min(x for x in (prop.max_examples, cap, settings().max_examples) if x is not None)
    if limit < settings().max_examples:
        test = settings(max_examples=limit)(test)
    # A distinct database key per property: Hypothesis keys its example database by the test function.
    test.hypothesis.inner_test._hypothesis_internal_add_digest = f"{prop.name}/{violation}".encode()
    return test


def _run(prop: Property, check, backends: tuple, device: str) -> None:
    for b in backends:
        missing = missing_ops_for(b, prop)
        if missing:
            pytest.skip(f"{getattr(b, 'name', b)} does not provide {missing[0]!r}: needed by {prop.name}")
    caps = capabilities_under_test(backends[-1], for_drawing=True)
    reason = prop.requires(caps)
    if reason:
        pytest.skip(f"{prop.name}: {reason}")
    cap = INTERPRETED_MAX_EXAMPLES if any(interpreted(b) for b in backends) else None
    if prop.kind == "machine":  # Hypothesis prints the shrunk steps; there is no case to write
        prop.check(backends[-1], device, settings(max_examples=cap // 3) if cap else None)  # 50 steps a run
        return
    test = _hypothesis_test(prop, caps, None, cap)
    # keyed per property and backend(s), as `python -m pagedkv fuzz` keys it: each replays what the other found
    test._hypothesis_internal_database_key = property_key(prop.name, *(backend_name(b) for b in backends))
    test(check, backends, device)


def _make_test(prop: Property):
    if prop.pair:
        def run(check, backend_pair, device):
            _run(prop, check, tuple(backend_pair), device)
    else:
        def run(check, backend, device):
            _run(prop, check, (backend,), device)
    run.__name__ = run.__qualname__ = f"test_{prop.name}"
    run.__doc__ = prop.sentence
    return run


for _prop in properties().values():
    globals()[f"test_{_prop.name}"] = _make_test(_prop)

_FINDING_PROPERTIES = [p for p in properties().values() if p.kind == "case" and not p.pair]


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_finding_outside_declared_preconditions":
        return
    from pagedkv.testing.plugin import backends_under_test

    params, ids = [], []
    for backend in backends_under_test(metafunc.config):
        for precondition in sorted(capabilities_under_test(backend).preconditions):
            for prop in _FINDING_PROPERTIES:
                params.append((backend, precondition, prop))
                ids.append(f"{getattr(backend, 'name', 'backend')}-{precondition}-{prop.name}")
    if not params:
        metafunc.parametrize("finding", [pytest.param(None, marks=pytest.mark.skip(
            reason="no backend under test declares a precondition"))], ids=["none"])
    else:
        metafunc.parametrize("finding", params, ids=ids)


def test_finding_outside_declared_preconditions(check, finding, device):
    """Non-gating: a property on cases that break a precondition the backend declares."""
    backend, precondition, prop = finding
    for op in missing_ops_for(backend, prop):
        pytest.skip(f"{getattr(backend, 'name', backend)} does not provide {op!r}")
    caps = capabilities_under_test(backend, for_drawing=True)
    if prop.requires(caps):
        pytest.skip(prop.requires(caps))
    try:
        _hypothesis_test(prop, caps, precondition, INTERPRETED_MAX_EXAMPLES if interpreted(backend) else None)(
            check, (backend,), device)
    except AssertionError as exc:
        pytest.xfail(finding_reason(precondition, exc))


def finding_reason(precondition: str, exc: BaseException) -> str:
    """The xfail reason of a finding: its first line and the replay command of its case file."""
    lines = str(exc).strip().splitlines()
    replay = next((line for line in lines if line.startswith("replay: ")), "")
    return (f"finding (outside the declared precondition '{precondition}'): {lines[0] if lines else type(exc).__name__}"
            + (f"; {replay}" if replay else ""))
