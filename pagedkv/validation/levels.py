"""The validation levels an op's ``validate`` argument picks, and when the memory-overlap test can run.

Shared by every ``*_args`` function (:mod:`pagedkv.validation.calls`, :mod:`pagedkv.validation.attention_arguments`), so it
sits below them: ``"full"`` reads the metadata on the host, ``"metadata"`` checks shapes, dtypes,
devices and overlap without reading tensor data (no host synchronisation), ``"none"`` checks nothing
(see ``docs/validation.md``).
"""

from __future__ import annotations

import torch

from pagedkv.errors import ArgumentTypeError

#: The validation levels, strictest first.
LEVELS = ("full", "metadata", "none")


def validation_level(validate: object) -> str:
    """An op's ``validate`` argument as a level: ``True`` is ``"full"``, ``False`` is ``"none"``.

    Raises:
        ArgumentTypeError: anything but a bool or one of :data:`LEVELS`.
    """
    if validate is True:
        return "full"
    if validate is False:
        return "none"
    if isinstance(validate, str) and validate in LEVELS:
        return validate
    raise ArgumentTypeError(f"validate must be True, False or one of {list(LEVELS)}, got {validate!r}")


def can_test_overlap() -> bool:
    """Whether the overlap test can run here: not while ``torch.compile`` traces (fake tensors have no
    address); the custom ops run it then, on the real tensors (``WriteArgs.check_overlap``)."""
    return not torch.compiler.is_compiling()
