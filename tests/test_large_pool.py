"""Case C10's kind: slot arithmetic stays exact on pools past 2**24 slots (float32's exact integers).

Each example places one or two short sequences in the *last* blocks of a pool of more than 2**24
slots with tiny heads (``num_kv_heads = head_dim = 1``, 16-bit dtypes: 32 MiB a pool), so float32
(or other narrow) index arithmetic misplaces them. Pools past 2**31 slots are covered by the 64-bit
slot arithmetic tests, which need no pool.
"""

from hypothesis import given, settings

from pagedkv.testing import checks
from pagedkv.testing.mutants import LARGE_POOL_EXAMPLES
from strategies import large_pool_cases

_FEW = settings(max_examples=min(settings().max_examples, LARGE_POOL_EXAMPLES))


@_FEW
@given(case=large_pool_cases())
def test_gather_is_exact_on_pools_past_2_24_slots(check, backend, device, case):
    check(checks.gather_matches_definition, backend, case, device)


@_FEW
@given(case=large_pool_cases())
def test_scatter_is_exact_on_pools_past_2_24_slots(check, backend, device, case):
    check(checks.scatter_round_trip, backend, case, device)


@_FEW
@given(case=large_pool_cases())
def test_write_kv_is_exact_on_pools_past_2_24_slots(check, backend, device, case):
    check(checks.write_kv_matches_definition, backend, case, device)
