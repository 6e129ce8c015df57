"""Names that moved: the old import path keeps working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable


def moved(old: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for module ``old`` resolving each of ``names`` (name -> its module now) with a
    ``DeprecationWarning`` that names the new place (:mod:`pagedkv.adapter` when the name is there)."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        adapter = importlib.import_module("pagedkv.adapter")
        where = "pagedkv.adapter" if name in adapter.__all__ else names[name]
        warnings.warn(f"{old}.{name} moved: import it from {where} (the old path goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(names[name]), name)

    return __getattr__
