"""Properties 1 and 2: gather, scatter and write_kv move data exactly, and every backend agrees bit for bit."""

from hypothesis import example, given

from pagedkv.testing import checks
from strategies import cases, fragmented_cases
from pagedkv.testing.known_cases import C5, C6, C8


@given(case=cases() | fragmented_cases())
@example(case=C5)
@example(case=C6)
@example(case=C8)
def test_gather_returns_exactly_what_each_slot_holds(check, backend, device, case):
    check(checks.gather_matches_definition, backend, case, device)


@given(case=cases(repeats=False) | fragmented_cases())
@example(case=C6)
@example(case=C8)
def test_scatter_then_gather_round_trips_and_touches_no_other_slot(check, backend, device, case):
    check(checks.scatter_round_trip, backend, case, device)


@given(case=cases(repeats=False) | fragmented_cases())
@example(case=C5)
def test_write_kv_lands_at_slot_mapping_and_skips_negative_slots(check, backend, device, case):
    check(checks.write_kv_matches_definition, backend, case, device)


@given(case=cases() | fragmented_cases())
@example(case=C8)
def test_every_pair_of_backends_agrees(check, backend_pair, device, case):
    first, second = backend_pair
    check(checks.backends_agree, first, second, case, device)
