"""``python -m pagedkv demo``: every read verified, faults caught, and the report's block counts are the allocator's."""

from __future__ import annotations

import re

import pytest

from pagedkv import cli
from pagedkv.backends import available_backends
from pagedkv.cli import demo
from pagedkv.tools import mutants

SMALL = dict(requests=8, num_blocks=40, block_size=8, num_kv_heads=2, head_dim=8, check_every=4)


def _allocator_counts(cache) -> dict:
    """Block counts from the allocator's public API and the live tables, independently of the demo."""
    a = cache.allocator
    refs = cache.reference_counts()
    held = {b for b in range(a.num_blocks) if a.ref_count(b) > 0}
    assert held == set(refs)  # the allocator and the tables agree on which blocks are used
    free = [b for b in range(a.num_blocks) if a.ref_count(b) == 0]
    return {"total": a.num_blocks, "used": len(held), "free": len(free), "shared": sum(n > 1 for n in refs.values()),
            "cached": a.num_cached}


def test_block_counts_in_the_report_are_the_allocators():
    seen = {}

    def on_step(step, cache):
        seen[step] = _allocator_counts(cache)

    report = demo.run_demo(["loop", "indexed"], on_step=on_step, **SMALL)
    assert not report.failure, report.failure
    assert report.preemptions > 0 and report.forks > 0  # the small pool makes the scenario do both
    text = "\n".join(demo.report_lines(report))
    mid = seen[report.mid_step]
    line = re.search(r"blocks at step (\d+)\s+used (\d+) \+ free (\d+) = (\d+); (\d+) of the used are shared", text)
    assert line, text
    assert int(line[1]) == report.mid_step
    assert (int(line[2]), int(line[3]), int(line[4]), int(line[5])) == (mid["used"], mid["free"], mid["total"],
                                                                        mid["shared"])
    parts = re.search(r"free = (\d+) empty \+ (\d+) evictable", text)
    cached = re.search(r"cached (\d+) = blocks holding a prefix-cache entry: (\d+) in use \+ (\d+) evictable", text)
    assert int(parts[1]) + int(parts[2]) == mid["free"]
    assert int(cached[1]) == mid["cached"] and int(cached[2]) + int(cached[3]) == mid["cached"]
    assert int(cached[3]) == int(parts[2])
    peak = re.search(r"peak use\s+(\d+) of (\d+) blocks held by live sequences, first at step (\d+)", text)
    assert int(peak[1]) == max(c["used"] for c in seen.values()) == seen[int(peak[3])]["used"]
    end = re.search(r"blocks at the end\s+used (\d+), free (\d+) = (\d+) empty \+ (\d+) evictable \(cached (\d+)", text)
    last = _allocator_counts(report.caches[0])
    assert (int(end[1]), int(end[2]), int(end[5])) == (0, last["free"], last["cached"])
    assert int(end[3]) + int(end[4]) == last["free"] and int(end[4]) == last["cached"]
    # every backend's cache went through the same states
    assert all(_allocator_counts(c) == last for c in report.caches)
    finished = re.search(r"finished\s+(\d+) of (\d+) requests \+ (\d+) forks", text)
    assert int(finished[1]) == int(finished[2]) + int(finished[3]) == SMALL["requests"] + report.forks


def test_every_read_is_verified_and_counted():
    report = demo.run_demo(["loop", "indexed"], **SMALL)
    assert not report.failure
    for reads in report.reads.values():
        assert reads.attention_every == 1
        assert reads.attention_calls == report.served_steps > 0
        assert 0 < reads.max_attention_error < 1e-4
        assert reads.gathers > 0 and reads.gathered_tokens > 0


def test_a_windowed_demo_releases_blocks_and_reports_them():
    seen = []
    report = demo.run_demo(["loop", "indexed"], window_left=6, on_step=lambda step, cache: seen.append(
        cache.stats()["window_released_live"]), **SMALL)
    assert not report.failure, report.failure
    released = report.caches[0].stats()["window_released"]
    assert released > 0 and report.window_released_peak == max(seen) > 0
    text = "\n".join(demo.report_lines(report))
    line = re.search(r"sliding window\s+window_left 6: (\d+) blocks released early.*at most (\d+) at once", text)
    assert line and (int(line[1]), int(line[2])) == (released, report.window_released_peak), text
    assert report.end["used"] == 0  # nothing leaked
    full = demo.run_demo(["indexed"], **SMALL)
    assert report.preemptions < full.preemptions  # the same pool serves the workload with fewer preemptions
    roomy = dict(SMALL, num_blocks=120)  # a pool that neither run fills: the window holds fewer blocks at the peak
    assert demo.run_demo(["indexed"], window_left=6, **roomy).peak["used"] < demo.run_demo(["indexed"],
                                                                                            **roomy).peak["used"]


