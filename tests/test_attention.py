"""Properties 3 and 4: attention equals the fp64 reference, and nothing about the representation matters."""

import pytest
from hypothesis import example, given, strategies as st

from pagedkv.testing import checks
from strategies import cases, fragmented_cases
from pagedkv.testing.known_cases import C5, C6, C7, C8


@given(case=cases() | fragmented_cases())
@example(case=C5)
@example(case=C6)
@example(case=C7[0])
@example(case=C7[1])
@example(case=C7[2])
@example(case=C7[3])
@example(case=C8)
def test_paged_attention_matches_fp64_dense_reference(check, backend, device, case):
    check(checks.attention_matches_reference, backend, case, device)


@pytest.mark.parametrize("transform", sorted(checks.TRANSFORMS))
@given(case=cases())
@example(case=C6)
@example(case=C8)
def test_outputs_are_bit_identical_under(check, backend, device, transform, case):
    check(checks.invariant_under, backend, case, transform, device)


@given(case=cases(max_seqs=4))
@example(case=C5)
@example(case=C8)
def test_a_request_alone_equals_the_same_request_in_a_batch(check, backend, device, case):
    check(checks.alone_equals_in_batch, backend, case, device)


@given(case=cases(max_seqs=2, max_q_len=6))
@example(case=C7[0])
def test_decoding_token_by_token_equals_one_prefill_and_chunked_prefill(check, backend, device, case):
    check(checks.decode_matches_prefill, backend, case, device)
