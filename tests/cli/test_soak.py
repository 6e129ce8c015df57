"""The serving soak: a simulated trace (arrivals with shared prompts, chunked prefill, decode, forks,
finishes, preemption under a small pool) through the real cache and the ``indexed`` backend, with
every live sequence checked against its shadow K/V at intervals, all invariants at the end, and no
block leaked once everything is freed.

The short run is part of every suite run; the long one (10,000 steps) is marked ``slow`` and runs
under ``PAGEDKV_PROFILE=nightly`` (or ``-m slow``). ``python -m pagedkv soak --steps 10000`` runs it
with a progress bar.
"""

from __future__ import annotations

import pytest

from pagedkv.cli import main
from pagedkv.cli.soak import run_soak


def _assert_clean(report: dict) -> None:
    assert report["ok"], report["failure"]
    assert report["leaked_blocks"] == []
    assert report["checks"] >= report["steps"] // 50


def test_short_soak_keeps_every_sequence_intact_and_leaks_nothing():
    report = run_soak(2000, seed=1, check_every=25)
    _assert_clean(report)
    assert report["steps"] == 2000
    # the trace exercised what it claims to: sharing, copy-on-write, eviction and preemption all happened
    assert report["preempted"] > 0 and report["forks"] > 0 and report["finished"] > 0
    assert report["aborted_mid_step"] > 0 and report["preempted_mid_step"] > 0  # between reserve and write
    assert report["stats"]["cow_copies"] > 0 and report["stats"]["evictions"] > 0
    assert report["stats"]["prefix_hit_rate"] > 0


@pytest.mark.parametrize("block_size,num_blocks", [(1, 48), (3, 24), (8, 16)])
def test_short_soak_other_geometries(block_size, num_blocks):
    _assert_clean(run_soak(400, seed=block_size, block_size=block_size, num_blocks=num_blocks, dtype="bfloat16",
                           check_every=20))


@pytest.mark.parametrize("window_left,block_size", [(0, 4), (5, 4), (6, 1), (9, 3)])
def test_windowed_soak_releases_blocks_and_every_sequence_reads_its_window(window_left, block_size):
    report = run_soak(600, seed=window_left, block_size=block_size, num_blocks=40 if block_size > 1 else 120,
                      window_left=window_left, check_every=20)
    _assert_clean(report)
    assert report["stats"]["window_released"] > 0
    assert report["forks"] > 0 and report["stats"]["prefix_hit_rate"] > 0  # released under sharing and hits


def test_windowed_soak_catches_a_cache_releasing_one_block_too_early(monkeypatch):
    import pagedkv.cache.window as window_module

    real = window_module.releasable_blocks
    monkeypatch.setattr(window_module, "releasable_blocks",
                        lambda n, w, bs, keep_last_full=False: real(n + bs, w, bs, keep_last_full=keep_last_full))
    report = run_soak(300, seed=2, window_left=5, check_every=10)
    assert not report["ok"]
    assert "reads" in report["failure"] or "released" in report["failure"], report["failure"]


def test_soak_reports_a_planted_leak(monkeypatch):
    """A cache that forgets to release one block of long sequences is caught (the soak can fail)."""
    from pagedkv.cache.allocator import BlockAllocator

    original = BlockAllocator.free_all
    monkeypatch.setattr(BlockAllocator, "free_all",
                        lambda self, blocks: original(self, list(blocks)[:-1] if len(blocks) > 3 else blocks))
    report = run_soak(300, seed=0)
    assert not report["ok"] and "reference count" in report["failure"]


@pytest.mark.parametrize("mutant", ["register_on_reserve", "cow_first_layer_only"])
def test_soak_catches_a_cache_serving_unwritten_or_stale_kv(monkeypatch, mutant):
    """Blocks cached at reservation (then aborted mid-step) and copy-on-write of layer 0 only are caught."""
    import pagedkv.cache.paged_cache
    from pagedkv.tools.mutants.caches import CACHE_MUTANTS

    monkeypatch.setattr(pagedkv.cache.paged_cache, "PagedKVCache", CACHE_MUTANTS[mutant])
    report = run_soak(600, seed=0, check_every=10)
    assert not report["ok"] and ("cached block" in report["failure"] or "layer 1" in report["failure"])


def test_soak_cli_exit_status(capsys):
    assert main(["soak", "--steps", "200", "--no-progress", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "soak: 200 steps" in out and ": OK" in out and "leaked blocks []" in out


@pytest.mark.slow  # the 10,000-step soak; the 200-step one above runs on every run
def test_long_soak_10000_steps():
    report = run_soak(10_000, seed=0)
    _assert_clean(report)
    assert report["steps"] == 10_000
