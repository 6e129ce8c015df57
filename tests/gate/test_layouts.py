"""A backend declares its pool layout: the suite builds head-major pools for ``layout="HND"``, hands
the backend their contiguous HND tensors, and compares in logical positions; a layout declared as
mapping functions (:class:`pagedkv.layouts.PoolLayout`, a view or a copy pair, per pool) the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes
from pagedkv.layouts import PoolLayout

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


@pytest.fixture
def suite(pytester, write_candidate, monkeypatch):
    """``suite(spec, *selected) -> RunResult``: the named properties over ``head_major`` under ``dev``."""
    write_candidate("head_major", HEAD_MAJOR)
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    monkeypatch.setenv("PAGEDKV_PROFILE", "dev")

    def run(spec, *select):
        return pytester.runpytest_subprocess("--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-p",
                                             "no:cacheprovider", "-p", "no:xdist", "-q", "-k", " or ".join(select),
                                             timeout=600)

    return run


def test_the_cache_allocates_head_major_memory_under_nhd_shaped_pools():
    cache = PagedKVCache(CacheConfig(4, 16, 2, 8, kv_layout="HND"))
    k = cache.k_cache()
    assert k.shape == (4, 16, 2, 8) and not k.is_contiguous()
    assert k.permute(0, 2, 1, 3).is_contiguous()


def test_a_head_major_backend_passes_and_a_layout_bug_fails_with_a_case_file(suite, pytester):
    select = ("gather_returns", "write_kv_lands", "paged_attention_matches", "live_sequence")
    good = suite("head_major:backend", *select)
    assert good.ret == 0, str(good.stdout)[-3000:]
    assert "4 properties judged (0 failing)" in str(good.stdout), str(good.stdout)[-2000:]
    bad = suite("head_major:wrong", "gather_returns")
    assert bad.ret == 1, str(bad.stdout)[-3000:]
    assert "pools: HND, the layout the candidate declares" in str(bad.stdout), str(bad.stdout)[-2000:]
    files = sorted((pytester.path / "failures").glob("*.json"))
    assert files, str(bad.stdout)[-2000:]
    replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(files[0]), "--impl", "head_major:wrong"],
                            env=os.environ, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr


# -- layouts declared as mapping functions ------------------------------------------------------------
def _keys_transposed_storage(shape, dtype, device):
    nb, bs, h, d = shape  # per block and kv head, keys [head_dim, block_size] (vLLM's CPU key cache)
    return torch.empty((nb, h, d, bs), dtype=dtype, device=device)


def _keys_transposed_logical(storage):
    return storage.permute(0, 3, 1, 2)


def _slots_reversed(t):  # no strided view reverses a dim: a copy pair, its own inverse
    return t.flip(1)


KEYS = PoolLayout("keys_transposed", allocate=_keys_transposed_storage, logical=_keys_transposed_logical)
VALUES = PoolLayout("values_slots_reversed", to_storage=_slots_reversed, to_logical=_slots_reversed)


class MappedLayouts:
    """indexed's ops on its own storage: keys transposed per block (a view), values with each block's slots
    reversed (a copy pair). Records the storage each op is handed."""

    name = "mapped_layouts"
    capabilities = Capabilities(layout=(KEYS, VALUES), block_sizes=Sizes(max=8), head_dims=Sizes(max=8))

    def __init__(self):
        self.handed = []

    def _keys(self, storage):
        assert storage.dim() != 4 or storage.shape[-1] == storage.shape[-3] or storage.stride(-1) == 1
        return _keys_transposed_logical(storage) if storage.dim() == 4 else storage

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        self.handed.append((k_cache, v_cache))
        values = _slots_reversed(v_cache) if v_cache.dim() == 4 else v_cache
        indexed.write_kv(self._keys(k_cache), values, key, value, slot_mapping)
        if v_cache.dim() == 4:
            v_cache.copy_(_slots_reversed(values))

    def gather(self, cache, block_table, seq_len):
        return indexed.gather(self._keys(cache), block_table, seq_len)

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        self.handed.append((k_cache, v_cache))
        values = _slots_reversed(v_cache) if v_cache.dim() == 4 else v_cache
        return indexed.paged_attention(query, self._keys(k_cache), values, block_tables, seq_lens, query_start_loc,
                                       scale)


class ValuesUnreversed(MappedLayouts):
    """Declares the reversed values but attends over them as if they were NHD (a layout bug)."""

    name = "values_unreversed"

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        return indexed.paged_attention(query, self._keys(k_cache), v_cache, block_tables, seq_lens, query_start_loc,
                                       scale)


def test_a_layout_declared_as_a_view_hands_its_storage_and_a_copy_pair_converts():
    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
    from pagedkv.testing.cases.memory import pool_layout
    from pagedkv.testing.space import as_declared_layout

    backend = MappedLayouts()
    case = Case(Geometry(num_blocks=3, block_size=4, num_kv_heads=2, head_dim=3), (SeqSpec((2, 0), 6, 2),))
    with pool_layout(backend.capabilities.layout):
        k_cache, v_cache = case.empty_caches()
        key, value = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
        as_declared_layout(backend).write_kv(k_cache, v_cache, key, value, torch.tensor([1, 9]))
    (k_storage, v_storage), = backend.handed
    assert k_storage.shape == (3, 2, 3, 4) and k_storage.data_ptr() == k_cache.data_ptr()  # no copy
    assert v_storage.data_ptr() != v_cache.data_ptr() and torch.equal(v_storage[2, 2], value[1])  # converted
    for pool, rows in ((k_cache, key), (v_cache, value)):  # both land at their logical slots
        assert torch.equal(pool[0, 1], rows[0]) and torch.equal(pool[2, 1], rows[1])
        assert torch.isnan(pool[1]).all() and torch.isnan(pool[0, 0]).all()  # the rest still poison


@pytest.mark.parametrize("name", ["write_kv_lands_at_slot_mapping_and_skips_negative_slots",
                                  "paged_attention_matches_fp64_dense_reference",
                                  "gather_returns_exactly_what_each_slot_holds",
                                  "outputs_are_bit_identical_under_layout",
                                  "outputs_are_bit_identical_under_poison",
                                  "write_kv_is_exact_past_2_24_slots_at_a_declared_geometry"])
def test_mapped_layouts_pass_the_properties(name):
    from pagedkv.tools.mutants.kill_table import case_summary, run_property
    from pagedkv.testing.registry import properties

    outcome = run_property(MappedLayouts(), properties()[name], "dev", shrink=False)
    assert outcome.status == "passed", \
        f"{name}: {outcome.first_line} on {case_summary(outcome)}"


def test_a_layout_bug_behind_a_copy_pair_fails():
    from pagedkv.tools.mutants.kill_table import run_property
    from pagedkv.testing.registry import properties

    outcome = run_property(ValuesUnreversed(), properties()["paged_attention_matches_fp64_dense_reference"],
                           "dev", shrink=False)
    assert outcome.failed, outcome.first_line


def test_a_layout_must_be_declared_in_one_whole_form():
    with pytest.raises(ValueError, match="exactly one"):
        PoolLayout("half", allocate=_keys_transposed_storage)
    with pytest.raises(ValueError, match="exactly one"):
        PoolLayout("both", allocate=_keys_transposed_storage, logical=_keys_transposed_logical,
                   to_storage=_slots_reversed, to_logical=_slots_reversed)
    with pytest.raises(ValueError, match="Capabilities.layout"):
        Capabilities(layout="NDH")
    assert Capabilities(layout=(KEYS, VALUES)).pool_layouts == (KEYS, VALUES)
    assert "keys keys_transposed, values values_slots_reversed" in Capabilities(layout=(KEYS, VALUES)).summary()
