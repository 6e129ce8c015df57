"""Triton's interpreter as pagedkv runs it: every interpreted launch starts on a fresh CPython data-stack
chunk (:func:`pagedkv.backends.interpreter.launch_on_fresh_stack_chunks`), and the launch still computes
the same thing."""

from __future__ import annotations

import pytest
import torch

from pagedkv.backends import interpreter

pytestmark = pytest.mark.skipif(not interpreter.choose_interpreter(), reason="Triton compiles kernels here (a GPU)")


def test_interpreted_launches_are_wrapped_once_and_still_compute():
    from triton.runtime.interpreter import GridExecutor

    from pagedkv.backends.triton import kernels  # importing the backend wraps the launches

    assert getattr(GridExecutor.__call__, "_pagedkv_fresh_chunk", False)
    wrapped = GridExecutor.__call__
    assert interpreter.launch_on_fresh_stack_chunks() and GridExecutor.__call__ is wrapped  # idempotent
    cache = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)
    table = torch.tensor([1, 0], dtype=torch.int32)
    out = kernels.gather(cache, table, 6)
    torch.testing.assert_close(out, torch.cat([cache[1], cache[0, :2]]), rtol=0, atol=0)


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
             "import sys; flag = lambda: getattr(GridExecutor.__call__, '_pagedkv_fresh_chunk', False); "
             "before = flag(); load_backend('own_kernels'); "
             "print(before, flag(), 'pagedkv.backends.triton.common' in sys.modules)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "False"], done.stdout
