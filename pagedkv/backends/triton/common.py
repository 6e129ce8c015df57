"""What every Triton kernel module of the ``triton`` backend shares: the interpreter switch, the
runnable check, fp8 byte views and the ``@triton.jit`` math helpers (tanh, fp8 <-> float32).

Without a CUDA device the kernels run on the CPU in Triton's interpreter: importing this module makes
the choice (:func:`pagedkv.backends.interpreter.choose_interpreter`) before ``triton`` is imported,
since Triton reads ``TRITON_INTERPRET`` when a kernel is decorated.
"""

from __future__ import annotations

import os

import torch

from pagedkv.backends.interpreter import choose_interpreter, wrap_interpreted_launches

choose_interpreter()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

wrap_interpreted_launches()

LOG2E = 1.4426950408889634
from pagedkv.validation.arguments import FP8_DTYPES  # noqa: E402  (one source: the fp8 pool dtypes)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as a ``uint8`` view (same bytes, same strides); any other tensor as is."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


@triton.jit
def _tanh(x):
    """float32 tanh from ``exp`` alone (Triton's interpreter has no libdevice): Cephes ``tanhf``.

    ``|x| < 0.625``: odd minimax polynomial (no cancellation near 0, so a huge soft-cap stays exact);
    else ``(1 - t) / (1 + t)`` with ``t = exp(-2|x|)`` (never overflows: ``t -> 0`` gives 1). ~2 ulp.
    """
    ax = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def _fp8_to_f32(b, E4: tl.constexpr):
    """fp8 bytes (``uint8``) to their exact float32 values, the same on every target and the interpreter.

    e5m2 is the top byte of a float16. e4m3fn shifted into a float16's exponent/mantissa fields is its
    value / 2**8 (subnormals included); its only NaN code is ``0x7f`` (sign ignored), which a float16
    would read as 480.
    """
    b = b.to(tl.int32)
    if E4:
        h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        x = h.to(tl.float32) * 256.0
        x = tl.where((b & 0x7F) == 0x7F, float("nan"), x)
    else:
        x = (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _f32_to_fp8(y, E4: tl.constexpr):
    """float32 (finite within the format's range, or NaN) to fp8 bytes, round to nearest even.

    Integer arithmetic on the float32 bits, so it is bit for bit torch's cast on every target (Triton's
    interpreter rounds fp8 conversions wrongly across a binade). Normal results rebias the exponent and
    round away ``23 - MAN`` mantissa bits (a carry moves into the exponent, as it must); fp8 subnormals
    shift the full significand further. NaN becomes ``0x7f`` with its sign, as torch does.
    """
    MAN: tl.constexpr = 3 if E4 else 2
    BIAS: tl.constexpr = 7 if E4 else 15
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    e8 = exp - (127 - BIAS)  # the fp8 biased exponent, if normal
    normal = e8 >= 1
    val = tl.where(normal, a - ((127 - BIAS) << 23), (a & 0x7FFFFF) | 0x800000)
    shift = tl.where(normal, 23 - MAN, tl.minimum(24 - MAN - e8, 31))
    q = val >> shift
    rem = val - (q << shift)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    q = tl.where(exp == 0, 0, q)  # zero and float32 subnormals: far below half the smallest fp8 step
    q = tl.where(a > 0x7F800000, 0x7F, q)
    return (q | sign).to(tl.uint8)


def interpreting() -> bool:
    """True when this module's kernels and Triton's own ``tl.*`` helpers were defined for the interpreter."""
    return all(type(fn).__name__ == "InterpretedFunction" for fn in (_tanh, tl.zeros))


def check_runnable() -> None:
    """Raise unless the kernels can run here: a CUDA device, or Triton's interpreter set up in full.

    Triton decorates its own ``tl.*`` helpers when ``triton`` is first imported, so an import of
    ``triton`` before ``TRITON_INTERPRET=1`` was set leaves them compiled-only and every launch fails.

    Raises:
        BackendUnavailableError: no CUDA device and the interpreter is off or was enabled too late.
    """
    if torch.cuda.is_available() or interpreting():
        return
    from pagedkv.errors import BackendUnavailableError

    raise BackendUnavailableError(
        "backend 'triton' has no CUDA device here and Triton is not in interpreter mode "
        f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} when triton was imported): set "
        "TRITON_INTERPRET=1 before importing triton, or import pagedkv's triton backend before triton")
