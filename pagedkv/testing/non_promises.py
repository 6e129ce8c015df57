"""Declared non-promises and their bounds: what a backend does not promise exactly, and what it still keeps.

A real kernel may not promise a property exactly: vLLM's ``unified_attention`` outside its
batch-invariant mode differs by an ulp between a request alone and the same request in a batch; a
kernel computing tanh another way is a few ulps off under a huge soft-cap. It says so on its
capabilities, with the bound the difference stays within::

    from pagedkv.adapter import Capabilities, NonPromise

    Capabilities(non_promises={
        "a_request_alone_equals_the_same_request_in_a_batch":
            NonPromise("not batch invariant: the split heuristic depends on the batch"),
        "a_huge_softcap_equals_no_softcap": NonPromise("tanh as 2 * sigmoid(2x) - 1", ulps=8),
    })

The property still runs, under its bound. A difference within the bound is a *finding* (``XFAIL``,
with the case file of its first case, the declared reason and bound, counted apart from the judged
properties); beyond the bound the property fails, and so does any exception, guard
``ContractViolation``, non-finite output where the compared value is finite, crash or timeout: a bound
explains an ulp, never a wrong kernel. Only attention outputs are bounded; data movement stays bit
for bit.

Which property takes which bound (:func:`bound_kind`):

- :data:`BIT_IDENTICAL` invariances: "not bit-identical"; ``NonPromise(reason)`` (and the old
  ``{name: "reason"}`` form) means within the attention tolerance of :mod:`pagedkv.testing.compare`;
  ``ulps`` / ``rtol`` / ``atol`` widen it.
- :data:`WITHIN_TOLERANCE` properties: a wider tolerance, which must be given (a bare reason is refused
  with a message saying how to write the bound).
- the fp64 reference property (:data:`REFERENCE`) cannot be waived: a less accurate kernel declares its
  tolerance there, at most :data:`REFERENCE_LIMITS` for each dtype it declares.
- every bound has a ceiling: :data:`OTHER_LIMITS` (twice the reference's) on the other properties;
  ``NonPromise(reason, rtol=1e30)`` is refused when the plugin loads the candidate.
- every other property (data movement, rejection, scenarios, NaN propagation, limits, the state
  machines) takes no non-promise: a declared space (sizes, ``max_pool_bytes``, features) says what a
  backend does not take.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

#: The fp64 reference property: never waived; a tolerance may be declared within :data:`REFERENCE_LIMITS`.
REFERENCE = "paged_attention_matches_fp64_dense_reference"
#: The invariances whose attention outputs a non-promise may let differ bitwise ("not bit-identical").
BIT_IDENTICAL_PREFIX = "outputs_are_bit_identical_under_"
BIT_IDENTICAL = frozenset({"a_request_alone_equals_the_same_request_in_a_batch",
                           "nan_in_blocks_outside_the_window_changes_nothing"})
#: The properties judged within the attention tolerance, which a non-promise may widen.
WITHIN_TOLERANCE = frozenset({
    REFERENCE, "decoding_token_by_token_equals_one_prefill_and_chunked_prefill",
    "a_window_of_at_least_the_context_equals_no_window", "a_huge_softcap_equals_no_softcap",
    "zero_alibi_slopes_equal_no_alibi", "sinks_of_minus_inf_equal_no_sinks",
    "scaling_stored_k_by_c_and_k_scale_by_1_over_c_changes_nothing",
})
#: The widest tolerance (absolute and relative) the fp64 reference property takes, per output dtype:
#: 8 ulps at the 16-bit dtypes (4x the default 2 ulps), and float16's default for float32 (a float32
#: kernel may round like float16 intermediates, never worse: a bfloat16 accumulator is not float32).
REFERENCE_LIMITS = {"float32": 2e-3, "float16": 8 * 2.0**-10, "bfloat16": 8 * 2.0**-7}
#: The widest bound any other property takes, per output dtype: twice the reference's limit. Its outputs
#: are each judged against the fp64 reference within at most :data:`REFERENCE_LIMITS` (the reference
#: property, whatever the kernel declares there), so two of them, one per side of an equality or
#: invariance, differ by at most twice it; a wider bound would let through what the reference refuses.
OTHER_LIMITS = {dtype: 2 * limit for dtype, limit in REFERENCE_LIMITS.items()}
_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def known_properties() -> list[str]:
    """The names a non-promise may use: every registered property (:mod:`pagedkv.testing.registry`)."""
    from pagedkv.testing.registry import properties

    return list(properties())


def bound_kind(prop: str) -> str | None:
    """``"bit_identical"``, ``"tolerance"`` or ``None`` (the property takes no non-promise)."""
    if prop in BIT_IDENTICAL or prop.startswith(BIT_IDENTICAL_PREFIX):
        return "bit_identical"
    return "tolerance" if prop in WITHIN_TOLERANCE else None


def widest(non_promise: Any, dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` a non-promise declares for outputs in ``dtype`` (0 where it names none)."""
    ulps = (non_promise.ulps or 0.0) * _EPS[dtype]
    return max(ulps, non_promise.rtol or 0.0), max(ulps, non_promise.atol or 0.0)


