"""A candidate that takes FlashInfer's CSR page metadata is gated like any other: the suite builds
``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len`` from every drawn case, the CSR faults replace
the padded-table faults, and a bug in how the candidate reads the metadata fails with a case file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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


def _suite(tmp_path, module: str, bug: bool):
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(CSR_KERNEL).replace("BUG", str(bug)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PAGEDKV_PROFILE": "dev",
           "PAGEDKV_FAILURE_DIR": str(tmp_path / f"failures-{module}")}
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl",
                           module, "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-k",
                           "paged_attention_matches or csr_page_metadata or paged_attention_rejects or alone_equals"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_csr_candidate_passes_and_one_that_ignores_the_last_page_length_fails(tmp_path):
    good = _suite(tmp_path, "csr_good", bug=False)
    assert good.returncode == 0, good.stdout[-3000:]
    assert "3 properties judged (0 failing)" in good.stdout, good.stdout[-2000:]
    assert "not applicable: the backend takes CSR page tables" in good.stdout + good.stderr or "1 skipped" in \
        good.stdout, good.stdout[-2000:]
    bad = _suite(tmp_path, "csr_bad", bug=True)
    assert bad.returncode == 1, bad.stdout[-3000:]
    files = sorted((tmp_path / "failures-csr_bad").glob("*paged_attention_matches*.json"))
    assert files, bad.stdout[-3000:]
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(files[0]), "--impl", "csr_bad"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=300)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr
