"""A backend declares its pool layout: the suite builds head-major pools for ``layout="HND"``, hands
the backend their contiguous HND tensors, and compares in logical positions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pagedkv import CacheConfig, PagedKVCache

HEAD_MAJOR = '''
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes


def _nhd(pool):  # the kernel's own view of its head-major memory
    return pool.permute(0, 2, 1, 3) if pool.dim() == 4 else pool


class HeadMajor:
    name = "head_major"
    capabilities = Capabilities(layout="HND", block_sizes=Sizes(max=8), head_dims=Sizes(max=8))

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        assert k_cache.dim() != 4 or k_cache.shape[1] == key.shape[1], "expects [blocks, kv heads, slots, dim]"
        return indexed.write_kv(_nhd(k_cache), _nhd(v_cache), key, value, slot_mapping)

    def gather(self, cache, block_table, seq_len):
        return indexed.gather(_nhd(cache), block_table, seq_len)

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        return indexed.paged_attention(query, _nhd(k_cache), _nhd(v_cache), block_tables, seq_lens,
                                       query_start_loc, scale)


class ReadsAsNHD(HeadMajor):
    """Declares HND but reads its memory as if it were NHD (a layout bug)."""
    name = "reads_as_nhd"

    def gather(self, cache, block_table, seq_len):
        nb, h, bs, d = cache.shape
        return indexed.gather(cache.reshape(nb, bs, h, d), block_table, seq_len)


backend, wrong = HeadMajor(), ReadsAsNHD()
'''


def _suite(tmp_path, spec, *select):
    (tmp_path / "head_major.py").write_text(textwrap.dedent(HEAD_MAJOR))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PAGEDKV_FAILURE_DIR": str(tmp_path / "failures"),
           "PAGEDKV_PROFILE": "dev"}
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec,
                           "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-k", " or ".join(select)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_the_cache_allocates_head_major_memory_under_nhd_shaped_pools():
    cache = PagedKVCache(CacheConfig(4, 16, 2, 8, kv_layout="HND"))
    k = cache.k_cache()
    assert k.shape == (4, 16, 2, 8) and not k.is_contiguous()
    assert k.permute(0, 2, 1, 3).is_contiguous()


def test_a_head_major_backend_passes_and_a_layout_bug_fails_with_a_case_file(tmp_path):
    select = ("gather_returns", "write_kv_lands", "paged_attention_matches", "live_sequence")
    good = _suite(tmp_path, "head_major:backend", *select)
    assert good.returncode == 0, good.stdout[-3000:]
    assert "4 properties judged (0 failing)" in good.stdout, good.stdout[-2000:]
    bad = _suite(tmp_path, "head_major:wrong", "gather_returns")
    assert bad.returncode == 1, bad.stdout[-3000:]
    files = sorted((tmp_path / "failures").glob("*.json"))
    assert files, bad.stdout[-2000:]
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(files[0]), "--impl", "head_major:wrong"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=300)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr
