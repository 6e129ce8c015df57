"""The suite bites: a planted fault is caught by the round-trip property and shrunk to a tiny case."""

import types

import pytest
from hypothesis import find, settings

from pagedkv import get_backend
from pagedkv.testing.properties import definitions as checks
from pagedkv.validation.calls import check_gather
from pagedkv.testing.strategies import cases

indexed = get_backend("indexed")


def gather_with_tail_fault(cache, block_table, seq_len, validate=True):
    """The indexed gather, except that when ``seq_len`` is a multiple of ``block_size`` the last row is
    read at offset ``seq_len % block_size`` (0) instead of ``block_size - 1``: the wrong token."""
    out = indexed.gather(cache, block_table, seq_len, validate)
    table, _ = check_gather(cache, block_table, seq_len)
    block_size = cache.shape[1]
    if seq_len and seq_len % block_size == 0:
        out[-1] = cache[table[seq_len // block_size - 1], seq_len % block_size]
    return out


faulty = types.SimpleNamespace(name="indexed-tail-fault", gather=gather_with_tail_fault, scatter=indexed.scatter,
                               write_kv=indexed.write_kv, paged_attention=indexed.paged_attention)


def round_trip_fails(case) -> bool:
    try:
        checks.scatter_round_trip(faulty, case)
    except checks.Mismatch:
        return True
    return False


def test_the_fault_is_invisible_off_the_boundary():
    from pagedkv.testing.cases.known import C8  # lengths 5, 13, 2 with block_size 4: no multiple of the block size

    checks.scatter_round_trip(faulty, C8)


def test_round_trip_catches_a_wrong_token_at_a_block_multiple_and_shrinks_it_to_two_blocks_at_most():
    shrunk = find(cases(repeats=False), round_trip_fails,
                  settings=settings(max_examples=1000, database=None, derandomize=True, deadline=None))
    blocks = sum(len(shrunk.used_table(i)) for i in range(len(shrunk.seqs)))
    assert blocks <= 2, f"shrunk case still uses {blocks} blocks: {shrunk!r}"
    assert any(s.seq_len and s.seq_len % shrunk.geometry.block_size == 0 for s in shrunk.seqs)
    with pytest.raises(checks.Mismatch, match="position"):
        checks.scatter_round_trip(faulty, shrunk)
