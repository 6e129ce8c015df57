"""The one place that decides whether Triton runs in its interpreter.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the choice must be made before anything
imports ``triton``. Without a CUDA device pagedkv runs Triton kernels (its own and a peer's) on the
CPU in the interpreter; a user who set the variable keeps their choice.
"""

from __future__ import annotations

import dataclasses
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


# -- launches on a fresh CPython data-stack chunk ----------------------------------------------------------
# CPython 3.11 and 3.12 keep frames in 16 KiB chunks and free a chunk as soon as the call that opened it
# returns (python/cpython#142183; later releases cache one). Triton's interpreter makes millions of
# calls at one depth per launch; where that depth straddles a chunk boundary, every call maps and unmaps
# a chunk. Under pytest-xdist the suite's Triton properties ran 2.6x slower that way, most of the time in
# mmap/munmap. A frame of 9,000 slots (72 KiB) fits in no chunk but its own (128 KiB), which leaves
# about 59 KiB free below it: room for every call of one launch, wherever the caller's depth lies.
_RESERVED_SLOTS = 9000
_namespace: dict = {}
exec("def _reserve(fn, args, kwargs):\n    " + " = ".join(f"_{i}" for i in range(_RESERVED_SLOTS))
     + " = None\n    return fn(*args, **kwargs)\n", _namespace)
_reserve = _namespace.pop("_reserve")


def on_fresh_stack_chunk(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, called at the start of a fresh CPython data-stack chunk (see above)."""
    return _reserve(fn, args, kwargs)


# -- triton.language patched once per launch -----------------------------------------------------------------
# The interpreter patches ``triton.language`` (about 400 attributes) at every launch and again at every call of
# a ``@triton.jit`` function inside a kernel: a helper of one's own and ``tl.max``, ``tl.sum`` or ``tl.cdiv``
# alike (they are ``@triton.jit`` functions). A call repeated within one launch sets the same attributes to
# the same functions again; it took about a fifth of the suite's interpreted attention time. Within a launch
# each function patches once; every launch still patches afresh and restores as Triton does.
_patched_in_launch: set | None = None


def _patch_once_per_launch(patch_lang, empty_scope):
    def patch(fn):
        if _patched_in_launch is None:
            return patch_lang(fn)
        if fn in _patched_in_launch:
            return empty_scope()
        _patched_in_launch.add(fn)
        return patch_lang(fn)

    patch.__wrapped__ = patch_lang
    return patch


# -- integer overflow checks that assert nothing ---------------------------------------------------------------
# With ``sanitize_overflow`` on (the interpreter's fixed default), every add, sub and mul of 8- to 32-bit ints
# is done a second time in int64 and compared with the type's bounds, and the result goes to a
# ``device_assert`` that returns at once unless ``debug`` is on, which the interpreter's options never turn
# on. The check asserted nothing and was about a third of an interpreted attention launch. Off only while
# ``debug`` is off: with it on (a Triton that lets the interpreter debug), the check asserts and stays.


def _skip_unasserted_overflow_checks(triton_interpreter) -> None:
    builder = getattr(triton_interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False \
            and getattr(options, "sanitize_overflow", False) is True:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def wrap_interpreted_launches() -> bool:
    """Wrap Triton's interpreted launches (pagedkv's kernels and a peer's alike) once: every launch runs on
    a fresh CPython data-stack chunk, and patches ``triton.language`` once per function it calls, and the
    interpreter skips the integer overflow checks whose assert never runs (all above). Call it after
    ``triton`` is imported; it does nothing when Triton compiles kernels, and the patching stays Triton's
    own where its interpreter lacks the internals named above.

    Returns:
        Whether interpreted launches are wrapped.
    """
    if not interpreting():
        return False
    try:
        from triton.runtime import interpreter as triton_interpreter
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return False
    _skip_unasserted_overflow_checks(triton_interpreter)
    launch = GridExecutor.__call__
    if getattr(launch, "_pagedkv_wrapped", False):
        return True

    def __call__(self, *args, **kwargs):
        global _patched_in_launch
        outer, _patched_in_launch = _patched_in_launch, set()
        try:
            return _reserve(launch, (self, *args), kwargs)
        finally:
            _patched_in_launch = outer

    __call__._pagedkv_wrapped = True
    __call__.__wrapped__ = launch
    GridExecutor.__call__ = __call__
    patch_lang = getattr(triton_interpreter, "_patch_lang", None)
    empty_scope = getattr(triton_interpreter, "_LangPatchScope", None)
    if callable(patch_lang) and empty_scope is not None:
        triton_interpreter._patch_lang = _patch_once_per_launch(patch_lang, empty_scope)
    return True