def check_non_promises(caps: Any) -> None:
    """Check every non-promise of ``caps``: a registered property that takes one, with the bound its kind
    needs, within :data:`REFERENCE_LIMITS` on the fp64 reference and :data:`OTHER_LIMITS` elsewhere, for
    every declared dtype.

    Raises:
        ValueError: an unknown name (with the known names), a property that takes no non-promise, a
            bare reason where a tolerance is needed (saying how to write it), a reference tolerance past
            its limit, any other bound past :data:`OTHER_LIMITS` (each message names the property and the
            limit).
    """
    known = known_properties()
    unknown = [name for name, _ in caps.non_promises if name not in known]
    if unknown:
        raise ValueError(f"Capabilities.non_promises: unknown propert{'y' if len(unknown) == 1 else 'ies'} "
                         f"{unknown}; known: {', '.join(known)}")
    for name, declared in caps.non_promises:
        kind = bound_kind(name)
        if kind is None:
            raise ValueError(f"Capabilities.non_promises[{name!r}]: this property takes no non-promise (its "
                             f"failures are wrong data, exceptions or NaN, which no bound explains); declare "
                             f"the space the backend takes instead (sizes, max_pool_bytes, features)")
        if kind == "tolerance" and not declared.widens:
            raise ValueError(f"Capabilities.non_promises[{name!r}]: a property judged within a tolerance needs "
                             f"the bound the backend keeps, e.g. NonPromise({declared.reason!r}, ulps=8) or "
                             f"NonPromise(reason, rtol=1e-3, atol=1e-3)"
                             + ("; the fp64 reference cannot be waived, only given a tolerance" if name == REFERENCE
                                else ""))
        limits, which = (REFERENCE_LIMITS, "the fp64 reference property") if name == REFERENCE else \
            (OTHER_LIMITS, "any property but the reference (twice the reference's limit)")
        for dtype in sorted(caps.dtypes):
            rtol, atol = widest(declared, dtype)
            if max(rtol, atol) > limits[dtype]:
                raise ValueError(f"Capabilities.non_promises[{name!r}]: {declared.describe()} is "
                                 f"{max(rtol, atol):.3g} at {dtype}, past the limit {limits[dtype]:.3g} of "
                                 f"{which}")


class Bound:
    """A non-promise in force while its property runs (:func:`bounded`): widens the attention
    comparisons of :mod:`pagedkv.testing.compare` and notes each difference it lets through."""

    def __init__(self, prop: str, declared: Any):
        self.prop, self.declared = prop, declared
        kind = bound_kind(prop)
        self.allows_bit_differences = kind == "bit_identical"
        self.widens_tolerance = kind == "tolerance" or (kind == "bit_identical" and declared.widens)
        self.seen: list[str] = []  # one line per difference within the bound, in order

    def describe(self) -> str:
        return ("not bit-identical, " if self.allows_bit_differences else "") + self.declared.describe()

    def judge(self, actual: Any, expected: Any, rtol: float, atol: float, msg: str = "") -> None:
        """``actual`` differs from ``expected`` at the strict bar ``(rtol, atol)``: note it when within the
        bound, else raise.

        Raises:
            Mismatch: beyond the bound, or a non-finite value where ``expected`` is finite.
        """
        import torch

        from pagedkv.testing.compare import Mismatch

        a, e = actual.double().cpu(), expected.double().cpu()
        if not bool((torch.isfinite(a) | ~torch.isfinite(e)).all()):
            raise Mismatch(f"{msg}non-finite output where the compared value is finite (a declared non-promise "
                           f"of {self.prop} never covers it)")
        dtype = str(actual.dtype).removeprefix("torch.")
        wider = widest(self.declared, dtype) if dtype in _EPS else (0.0, 0.0)
        rtol, atol = max(rtol, wider[0]), max(atol, wider[1])
        finite = torch.isfinite(e)
        err = (a[finite] - e[finite]).abs()
        allowed = atol + rtol * e[finite].abs()
        worst = float((err / allowed).max()) if err.numel() else 0.0
        if worst > 1.0 or math.isnan(worst):
            raise Mismatch(f"{msg}beyond the declared non-promise bound ({self.describe()}): the worst element "
                           f"is {worst:.3g} times the bound (max abs error {float(err.max()):.3g})")
        self.seen.append(f"{msg}differs within the declared bound ({self.describe()}): max abs error "
                         f"{float(err.max()):.3g}, {worst:.2g} of the bound")


@contextlib.contextmanager
def bounded(bound: Bound | None) -> Iterator[Bound | None]:
    """Run the block with ``bound`` in force on the attention comparisons (``None``: the strict bar)."""
    from pagedkv.testing.compare import ACTIVE_BOUND

    token = ACTIVE_BOUND.set(bound)
    try:
        yield bound
    finally:
        ACTIVE_BOUND.reset(token)


def bound_for(caps: Any, prop: str) -> Bound | None:
    """The :class:`Bound` of ``prop`` on a candidate declaring ``caps``, or ``None`` (promised)."""
    declared = caps.non_promise(prop) if caps is not None else None
    return Bound(prop, declared) if declared is not None else None


def finding_reason(declared: Any, outcome: Any) -> str:
    """The ``xfail`` reason of a finding on a non-promised property: the declared reason and bound, the
    difference's first line and the replay command of its case file."""
    finding = outcome.findings[0]
    return (f"finding (declared non-promise: {declared.reason}; {declared.describe()}): {finding.first_line}"
            + (f"; replay: {finding.replay}" if finding.replay else ""))
