"""The concrete cases of the project's case list (C1-C9) as plain data: the explicit examples the
registered properties always run, and the invalid calls the rejection properties always try."""

from pagedkv.testing.cases.case import CacheScenario, Case, Geometry, SeqSpec
from pagedkv.testing.cases.invalid_call import InvalidCall

# C1: a prompt whose cached prefix is exactly one block (and one token short of / past one block).
C1 = [CacheScenario(Geometry(8, 16, 1, 4), (("add", 0, tuple(range(n))),
                                            ("add", 1, tuple(range(n)) + (90, 91, 92, 93, 94))))
      for n in (16, 15, 17)]
# C2: a 6-token sequence forked mid-block (block_size 4); both append 3 different tokens.
C2 = CacheScenario(Geometry(8, 4, 1, 4), (("add", 0, (1, 2, 3, 4, 5, 6)), ("fork", 0, 1), ("append", 0, (7, 7, 7)),
                                          ("append", 1, (9, 9, 9))))
# C4: a hash function that collides for every block: lookups must still compare tokens.
C4 = CacheScenario(Geometry(8, 2, 1, 2), (("add", 0, (1, 2, 3, 4, 5)), ("add", 1, (1, 2, 6, 6, 5)),
                                          ("add", 2, (7, 7, 3, 4, 5))), constant_hash=True)
# C5: an empty sequence in the middle of a batch.
C5 = Case(Geometry(6, 4, 2, 4), (SeqSpec((0, 1), 5, 1), SeqSpec((), 0, 0), SeqSpec((2, 3), 7, 1)))
# C6: half of a 128-token block used; the other half is NaN.
C6 = Case(Geometry(2, 128, 1, 8), (SeqSpec((1,), 64, 1, 5),), poison="nan")
# C7: GQA groups 6 (12 query heads over 2 kv heads), 3, 5, 7.
C7 = [Case(Geometry(4, 4, 2, 8, num_queries_per_kv=g), (SeqSpec((2, 0), 7, 3),)) for g in (6, 3, 5, 7)]
# C8: three requests, lengths 5, 13, 2, block_size 4.
C8 = Case(Geometry(8, 4, 2, 4, num_queries_per_kv=2), (SeqSpec((6, 1), 5, 2, 3), SeqSpec((0, 4, 2, 7), 13, 1, 12),
                                                       SeqSpec((5,), 2, 2, 1)))
# F: the optional attention features (docs/contract.md). A window of 5 over block_size 4 (decode at 13, prefill
# of 4 over a prefix); every feature at once on GQA 2 with a window of one block; an fp8 pool, per-head K scales.
F_WINDOW = Case(Geometry(10, 4, 2, 4), (SeqSpec((3, 0, 5, 8), 13, 1, 12), SeqSpec((1, 2, 6, 4), 14, 4, 9)),
                window_left=5)
F_ALL = Case(Geometry(8, 4, 2, 4, num_queries_per_kv=2), (SeqSpec((6, 1), 5, 2, 3), SeqSpec((0, 4, 2, 7), 13, 3, 12)),
             window_left=4, softcap=5.0, alibi=True, sinks=True, seed=2)
F_FP8 = Case(Geometry(8, 4, 2, 4, num_queries_per_kv=2), (SeqSpec((6, 1), 5, 2, 3), SeqSpec((0, 4, 2, 7), 13, 1, 9)),
             kv_cache_dtype="fp8_e4m3", k_scale=(0.0625, 0.5), v_scale=0.03, seed=1)


def invalid_examples(op: str) -> tuple[InvalidCall, ...]:
    """Invalid calls of ``op`` that always run (the suite's ``@example``s): the C9 capacity faults and
    the faults engines have shipped most (ids past the pool, duplicate writes, a decreasing
    ``query_start_loc``, a head count that does not divide)."""
    calls = {
        "gather": (InvalidCall("gather", "block_id_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 5),))),
                   InvalidCall("gather", "block_id_negative", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 5),))),
                   InvalidCall("gather", "table_too_short", Case(Geometry(4, 4), (SeqSpec((2, 0), 8),)))),
        "scatter": (InvalidCall("scatter", "block_id_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 6, 1, 0),))),
                    InvalidCall("scatter", "duplicate_block", Case(Geometry(3, 2), (SeqSpec((0, 1, 2), 6, 1, 1),))),
                    InvalidCall("scatter", "table_too_short", Case(Geometry(4, 4), (SeqSpec((2, 0), 8, 1, 6),)))),
        "write_kv": (InvalidCall("write_kv", "slot_too_large", Case(Geometry(3, 2), (SeqSpec((0, 1), 4, 1, 0),))),
                     InvalidCall("write_kv", "duplicate_slot", Case(Geometry(3, 2), (SeqSpec((0, 1), 4, 1, 0),)))),
        "paged_attention": (
            InvalidCall("paged_attention", "query_start_loc_decreasing",
                        Case(Geometry(4, 2), (SeqSpec((0,), 2, 1), SeqSpec((1, 2), 3, 2)))),
            InvalidCall("paged_attention", "q_len_exceeds_seq_len", Case(Geometry(4, 2), (SeqSpec((0, 1), 3, 3),))),
            InvalidCall("paged_attention", "heads_not_divisible",
                        Case(Geometry(4, 2, num_kv_heads=2, num_queries_per_kv=3), (SeqSpec((0,), 2, 1),)))),
    }
    return calls[op]
