"""Comparison and the tolerance policy: the one place every property, tool and report compares tensors.

Data movement has no rounding, so it is compared on bit patterns (``-0.0 != 0.0``; a NaN matches
only the same NaN). A difference is reported as :class:`Mismatch` with a ``where`` dict that names,
when the caller can say, the sequence, logical position, physical block and slot of the first bad
row, and the expected and actual values there.

**The tolerance policy**: what is compared bit for bit, and what within a tolerance.

Bit for bit (``torch.equal``, NaN never equal):
    all data movement: ``gather``, ``scatter``, ``write_kv`` of every backend, and the frame
    condition (slots outside a write are unchanged). A copy has no rounding, so any difference is
    a bug.

    Attention of the ``loop`` and ``indexed`` backends against each other: both gather the same
    values and call the same attention op, so they must agree exactly.

Within a tolerance (``torch.testing.assert_close``, ``equal_nan=False``):
    attention against the fp64 dense reference, and a fused kernel against the gathering backends.
    Inputs are already in the cache dtype and the reference upcasts those same values, so the
    differences are (a) rounding the output to the dtype and (b) float32 accumulation, whose
    logit error grows with the logits' magnitude and moves softmax weights by that much:

    ========  =========  =========  ==============================================
    dtype     rtol       atol       why
    ========  =========  =========  ==============================================
    float32   2e-5       2e-5       float32 accumulation over short reductions
    float16   2e-3       2e-3       2 ulp of float16 (eps 9.8e-4) on outputs ~ 1
    bfloat16  1.6e-2     1.6e-2     2 ulp of bfloat16 (eps 7.8e-3) on outputs ~ 1
    ========  =========  =========  ==============================================

    plus ``atol += 8 * eps(float32) * max|logit| * max|V|`` for the logit-magnitude term, so large
    queries and keys (softmax-overflow tests) are judged fairly without loosening the normal case.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}



class BudgetSpent(BaseException):
    """Raised inside a search when its time budget is spent (a ``BaseException``: Hypothesis lets it
    through instead of treating it as a failure). Also re-exported by :mod:`pagedkv.testing.execute`."""

class Mismatch(AssertionError):
    """A property failed. ``where`` locates the first bad element when there is one:
    ``{"seq", "position", "block", "slot", "expected", "actual"}`` (any subset)."""

    def __init__(self, message: str, where: dict | None = None):
        super().__init__(message)
        self.where = where or {}


class MissingOp(Exception):
    """The gate cannot judge a property: the backend does not provide an op it needs (raised by
    :func:`require` when the gate looks an op up), or a check's own cannot-run path, with ``reason`` a
    :class:`pagedkv.testing.verdict.SkipReason` value. Raised from inside an op call for an input in the
    declared space it is a failure like any exception (:mod:`pagedkv.testing.verdict`)."""

    def __init__(self, message: str = "", reason: str = "missing_op"):
        super().__init__(message)
        self.reason = reason


#: The bound a declared non-promise puts on the attention comparisons of the property running now
#: (:class:`pagedkv.testing.non_promises.Bound`), or ``None``: the strict bar. Set only by
#: :func:`pagedkv.testing.non_promises.bounded`; data movement and non-finite outputs are never bounded.
ACTIVE_BOUND: ContextVar = ContextVar("pagedkv_active_bound", default=None)


def require(backend: Any, op: str) -> Callable:
    """``backend.<op>`` when callable.

    Raises:
        MissingOp: the backend does not provide ``op``.
    """
    fn = getattr(backend, op, None)
    if not callable(fn):
        name = getattr(backend, "name", None) or type(backend).__name__
        raise MissingOp(f"{name} does not provide {op!r}")
    return fn


def raised_by_gate(exc: BaseException) -> bool:
    """Whether ``exc`` is a :class:`MissingOp` :func:`require` raised looking an op up (not one raised from
    inside an op: its traceback ends in ``require`` and passes through no contract op)."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    ops = {"paged_attention", "paged_attention_csr", "write_kv", "gather", "scatter"}
    return (isinstance(exc, MissingOp) and bool(frames) and frames[-1] is require.__code__
            and not any(code.co_name in ops for code in frames))


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of ``x`` as an integer tensor of the same width (NaN payloads included)."""
    return x.contiguous().view(_SAME_WIDTH_INT[x.element_size()])


def rerun_scale(*tensors: torch.Tensor) -> float:
    """The magnitude a nondeterministic rerun's error is measured against: the largest finite ``|x|`` of
    ``tensors`` (the values an output sums, e.g. V, and the outputs themselves); at least the dtype-free
    ``1e-30`` so an all-zero call has a positive scale."""
    scale = 1e-30
    for t in tensors:
        if t is not None and t.is_floating_point() and t.numel():
            x = t.detach().double().abs()
            x = x[torch.isfinite(x)]
            if x.numel():
                scale = max(scale, float(x.max()))
    return scale


def rerun_differs(a: torch.Tensor, b: torch.Tensor, ulps: int, scale: float) -> torch.Tensor:
    """Where two runs of one call, nondeterministic by design within ``ulps``, differ beyond it: a bool
    tensor of ``a``'s shape.

    A non-finite value (NaN, +-inf) must be the same in both (NaN where the other has NaN). A finite value
    may move by ``ulps`` ulps *of the scale*, ``ulps * eps(dtype) * 2**floor(log2(scale))`` with ``scale``
    from :func:`rerun_scale`: a reordered sum's rounding error is a few ulps of the terms summed, not of
    the result; near zero (cancellation) a per-element ulp count is meaningless. ``ulps`` 0: bit for bit.
    """
    if ulps <= 0 or not a.is_floating_point():
        return bits(a) != bits(b)
    x, y = a.detach().double(), b.detach().double()
    finite = torch.isfinite(x) & torch.isfinite(y)
    step = torch.finfo(a.dtype).eps * 2.0 ** torch.floor(torch.log2(torch.tensor(scale, dtype=torch.float64)))
    far = finite & ((x - y).abs() > ulps * float(step))
    nonfinite_differs = ~finite & ~((x == y) | (x.isnan() & y.isnan()))
    return far | nonfinite_differs


def first_difference(actual: torch.Tensor, expected: torch.Tensor, row_dims: int = 1) -> tuple[int, ...] | None:
    """Index (over the first ``row_dims`` dims) of the first row whose bit pattern differs, or ``None``.

    Args:
        actual, expected: tensors of equal shape and dtype (any device: compared on the CPU).
        row_dims: how many leading dims index a row (1 for ``[seq_len, H, D]``, 2 for a pool
            ``[num_blocks, block_size, H, D]``).
    """
    a, e = bits(actual.cpu()), bits(expected.cpu())
    bad = (a != e).flatten(row_dims).any(-1) if a.dim() > row_dims else a != e
    hits = bad.nonzero()
    return tuple(int(x) for x in hits[0]) if hits.numel() else None


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str, *, row_dims: int = 1,
                     locate: Callable[[tuple[int, ...]], dict] | None = None) -> None:
    """Raise :class:`Mismatch` unless ``actual`` and ``expected`` are identical bit for bit.

    Args:
        actual, expected: tensors to compare (shape and dtype must match too).
        what: what is compared, first words of the message (``"gather of sequence 0"``).
        row_dims: leading dims that index a row (see :func:`first_difference`).
        locate: maps the first bad row's index to ``{"seq", "position", "block", "slot"}`` for the
            report; without it the index is reported.

    Raises:
        Mismatch: with ``where`` holding the location and the first values of both rows.
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise Mismatch(f"{what}: got {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} "
                       f"{expected.dtype}")
    index = first_difference(actual, expected, row_dims)
    if index is None:
        return
    where = dict(locate(index)) if locate else {"index": list(index)}
    where.update(expected=expected[index].flatten()[:4].tolist(), actual=actual[index].flatten()[:4].tolist())
    count = int((bits(actual.cpu()) != bits(expected.cpu())).flatten(row_dims).any(-1).sum()) \
        if actual.dim() > row_dims else 1
    place = ", ".join(f"{k} {where[k]}" for k in ("seq", "position", "block", "slot") if k in where) \
        or f"index {list(index)}"
    raise Mismatch(f"{what} differs at {place}: got {where['actual']}..., expected {where['expected']}... "
                   f"({count} row{'s' if count != 1 else ''} differ)", where)


