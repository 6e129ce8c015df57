"""Invalid calls: a valid case with exactly one argument broken, tagged with the error it must raise.

Each :class:`~pagedkv.testing.cases.InvalidCall` starts from a case drawn by :func:`.cases` (or a write-safe
one for ``scatter``/``write_kv``) and plants one fault from
:data:`~pagedkv.testing.cases.invalid_call.FAULTS`: a block id out of range or negative where it is read or
written, a table too short for ``start + n`` or ``seq_len``, negative lengths, a decreasing or inconsistent
``query_start_loc``, ``q_len > seq_len``, head counts that do not divide, dtype/device/rank mismatches,
non-integer or bool tables, an out-of-range or duplicate slot, a NaN scale, ... Only faults the drawn case can
carry are drawn (no filtering), and ``amount`` is biased to 0 (just out of range) and to large values::

    from hypothesis import given
    from pagedkv.testing.strategies import invalid_calls
    from pagedkv.testing.properties.rejection import check_rejected

    @given(invalid_calls())
    def test_rejects(call):
        check_rejected(my_backend, call)
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from pagedkv.testing.cases.invalid_call import OPS, InvalidCall, fault_sites, faults_for, inexpressible

from .batches import cases

_AMOUNTS = st.one_of(st.just(0), st.integers(0, 3), st.sampled_from((2**31 - 1, 2**31, 2**32 + 5)))


@st.composite
def invalid_calls(draw, *, ops=OPS, faults=None, max_seqs: int = 3, max_len: int = 12,
                  max_q_len: int = 4, caps=None) -> InvalidCall:
    """An :class:`InvalidCall` for one of ``ops``; ``faults`` (names) restricts the faults drawn.

    The case is small (``max_seqs`` sequences of at most ``max_len`` tokens); ``scatter`` and
    ``write_kv`` faults use cases whose tables own distinct blocks, so the call would be valid but for
    the planted fault. ``caps`` keeps the valid part inside a backend's declared space.
    """
    op = draw(st.sampled_from(tuple(ops)))
    write = op in ("scatter", "write_kv")
    case = draw(cases(max_seqs=max_seqs, max_len=max_len, max_q_len=max_q_len, repeats=False if write else None,
                      caps=caps, features=False))
    if write and case.layout == "latent":  # a write takes two pools that do not overlap (the contract)
        case = dataclasses.replace(case, layout="contiguous")
    usable = [f.name for f in faults_for(op) if not inexpressible(op, f.name, caps) and fault_sites(op, f.name, case)]
    kinds = [name for name in usable if faults is None or name in faults]
    if not kinds:  # restricted to faults this case cannot carry: fall back to one every case carries
        kinds = usable
    fault = draw(st.sampled_from(kinds))
    seq = draw(st.sampled_from(fault_sites(op, fault, case)))
    amount = draw(_AMOUNTS)
    return InvalidCall(op, fault, case, seq, amount)


__all__ = ["invalid_calls"]
