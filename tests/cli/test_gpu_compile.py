"""Every Triton kernel compiles for sm_80 and sm_90 without a GPU, spills no register and fits in shared
memory (:mod:`bench.compile_report`). CI compiles a subset (under 2 minutes on 2 cores); the
``nightly`` profile (``PAGEDKV_PROFILE=nightly``) compiles the whole matrix. Select with ``-m gpu_compile``."""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = pytest.mark.gpu_compile

triton = pytest.importorskip("triton")

from bench import compile_report  # noqa: E402


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return all(shutil.which(get_ptxas(a).path) or os.path.exists(get_ptxas(a).path) for a in (80, 90))
    except Exception:
        return False


@pytest.fixture(scope="module")
def rows():
    if not _ptxas_available():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    level = "full" if os.environ.get("PAGEDKV_PROFILE") == "nightly" else "ci"
    return compile_report.run(compile_report.matrix(level), (80, 90))


def _show(bad) -> str:
    return "\n" + compile_report.format_table(bad)


def test_every_kernel_compiles(rows):
    failed = [r for r in rows if r.error]
    assert not failed, _show(failed)
    kernels = {r.kernel for r in rows}
    assert {"_paged_attention_kernel", "_merge_splits_kernel", "_gather_kernel", "_scatter_kernel",
            "_write_kv_kernel"} <= kernels, kernels


def test_no_configuration_spills_registers(rows):
    spills = [r for r in rows if r.spills]
    assert not spills, _show(spills)


def test_shared_memory_within_the_target_limit(rows):
    over = [r for r in rows if not r.smem_ok]
    assert not over, _show(over)
    assert all(0 < r.registers <= 255 and r.occupancy > 0 for r in rows if not r.error)


def test_ptxas_log_and_occupancy_arithmetic():
    log = ("ptxas info    : Function properties for k\n    96 bytes stack frame, 100 bytes spill stores, 96 bytes "
           "spill loads\nptxas info    : Used 255 registers, used 1 barriers, 96 bytes cumulative stack size")
    assert compile_report.parse_ptxas(log) == dict(registers=255, spill_stores=100, spill_loads=96, stack=96)
    a100 = compile_report.ARCHS[80]
    assert compile_report.occupancy(a100, 32, 0, 4) == 1.0  # 16 blocks x 4 warps = 64 warps
    assert compile_report.occupancy(a100, 255, 0, 8) == 0.125  # 256 registers x 256 threads: 1 block of 8 warps
    assert compile_report.occupancy(a100, 64, 100 * 1024, 4) == 0.062  # shared memory: 1 block (rounded)
    assert compile_report.summary([]) == "compile report: 0 configurations, 0 with spills, 0 failed"