def show_value(x: torch.Tensor, index) -> str:
    """``x[index]`` for a message: the value, and its bit pattern in hex when it is NaN."""
    value = x[tuple(index)]
    text = repr(value.item())
    if torch.isnan(value.float()):
        width = value.element_size() * 2
        text += f" (bits 0x{int(bits(value.reshape(1).cpu())[0]) & ((1 << (4 * width)) - 1):0{width}x})"
    return text


ATTENTION_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
_EPS32 = torch.finfo(torch.float32).eps


def attention_tolerance(dtype: torch.dtype, max_abs_logit: float = 0.0,
                        max_abs_value: float = 1.0) -> tuple[float, float]:
    """``(rtol, atol)`` for attention outputs in ``dtype`` (see the module docstring for the policy)."""
    rtol, atol = ATTENTION_TOLERANCE[dtype]
    return rtol, atol + 8 * _EPS32 * max_abs_logit * max(max_abs_value, 1.0)


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, *, max_abs_logit: float = 0.0,
                           max_abs_value: float = 1.0, msg: str = "") -> None:
    """Assert an attention output matches ``expected`` under the policy for ``actual.dtype``.

    ``expected`` may be float64 (the reference); it is compared in float64. NaN or inf in
    ``actual`` always fails.

    Raises:
        AssertionError: with ``torch.testing``'s report (greatest differences and where), prefixed by ``msg``.
    """
    rtol, atol = attention_tolerance(actual.dtype, max_abs_logit, max_abs_value)
    if not torch.isfinite(actual).all():
        bad = torch.nonzero(~torch.isfinite(actual))[0].tolist()
        raise AssertionError(f"{msg}non-finite attention output at index {bad}: {actual[tuple(bad)].item()}")
    try:
        torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=False,
                                   msg=lambda m: f"{msg}{m}")
    except AssertionError:
        bound = ACTIVE_BOUND.get()
        if bound is None or not bound.widens_tolerance:
            raise
        bound.judge(actual, expected, rtol, atol, msg)


