"""End to end: a transformers Llama served from the paged cache equals transformers' dense run.

Each backend under test serves a small scenario (prefix-cache hits, a fork with copy-on-write,
chunked prefill, staggered greedy decode on a fragmented, NaN-poisoned pool); the paged logits
must match transformers' own eager attention in float64 and the greedy tokens must be identical.
Faulty backends must fail the same check. The Triton backend runs in its CPU interpreter here, so
it gets a shorter scenario.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the end-to-end check needs transformers (pip install 'pagedkv[hf]')")

from pagedkv import cli, get_backend  # noqa: E402
from pagedkv.cli import e2e  # noqa: E402
from pagedkv.testing import mutants  # noqa: E402
from pagedkv.backends import backend_name, missing_ops  # noqa: E402

SMALL = dict(num_requests=9, decode_steps=10, block_size=4)
TINY = dict(num_requests=7, decode_steps=3, block_size=3)  # interpreter-speed scenario (fork included)


def _scenario_for(backend, device: str) -> dict:
    return TINY if backend_name(backend) == "triton" and not device.startswith("cuda") else SMALL


def _skip_without_ops(backend) -> None:
    missing = {op: why for op, why in missing_ops(backend).items() if op in ("write_kv", "paged_attention")}
    if missing:
        pytest.skip("; ".join(missing.values()))


def test_paged_model_matches_dense_transformers(backend, device):
    _skip_without_ops(backend)
    report = e2e.run_e2e(backend, device=device, **_scenario_for(backend, device))
    text = "\n".join(report.lines())
    assert not report.error, text
    assert report.tokens_identical, text
    assert report.within_tolerance, text
    assert report.max_logit_diff < 5e-5 * 10, text
    # The scenario did what it claims: prefix hits, a fork (copy-on-write), chunked prefill,
    # requests finishing at different steps.
    assert report.cache_stats["cached_tokens"] > 0, text
    assert report.cache_stats["cow_copies"] >= 1, text
    assert any(c.prefill_chunks > 1 for c in report.checks), text
    assert len({c.steps[1] for c in report.checks}) > 2, text


def test_cached_prefix_is_not_recomputed():
    model = e2e.build_model(seed=1)
    requests = e2e.make_scenario(seed=1, **SMALL)
    engine = e2e.PagedEngine(model, get_backend("indexed"), block_size=SMALL["block_size"])
    results = engine.run(requests)
    for res in results.values():
        expected = range(res.cached_tokens, len(res.prompt) + len(res.generated) - 1)
        assert sorted(res.logits) == list(expected), res.request
        assert len(res.generated) == res.request.max_new_tokens
    hits = [r for r in results.values() if r.cached_tokens and r.request.fork_of is None]
    assert hits and all(r.cached_tokens % SMALL["block_size"] == 0 for r in hits)
    assert engine.tokens_computed == sum(len(r.logits) for r in results.values())
    assert engine.cache.stats()["live_sequences"] == 3  # only the fragmentation dummies remain


def test_bfloat16_within_tolerance():
    report = e2e.run_e2e("indexed", dtype="bfloat16", num_requests=6, decode_steps=6, block_size=4,
                         strict_tokens=False)
    text = "\n".join(report.lines())
    assert report.ok, text  # near ties (bf16 rounding) allowed when asked, nothing else
    assert 0 < report.max_logit_diff <= e2e.E2E_LOGIT_TOLERANCE[torch.bfloat16] * 10, text


@pytest.mark.parametrize("mutant", ["gqa_modulo", "causal_top_left", "tail_unmasked", "no_copy_on_write"])
def test_faulty_backend_fails_the_check(mutant):
    report = e2e.run_e2e(mutants.MUTANTS[mutant](), num_requests=7, decode_steps=4, block_size=4)
    assert not report.ok
    assert not report.tokens_identical
    assert report.lines()[-1].endswith("tokens identical: no")


def test_local_model_directory(tmp_path):
    model = e2e.build_model(seed=3, num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=2)
    model.save_pretrained(tmp_path)
    report = e2e.run_e2e("indexed", model=str(tmp_path), num_requests=5, decode_steps=4, block_size=4)
    assert report.ok and report.tokens_identical, "\n".join(report.lines())


def test_attention_without_step_context_raises():
    model = e2e.build_model(seed=0)
    with pytest.raises(ValueError, match="pagedkv_step"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_cli_reports_and_exit_status(capsys):
    args = ["e2e", "--backend", "loop", "--requests", "4", "--decode-steps", "3", "--block-size", "4"]
    assert cli.main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("e2e: max |logit diff| ") and last.endswith(", tokens identical: yes")
    assert cli.main(["e2e", "--impl", "pagedkv.testing.mutants:gqa_modulo", "--requests", "4", "--decode-steps", "3",
                     "--block-size", "4"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("tokens identical: no")
    assert cli.main(["e2e", "--backend", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_a_model_directory_loads_safetensors_only_and_never_remote_code(tmp_path):
    import json

    model = e2e.build_model(seed=3, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    pickled = tmp_path / "pickled"
    model.config.save_pretrained(pickled)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")  # a pickle: loading one can run code
    with pytest.raises(OSError, match="no .safetensors weights"):
        e2e.load_model(str(pickled))
    remote = tmp_path / "remote"
    model.save_pretrained(remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "evil_modeling.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    try:
        e2e.load_model(str(remote))
    except (ValueError, OSError):
        pass
    assert not (tmp_path / "ran").exists()  # the checkpoint's own code never runs
    help_text = e2e.add_parser(__import__("argparse").ArgumentParser().add_subparsers()).format_help()
    assert "safetensors" in help_text and "trust_remote_code=False" in help_text


def test_header_counts_are_the_sums_of_the_table():
    import re

    report = e2e.run_e2e("indexed", **SMALL)
    lines = report.lines()
    header = re.search(r"(\d+) requests, (\d+) steps, (\d+) tokens computed, (\d+) prompt tokens not computed "
                       r"\((\d+) from the prefix cache \+ (\d+) shared by a fork\)", lines[0])
    assert header, lines[0]
    rows = [line.split() for line in lines if re.match(r"\s*\d+\s+\d+\s+\d+f?\s+\d+\s", line)]
    assert len(rows) == int(header[1]) == len(report.checks)
    cached = [int(r[2].rstrip("f")) for r in rows]
    forked = [int(r[2].rstrip("f")) for r in rows if r[2].endswith("f")]
    assert sum(cached) == int(header[4]) == int(header[5]) + int(header[6])
    assert sum(forked) == int(header[6]) > 0
    assert sum(int(r[3]) for r in rows) == int(header[3])
    # ... and the table agrees with the engine's and the cache's own counters
    assert int(header[3]) == report.tokens_computed
    assert int(header[5]) == report.cache_stats["cached_tokens"] > 0
    for r in rows:
        assert int(r[1]) - int(r[2].rstrip("f")) + int(r[5]) - 1 == int(r[3])  # prompt - cached + new - 1