@pytest.mark.parametrize("mutant, read", [("gqa_modulo", "paged_attention"), ("causal_top_left", "paged_attention"),
                                          ("off_by_one_last_block", ""), ("no_copy_on_write", "")])
def test_a_faulty_backend_fails_the_demo(mutant, read):
    report = demo.run_demo([mutants.MUTANTS[mutant]()], **SMALL)
    assert report.failure, mutant
    assert read in report.failure


def test_cli_exit_status_and_impl_selection(capsys):
    assert cli.main(["demo", "--impl", "loop,indexed", "--requests", "4", "--num-blocks", "40", "--block-size", "8",
                     "--head-dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "reads by loop" in out and "reads by indexed" in out and out.rstrip().endswith("demo: OK")
    assert cli.main(["demo", "--impl", "pagedkv.tools.mutants:gqa_modulo", "--requests", "4", "--head-dim", "8"]) == 1
    assert "demo: FAILED" in capsys.readouterr().out
    for bad in ("bogus", "no/such/file.py", "pagedkv.tools.mutants:nope"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["demo", "--impl", bad])
        assert exc.value.code == 2
        assert f"--impl {bad!r}" in capsys.readouterr().err


def test_default_impls_are_every_available_builtin():
    assert demo._impls(None) == available_backends()
    assert demo._impls(["loop", "indexed,triton"]) == ["loop", "indexed", "triton"]


@pytest.mark.skipif("triton" not in available_backends(), reason="triton is not importable here")
def test_triton_in_the_interpreter_attends_at_sampled_steps_and_says_so():
    report = demo.run_demo(["triton"], device="cpu", interpreted_every=3, **{**SMALL, "requests": 2})
    assert not report.failure, report.failure
    reads = report.reads["triton"]
    assert reads.attention_every == 3 and 0 < reads.attention_calls <= report.served_steps // 3 + 1
    assert "at served steps 3, 6, ..." in "\n".join(demo.report_lines(report))


def test_a_gather_that_differs_is_caught_bit_for_bit():
    import types

    from pagedkv.backends import indexed

    def gather(cache, block_table, seq_len, validate=True):
        out = indexed.gather(cache, block_table, seq_len, validate)
        out.view(-1)[-1:] = out.view(-1)[-1:].nextafter(out.new_tensor(float("inf")))  # one ulp off, last element
        return out

    sloppy = types.SimpleNamespace(name="sloppy_gather", write_kv=indexed.write_kv,
                                   paged_attention=indexed.paged_attention, gather=gather)
    report = demo.run_demo([sloppy], **SMALL)
    assert "sloppy_gather gather of K of sequence" in report.failure


def test_a_hybrid_demo_serves_alternating_layers_through_kv_cache_groups(capsys):
    """Gemma 2's alternating layers: every read of both kinds verified; the sliding group releases, the
    full group keeps every block (a full layer reads its whole context through its own table)."""
    seen = []

    def full_tables_hold_every_block(step, cache):
        full = cache.specs.index(next(g for g in cache.specs if g.window_left is None))
        seen.append(all(-1 not in cache.block_table(s, group=full).tolist() for s in cache.sequences))

    report = demo.run_demo(["indexed"], window_left=6, layer_types=("sliding_attention", "full_attention"),
                           on_step=full_tables_hold_every_block, **SMALL)
    assert not report.failure, report.failure
    assert report.stats["kv_cache_groups"] == 2 and report.stats["window_released"] > 0 and all(seen)
    assert report.reads["indexed"].attention_calls == 2 * report.served_steps  # each layer attends every step
    assert report.end["used"] == 0
    assert cli.main(["demo", "--impl", "indexed", "--requests", "4", "--layer-types",
                     "sliding_attention,full_attention", "--window-left", "5"]) == 0
    assert "kv-cache groups" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["demo", "--layer-types", "sliding_attention,full_attention"])  # no --window-left