def assert_attention_identical(actual: torch.Tensor, expected: torch.Tensor, msg: str = "", *,
                               max_abs_logit: float = 0.0, max_abs_value: float = 1.0) -> None:
    """Assert two attention outputs of the same backend are identical bit for bit (an invariance).

    Under a declared "not bit-identical" non-promise (:data:`ACTIVE_BOUND`) a difference is judged
    against its bound instead: within it the property's finding is noted, beyond it (or any non-finite
    output where ``expected`` is finite) it fails.

    Args:
        actual, expected: ``[tokens, num_heads, head_dim]`` outputs of one dtype (any device).
        msg: the message's first words.
        max_abs_logit, max_abs_value: the case's magnitudes, for the tolerance of a bound.

    Raises:
        Mismatch: the outputs differ (beyond the bound, when one is declared).
    """
    try:
        assert_bitwise_equal(actual, expected, msg)
    except Mismatch:
        bound = ACTIVE_BOUND.get()
        if bound is None or not bound.allows_bit_differences or actual.shape != expected.shape:
            raise
        a, e = actual.cpu(), expected.cpu()
        if not bool((torch.isfinite(a) | ~torch.isfinite(e)).all()):
            raise
        finite = torch.isfinite(e)
        if not torch.equal(bits(a[~finite]), bits(e[~finite])):
            raise
        rtol, atol = attention_tolerance(a.dtype, max_abs_logit, max_abs_value)
        bound.judge(a[finite], e[finite], rtol, atol, msg)


def target_attention_error(actual: torch.Tensor, expected: torch.Tensor, *, max_abs_logit: float = 0.0,
                           max_abs_value: float = 1.0) -> None:
    """Inside a Hypothesis search, ``hypothesis.target`` the worst element's error as a fraction of the
    tolerance :func:`assert_attention_close` allows (``1.0`` is the limit), so the search climbs toward
    inputs where an output drifts (a fault that shifts a result by a little, a case near its limit).
    Outside a search (a fixed case, a replay without Hypothesis) it does nothing.

    Args:
        actual: ``[tokens, heads, head_dim]`` output that passed; ``expected``: the reference (float64).
    """
    try:
        from hypothesis import currently_in_test_context, target
    except ImportError:  # replays run without Hypothesis
        return
    if not currently_in_test_context() or actual.numel() == 0:
        return
    rtol, atol = attention_tolerance(actual.dtype, max_abs_logit, max_abs_value)
    e = expected.double()
    ratio = ((actual.double() - e).abs() / (atol + rtol * e.abs())).max()
    target(float(ratio), label="attention error / tolerance")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Assert two tensors are identical bit for bit: same shape, dtype and bit pattern everywhere.

    Comparing bit patterns (not values) means ``-0.0 != 0.0`` and a NaN matches only the same NaN,
    so poison that should be untouched is checked exactly and a NaN cannot stand in for a value.

    Raises:
        Mismatch: naming the first differing index and both values (with their bit patterns when a
            value is NaN: two different NaNs would otherwise read alike).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise Mismatch(f"{msg}shape/dtype differ: {tuple(actual.shape)} {actual.dtype} vs "
                             f"{tuple(expected.shape)} {expected.dtype}")
    a, e = bits(actual.cpu()), bits(expected.cpu())
    if not torch.equal(a, e):
        diff = a != e
        idx = torch.nonzero(diff)[0].tolist()
        raise Mismatch(f"{msg}first mismatch at index {idx}: got {show_value(actual, idx)}, "
                       f"expected {show_value(expected, idx)} ({int(diff.sum())} of {diff.numel()} elements differ)")
