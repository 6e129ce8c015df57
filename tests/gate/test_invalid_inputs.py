"""The invalid-call strategy and its plain data: every fault kind is drawn, calls round-trip through JSON.

The properties over a backend (every op rejects a bad argument with the contract's error type,
naming it, before writing anything) are registered in :mod:`pagedkv.testing.registry`.
"""

from __future__ import annotations

from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
from pagedkv.testing.cases.invalid_call import OPS, InvalidCall, faults_for
from pagedkv.testing.strategies import invalid_calls


C9_SCATTER = Case(Geometry(num_blocks=4, block_size=4), (SeqSpec((2, 0), 8, 1, 6),), values="identity")


def test_every_fault_kind_is_drawn():
    """The strategy reaches every fault of every op (the faults are each plantable in some case)."""
    from hypothesis import Phase, find, settings

    for op in OPS:
        for f in faults_for(op):
            call = find(invalid_calls(ops=(op,), faults=(f.name,)), lambda c, n=f.name: c.fault == n,
                        settings=settings(max_examples=300, database=None, phases=[Phase.generate]))
            assert call.op == op and call.fault == f.name


def test_invalid_call_round_trips_through_json():
    call = InvalidCall("scatter", "start_negative", C9_SCATTER, 0, 3)
    assert InvalidCall.from_dict(call.to_dict()) == call
    names = {"InvalidCall": InvalidCall, "Case": Case, "Geometry": Geometry, "SeqSpec": SeqSpec}
    assert eval(repr(call), names) == call
