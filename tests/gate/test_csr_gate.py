"""A candidate that takes FlashInfer's CSR page metadata is gated like any other: the suite builds
``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len`` from every drawn case, the CSR faults replace
the padded-table faults, and a bug in how the candidate reads the metadata fails with a case file."""

from __future__ import annotations

import os
import subprocess
import sys

CSR_KERNEL = """
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities
from pagedkv.csr import check_csr, csr_seq_lens, csr_to_padded

name = "csr_kernel"
capabilities = Capabilities(page_table="csr")
write_kv = indexed.write_kv


def paged_attention(query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc,
                    scale=None):
    check_csr(kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[1], k_cache.shape[0])
    tables, seq_lens = csr_to_padded(kv_indptr, kv_indices, kv_last_page_len, k_cache.shape[1])
    if BUG:  # reads every last page whole: the last page length is ignored
        seq_lens = (kv_indptr[1:] - kv_indptr[:-1]).int() * k_cache.shape[1]
    return indexed.paged_attention(query, k_cache, v_cache, tables, seq_lens, query_start_loc, scale)
"""


def _suite(pytester, write_candidate, monkeypatch, module: str, bug: bool):
    spec = write_candidate(module, CSR_KERNEL.replace("BUG", str(bug))).spec
    monkeypatch.setenv("PAGEDKV_PROFILE", "dev")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / f"failures-{module}"))
    result = pytester.runpytest_subprocess(
        "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "-k", "paged_attention_matches or csr_page_metadata or paged_attention_rejects or alone_equals", timeout=600)
    return str(result.stdout), str(result.stderr), result.ret


def test_a_csr_candidate_passes_and_one_that_ignores_the_last_page_length_fails(pytester, write_candidate,
                                                                              monkeypatch):
    out, err, status = _suite(pytester, write_candidate, monkeypatch, "csr_good", bug=False)
    assert status == 0, out[-3000:]
    assert "3 properties judged (0 failing)" in out, out[-2000:]
    assert "not applicable: the backend takes CSR page tables" in out + err or "1 skipped" in out, out[-2000:]
    out, _, status = _suite(pytester, write_candidate, monkeypatch, "csr_bad", bug=True)
    assert status == 1, out[-3000:]
    files = sorted((pytester.path / "failures-csr_bad").glob("*paged_attention_matches*.json"))
    assert files, out[-3000:]
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(files[0]), "--impl", "csr_bad"],
                            env=os.environ, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr
