"""The one place that decides whether Triton runs in its interpreter.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the choice must be made before anything
imports ``triton``. Without a CUDA device pagedkv runs Triton kernels (its own and a peer's) on the
CPU in the interpreter; a user who set the variable keeps their choice.
"""

from __future__ import annotations

import os


def choose_interpreter(*, on_cpu: bool = False) -> bool:
    """Set ``TRITON_INTERPRET=1`` when torch sees no CUDA device (or ``on_cpu``: the caller runs its
    kernels on CPU tensors on a machine that has one) and the variable is unset.

    Returns:
        Whether Triton will interpret kernels (the variable is ``"1"`` after the call).
    """
    if not on_cpu and "TRITON_INTERPRET" not in os.environ:
        import torch  # only when the answer depends on the machine

        on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return interpreting()


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"
