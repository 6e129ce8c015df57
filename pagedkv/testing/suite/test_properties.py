"""One test per registered property (:mod:`pagedkv.testing.registry`), named ``test_<property>``.

Each draws its cases from the property's strategy, always runs its explicit examples, and skips with
the reason when the backend lacks an op the property needs.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings

from pagedkv.testing.registry import Property, missing_ops_for, properties

pytestmark = pytest.mark.pagedkv


def _make_test(prop: Property):
    def body(check, backend, device, case):
        check(prop, backend, case, device)

    def pair_body(check, backend_pair, device, case):
        first, second = backend_pair
        check(prop, first, second, case, device)

    test = given(case=prop.strategy())(pair_body if prop.pair else body)
    for case in reversed(prop.examples()):
        test = example(case=case)(test)
    if prop.max_examples is not None:
        test = settings(max_examples=min(settings().max_examples, prop.max_examples))(test)

    if prop.pair:
        def run(check, backend_pair, device):
            first, second = backend_pair
            missing = missing_ops_for(first, prop) + missing_ops_for(second, prop)
            if missing:
                pytest.skip(f"no op {missing[0]!r}: needed by {prop.name}")
            test(check, backend_pair, device)
    else:
        def run(check, backend, device):
            missing = missing_ops_for(backend, prop)
            if missing:
                pytest.skip(f"{getattr(backend, 'name', backend)} does not provide {missing[0]!r}: needed by "
                            f"{prop.name}")
            test(check, backend, device)

    # A distinct digest per property: Hypothesis keys its example database by the test function.
    test.hypothesis.inner_test._hypothesis_internal_add_digest = prop.name.encode()
    run.__name__ = run.__qualname__ = f"test_{prop.name}"
    run.__doc__ = prop.sentence
    return run


for _prop in properties().values():
    globals()[f"test_{_prop.name}"] = _make_test(_prop)
