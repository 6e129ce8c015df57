"""Triton's interpreter as pagedkv runs it (:func:`pagedkv.backends.interpreter.wrap_interpreted_launches`):
every interpreted launch starts on a fresh CPython data-stack chunk, patches ``triton.language`` once
per function it calls and forms no integer overflow check whose assert never runs, and the launch still
computes the same thing."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backends import interpreter

pytestmark = pytest.mark.skipif(not interpreter.choose_interpreter(), reason="Triton compiles kernels here (a GPU)")

if interpreter.interpreting():
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x):
        return x + 1

    @triton.jit
    def _add_n(out_ptr, N: tl.constexpr):
        """``out[:4] = N`` by ``N`` calls of a ``@triton.jit`` helper (``tl.sum`` and ``tl.maximum`` are
        ``@triton.jit`` functions of Triton's own)."""
        x = tl.zeros((4,), tl.float32)
        for _ in range(N):
            x = _add_one(x)
        tl.store(out_ptr + tl.arange(0, 4), tl.maximum(x, tl.sum(x, axis=0) / 4))

    @triton.jit
    def _int32_sums(out_ptr, base):
        """``out[i] = base + i`` in int32 (wrapping past 2**31 - 1)."""
        i = tl.arange(0, 4)
        tl.store(out_ptr + i, base + i)


def test_interpreted_launches_are_wrapped_once_and_still_compute():
    from triton.runtime.interpreter import GridExecutor

    from pagedkv.backends.triton import kernels  # importing the backend wraps the launches

    assert getattr(GridExecutor.__call__, "_pagedkv_wrapped", False)
    wrapped = GridExecutor.__call__
    assert interpreter.wrap_interpreted_launches() and GridExecutor.__call__ is wrapped  # idempotent
    cache = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)
    table = torch.tensor([1, 0], dtype=torch.int32)
    out = kernels.gather(cache, table, 6)
    torch.testing.assert_close(out, torch.cat([cache[1], cache[0, :2]]), rtol=0, atol=0)


def test_a_launch_patches_triton_language_once_per_function_however_often_it_calls_one(monkeypatch):
    from triton.runtime import interpreter as triton_interpreter

    from pagedkv.backends.triton import kernels  # noqa: F401  (importing the backend wraps the launches)

    patched = []
    set_attr = triton_interpreter._LangPatchScope.set_attr
    monkeypatch.setattr(triton_interpreter._LangPatchScope, "set_attr",
                        lambda self, obj, name, value: patched.append(name) or set_attr(self, obj, name, value))
    counts = {}
    for n in (1, 2, 9):  # the first launch also patches what later launches find patched
        out = torch.empty(4)
        patched.clear()
        _add_n[(2,)](out, n)
        counts[n] = len(patched)
        torch.testing.assert_close(out, torch.full((4,), float(n)), rtol=0, atol=0)
    assert counts[2] == counts[9] > 0, counts


def test_the_reserved_frame_passes_arguments_results_and_errors_through():
    assert interpreter.on_fresh_stack_chunk(lambda a, b=0: a * b, 6, b=7) == 42

    def fails():
        raise KeyError("raised below the reserved frame")

    with pytest.raises(KeyError, match="raised below"):
        interpreter.on_fresh_stack_chunk(fails)


def test_the_reserved_frame_fits_in_no_chunk_but_its_own():
    # 16 KiB chunks hold 2,048 slots; a frame past that opens its own chunk, whatever the caller's depth
    assert interpreter._reserve.__code__.co_nlocals > 2 * 2048


def test_a_candidates_own_interpreted_kernels_are_wrapped_when_it_is_loaded(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "own_kernels.py").write_text(
        "import triton\n\nname = 'own'\n\n\ndef gather(cache, block_table, seq_len):\n    return cache\n")
    probe = ("from pagedkv.backends import load_backend; from triton.runtime.interpreter import GridExecutor; "
             "import sys; flag = lambda: getattr(GridExecutor.__call__, '_pagedkv_wrapped', False); "
             "before = flag(); load_backend('own_kernels'); "
             "print(before, flag(), 'pagedkv.backends.triton.common' in sys.modules)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "False"], done.stdout


def test_overflow_checks_that_assert_nothing_are_not_formed_and_results_stay(monkeypatch):
    import dataclasses

    from triton.runtime import interpreter as triton_interpreter

    from pagedkv.backends.triton import kernels  # noqa: F401  (importing the backend wraps the launches)

    options = triton_interpreter.interpreter_builder.options
    assert options.debug is False and options.sanitize_overflow is False, options
    fast = torch.empty(4, dtype=torch.int32)
    _int32_sums[(1,)](fast, 2**31 - 2)
    monkeypatch.setattr(triton_interpreter.interpreter_builder, "options",
                        dataclasses.replace(options, sanitize_overflow=True))
    checked = torch.empty(4, dtype=torch.int32)
    _int32_sums[(1,)](checked, 2**31 - 2)  # the check formed: debug is off, so it asserts nothing either
    assert torch.equal(fast, checked) and fast.tolist() == [2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1]
