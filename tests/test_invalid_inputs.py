"""Every backend op rejects a bad argument with the contract's error type, before writing anything.

Each example is a valid case with exactly one argument broken (:mod:`strategies.invalid`): the call
must raise the builtin type the contract names (``IndexError`` for a block id or slot outside the
pool, ``ValueError`` for shapes, lengths and devices, ``TypeError`` for dtypes and argument kinds),
the message must name the argument, and both pools must be bit-identical afterwards.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given

from pagedkv.testing import checks
from pagedkv.testing.cases import Case, Geometry, SeqSpec
from pagedkv.testing.invalid import FAULTS, OPS, InvalidCall, check_rejected, fault_sites, faults_for
from strategies import invalid_calls


C9_SCATTER = Case(Geometry(num_blocks=4, block_size=4), (SeqSpec((2, 0), 8, 1, 6),), values="identity")


@given(call=invalid_calls(ops=("gather",)))
@example(call=InvalidCall("gather", "block_id_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 5),))))
@example(call=InvalidCall("gather", "block_id_negative", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 5),))))
def test_gather_rejects_bad_arguments(check, backend, device, call):
    check(check_rejected, backend, call, device)


@given(call=invalid_calls(ops=("scatter",)))
@example(call=InvalidCall("scatter", "block_id_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 6, 1, 0),))))
@example(call=InvalidCall("scatter", "duplicate_block", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 6, 1, 1),))))
def test_scatter_rejects_bad_arguments_and_writes_nothing(check, backend, device, call):
    check(check_rejected, backend, call, device)


@given(call=invalid_calls(ops=("write_kv",)))
@example(call=InvalidCall("write_kv", "slot_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1), 4, 1, 0),))))
@example(call=InvalidCall("write_kv", "duplicate_slot", Case(Geometry(3, 2), (SeqSpec((0, 1), 4, 1, 0),))))
def test_write_kv_rejects_bad_arguments_and_writes_nothing(check, backend, device, call):
    check(check_rejected, backend, call, device)


@given(call=invalid_calls(ops=("paged_attention",)))
@example(call=InvalidCall("paged_attention", "query_start_loc_decreasing",
                          Case(Geometry(4, 2), (SeqSpec((0,), 2, 1), SeqSpec((1, 2), 3, 2)))))
@example(call=InvalidCall("paged_attention", "q_len_exceeds_seq_len", Case(Geometry(4, 2), (SeqSpec((0, 1), 3, 3),))))
@example(call=InvalidCall("paged_attention", "heads_not_divisible",
                          Case(Geometry(4, 2, num_kv_heads=2, num_queries_per_kv=3), (SeqSpec((0,), 2, 1),))))
def test_paged_attention_rejects_bad_arguments(check, backend, device, call):
    check(check_rejected, backend, call, device)


@pytest.mark.parametrize("op,fault", sorted(FAULTS))
def test_every_fault_is_rejected_on_a_fixed_case(check, backend, device, op, fault):
    """Each fault kind at least once, on a case that can carry every fault."""
    case = Case(Geometry(num_blocks=6, block_size=2, num_kv_heads=2, num_queries_per_kv=2),
                (SeqSpec((4, 1), 3, 2, 1), SeqSpec((0, 3, 5), 5, 1, 0)), values="identity", poison="nan")
    sites = fault_sites(op, fault, case)
    assert sites, f"the fixed case cannot carry {op}/{fault}"
    check(check_rejected, backend, InvalidCall(op, fault, case, sites[-1]), device)


def test_c9_capacity_is_checked_before_any_write(backend, device):
    """C9: a 2-block table (block_size 4) cannot hold seq_len 9, nor 3 tokens scattered at start 6."""
    cache = torch.full((4, 4, 1, 4), float("nan"), device=device)
    cache[2] = 1.0
    cache[0] = 2.0
    table = torch.tensor([2, 0, -1], dtype=torch.int32, device=device)
    before = cache.clone()
    with pytest.raises(ValueError, match=r"block_table has 2 entries.*seq_len 9"):
        checks.require(backend, "gather")(cache, table[:2], 9)
    with pytest.raises(IndexError, match=r"block_table has block id -1 at entry 2"):
        checks.require(backend, "gather")(cache, table, 9)
    values = torch.ones((3, 1, 4), dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match=r"start \+ n = 6 \+ 3 = 9"):
        checks.require(backend, "scatter")(cache, table[:2], values, 6)
    assert torch.equal(checks.bits(cache.cpu()), checks.bits(before.cpu()))


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
    assert eval(repr(call), {"InvalidCall": InvalidCall, "Case": Case, "Geometry": Geometry, "SeqSpec": SeqSpec}) == call
