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
    assert "page_table csr" in out, out[-2000:]  # the declared space as the terminal prints it
    assert "not applicable: the backend takes CSR page tables" in out + err or "1 skipped" in out, out[-2000:]
    assert not (pytester.path / "failures-csr_good").exists()  # a green run leaves no empty failure directory
    out, _, status = _suite(pytester, write_candidate, monkeypatch, "csr_bad", bug=True)
    assert status == 1, out[-3000:]
    files = sorted((pytester.path / "failures-csr_bad").glob("*paged_attention_matches*.json"))
    assert files, out[-3000:]
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(files[0]), "--impl", "csr_bad"],
                            env=os.environ, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr


#: A user's own CSR kernel, as an engine team writes one: plain PyTorch over head-major (HND) pools with
#: FlashInfer's page metadata, its own argument checks raising the builtin types, nothing of pagedkv imported
#: but the declaration.
USER_CSR_KERNEL = """
import math

import torch

from pagedkv.adapter import Capabilities

name = "users_csr"
capabilities = Capabilities(page_table="csr", layout="HND")


def _check(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages):
    batch = kv_last_page_len.shape[0]
    if kv_indptr.dim() != 1 or kv_indptr.shape[0] != batch + 1:
        raise ValueError(f"kv_indptr must be [batch + 1] = [{batch + 1}], got {tuple(kv_indptr.shape)}")
    ptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    if ptr[0] != 0:
        raise ValueError(f"kv_indptr[0] must be 0, got {ptr[0]}")
    if any(b < a for a, b in zip(ptr, ptr[1:])):
        raise ValueError("kv_indptr must be non-decreasing")
    if ptr[-1] != kv_indices.shape[0]:
        raise ValueError(f"kv_indptr[-1] = {ptr[-1]} but kv_indices has {kv_indices.shape[0]} entries")
    for b in range(batch):
        pages = ptr[b + 1] - ptr[b]
        if (pages == 0 and last[b] != 0) or (pages > 0 and not 1 <= last[b] <= page_size):
            raise ValueError(f"kv_last_page_len[{b}] = {last[b]} is out of range for {pages} pages")
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= num_pages):
        raise IndexError(f"kv_indices holds a page id outside [0, {num_pages})")


def paged_attention(query, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, query_start_loc,
                    scale=None):
    num_pages, num_kv_heads, page_size, head_dim = k_cache.shape  # HND
    _check(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    ptr, last, qsl = kv_indptr.tolist(), kv_last_page_len.tolist(), query_start_loc.tolist()
    for b in range(len(last)):
        pages = kv_indices[ptr[b]:ptr[b + 1]].long()
        seq_len = (len(pages) - 1) * page_size + last[b] if len(pages) else 0
        q = query[qsl[b]:qsl[b + 1]].float()
        if q.shape[0] == 0:
            continue
        k = k_cache[pages].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = v_cache[pages].permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(seq_len - q.shape[0], seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos[:, None], float("-inf"))
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
"""


def test_a_users_plain_pytorch_csr_kernel_raising_value_error_is_green(pytester, write_candidate, monkeypatch):
    # its bad-metadata errors are the builtin ValueError / IndexError naming the argument, as every engine's:
    # the gate judges a third-party kernel on those, not on pagedkv's own ShapeError
    spec = write_candidate("users_csr", USER_CSR_KERNEL).spec
    monkeypatch.setenv("PAGEDKV_PROFILE", "dev")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    result = pytester.runpytest_subprocess(
        "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "-k", "paged_attention_matches_fp64 or csr_page_metadata", timeout=600)
    out = str(result.stdout)
    assert result.ret == 0, out[-3000:]
    assert "2 properties judged (0 failing)" in out, out[-2000:]
