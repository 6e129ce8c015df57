"""The tolerance policy: what is compared bit for bit, and what within a tolerance.

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

import torch

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
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=False,
                               msg=lambda m: f"{msg}{m}")


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of ``x`` as an integer tensor of the same width (NaN payloads included)."""
    return x.contiguous().view(_SAME_WIDTH_INT[x.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Assert two tensors are identical bit for bit: same shape, dtype and bit pattern everywhere.

    Comparing bit patterns (not values) means ``-0.0 != 0.0`` and a NaN matches only the same NaN,
    so poison that should be untouched is checked exactly and a NaN cannot stand in for a value.

    Raises:
        AssertionError: naming the first differing index and both values.
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{msg}shape/dtype differ: {tuple(actual.shape)} {actual.dtype} vs "
                             f"{tuple(expected.shape)} {expected.dtype}")
    a, e = bits(actual.cpu()), bits(expected.cpu())
    if not torch.equal(a, e):
        diff = a != e
        idx = torch.nonzero(diff)[0].tolist()
        raise AssertionError(f"{msg}first mismatch at index {idx}: got {actual[tuple(idx)].item()!r}, "
                             f"expected {expected[tuple(idx)].item()!r} "
                             f"({int(diff.sum())} of {diff.numel()} elements differ)")
