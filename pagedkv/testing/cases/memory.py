"""The memory order of the pools the kit builds: NHD, or head-major (HND) while a backend that
declares ``layout="HND"`` runs (:func:`pagedkv.testing.execute.call` sets it). The pools stay
NHD-shaped either way, so every check and reference reads logical positions."""

from __future__ import annotations

import contextlib
import contextvars

#: The memory order of the pools the kit builds (``"NHD"``; ``"HND"`` while a head-major backend runs).
POOL_LAYOUT: contextvars.ContextVar[str] = contextvars.ContextVar("pagedkv_pool_layout", default="NHD")


@contextlib.contextmanager
def pool_layout(layout: str):
    """Build every pool in ``layout``'s memory order inside the block (the tensors stay NHD-shaped)."""
    token = POOL_LAYOUT.set(layout)
    try:
        yield
    finally:
        POOL_LAYOUT.reset(token)
