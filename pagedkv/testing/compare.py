"""Bit-for-bit comparison, located: the one routine every property, tool and report uses.

Data movement has no rounding, so it is compared on bit patterns (``-0.0 != 0.0``; a NaN matches
only the same NaN). A difference is reported as :class:`Mismatch` with a ``where`` dict that names,
when the caller can say, the sequence, logical position, physical block and slot of the first bad
row, and the expected and actual values there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Mismatch(AssertionError):
    """A property failed. ``where`` locates the first bad element when there is one:
    ``{"seq", "position", "block", "slot", "expected", "actual"}`` (any subset)."""

    def __init__(self, message: str, where: dict | None = None):
        super().__init__(message)
        self.where = where or {}


class MissingOp(Exception):
    """The backend under test does not provide an op a property needs (the property is skipped)."""


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


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of ``x`` as an integer tensor of the same width (NaN payloads included)."""
    return x.contiguous().view(_SAME_WIDTH_INT[x.element_size()])


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
