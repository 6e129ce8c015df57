"""End to end: a transformers Llama served from the paged cache equals transformers' dense run.

Each backend under test serves a small scenario (prefix-cache hits, a fork with copy-on-write,
chunked prefill, staggered greedy decode on a fragmented, NaN-poisoned pool); the paged logits
must match transformers' own eager attention in float64 and the greedy tokens must be identical.
Faulty backends must fail the same check. The Triton backend runs in its CPU interpreter here, so
it gets a shorter scenario.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers", reason="the end-to-end check needs transformers (pip install 'pagedkv[hf]')")

from pagedkv import cli, get_backend  # noqa: E402
from pagedkv.cli import e2e  # noqa: E402
from pagedkv.tools import mutants  # noqa: E402
from pagedkv.backends import backend_name, missing_ops  # noqa: E402

SMALL = dict(num_requests=9, decode_steps=10, block_size=4)
FAULT = dict(num_requests=6, decode_steps=5, block_size=4)  # enough to catch a skewed feature
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


def _assert_passes(report) -> str:
    text = "\n".join(report.lines())
    assert not report.error, text
    assert report.tokens_identical and report.ok, text
    assert report.lines()[-1].endswith("tokens identical: yes"), text
    return text


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
@pytest.mark.parametrize("name", ["loop", "indexed", "triton"])
def test_sliding_window_and_softcap_models_match_dense(arch, name):
    # Mistral: the window on every layer; Gemma 2: window on layer 0, full layer 1, attention
    # soft-capping, query_pre_attn_scalar, final soft-capping. Contexts exceed twice the window.
    backend = get_backend(name)
    scenario = _scenario_for(backend, "cpu")
    window = 10 if scenario is SMALL else 5  # the interpreter's shorter scenario gets a shorter window
    report = e2e.run_e2e(backend, arch=arch, model_kwargs={"sliding_window": window}, **scenario)
    text = _assert_passes(report)
    assert f"model {arch}, sliding window {window} (window_left {window - 1})" in text
    assert max(c.prompt_len + c.generated for c in report.checks) > 2 * window, text
    assert ("attention softcap 4" in text) == (arch == "gemma2")


def _same_logits(kept, released) -> None:
    """Every step's logits of a run that keeps every block and one that releases a window's blocks are as far from
    the dense run's, up to summation order: the released run reads fewer blocks, so attention may reduce over
    another length (bit-equal in the environment of transformers 5.24.0; 1e-6 apart at one step with 5.25.0)."""
    torch.testing.assert_close(torch.tensor([c.max_logit_diff for c in kept.checks]),
                               torch.tensor([c.max_logit_diff for c in released.checks]), rtol=0, atol=2e-6)


@pytest.mark.parametrize("name", ["indexed", "triton"])
def test_mistral_releases_window_blocks_and_matches_dense(name):
    # every layer slides: the cache releases the blocks no later query reads; tokens stay identical to
    # the dense run, and the logits to the run that keeps every block
    backend = get_backend(name)
    scenario = _scenario_for(backend, "cpu")
    window = 10 if scenario is SMALL else 5
    report = e2e.run_e2e(backend, arch="mistral", model_kwargs={"sliding_window": window}, **scenario)
    text = _assert_passes(report)
    released = report.cache_stats["window_released"]
    assert released > 0 and f"window_left {window - 1} and released {released} blocks early" in text
    kept = e2e.run_e2e(backend, arch="mistral", model_kwargs={"sliding_window": window}, release_window_blocks=False,
                       **scenario)
    assert kept.cache_stats["window_released"] == 0 and "released" not in "\n".join(kept.lines())
    _same_logits(kept, report)


def test_gemma2_is_served_through_kv_cache_groups_with_tokens_identical_to_dense():
    """Gemma 2's alternating layers: a KV-cache group per kind on one block pool; the sliding group
    releases what its window leaves behind, the full group keeps every block, and the tokens equal the
    dense model's. With one table (release_window_blocks=False) nothing is released, the logits equal."""
    scenario = dict(SMALL, num_requests=9)
    report = e2e.run_e2e("indexed", arch="gemma2", **scenario)
    text = _assert_passes(report)
    released = report.cache_stats["window_released"]
    assert report.cache_stats["kv_cache_groups"] == 2 and released > 0, text
    assert f"kv-cache groups: 2 (full_attention layers [1], sliding_attention layers [0]) on one pool; the sliding " \
           f"group released {released} blocks early" in text
    assert report.cache_stats["cached_tokens"] > 0 and report.cache_stats["cow_copies"] >= 1, text
    kept = e2e.run_e2e("indexed", arch="gemma2", release_window_blocks=False, **scenario)
    assert kept.ok and kept.cache_stats["window_released"] == 0 and "kv_cache_groups" not in kept.cache_stats
    _same_logits(kept, report)


def test_gemma3_cli_serves_two_sliding_layers_to_one_full_through_kv_cache_groups(capsys):
    assert cli.main(["e2e", "--arch", "gemma3", "--requests", "7", "--decode-steps", "6", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "model gemma3_text, sliding window 10 (window_left 9) on layers [0, 1]" in out
    assert "kv-cache groups: 2 (full_attention layers [2], sliding_attention layers [0, 1]) on one pool" in out
    assert out.rstrip().endswith("tokens identical: yes")


@pytest.mark.parametrize("fault", ["window_off_by_one", "no_window", "no_softcap", "default_scale"])
def test_window_softcap_and_scale_are_what_the_model_computes(fault):
    # The paged run is sensitive to each feature the hook passes: dropping or skewing one fails.
    base = get_backend("indexed")

    def paged_attention(q, k, v, bt, sl, qsl, scale=None, **kw):
        if fault == "window_off_by_one":
            kw["window_left"] += 1
        elif fault == "no_window":
            kw.pop("window_left", None)
        elif fault == "no_softcap":
            kw.pop("softcap")
        else:
            scale = None  # 1/sqrt(head_dim) instead of query_pre_attn_scalar ** -0.5
        return base.paged_attention(q, k, v, bt, sl, qsl, scale, **kw)

    faulty = types.SimpleNamespace(name=f"indexed-{fault}", write_kv=base.write_kv, paged_attention=paged_attention)
    report = e2e.run_e2e(faulty, arch="gemma2", **FAULT)
    assert not report.ok and not report.tokens_identical, "\n".join(report.lines())


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_matches_dense_with_the_same_round_trip(kv_cache_dtype):
    report = e2e.run_e2e("indexed", kv_cache_dtype=kv_cache_dtype, arch="mistral", **SMALL)
    text = _assert_passes(report)
    assert f"kv cache {kv_cache_dtype}: k_scale/v_scale" in text
    plain = float(text.split("against the unquantized float64 run ")[1].split()[0])
    assert plain > 100 * report.max_logit_diff, text  # the quantization is real; the oracle has it too


def test_fp8_cache_with_a_wrong_scale_fails():
    base = get_backend("indexed")

    def paged_attention(*args, **kw):
        kw["k_scale"] *= 1.02  # dequantized with another scale than the one written with
        return base.paged_attention(*args, **kw)

    faulty = types.SimpleNamespace(name="indexed-kscale", write_kv=base.write_kv, paged_attention=paged_attention)
    report = e2e.run_e2e(faulty, kv_cache_dtype="fp8_e4m3", **FAULT)
    assert not report.ok, "\n".join(report.lines())


def test_fp8_round_trip_takes_the_stored_code_only_at_a_rounding_boundary():
    from pagedkv.cli.e2e.fp8 import BoundaryCount, round_trip

    dtype = torch.float8_e4m3fn
    x = torch.tensor([[1.0625 + 1e-6, 1.5, -3.0, 100.0]], dtype=torch.float64)  # 1.0625: midpoint of 1 and 1.125
    own = round_trip(x, 1.0, dtype, None)
    assert own.tolist() == [[1.125, 1.5, -3.0, 96.0]]
    count = BoundaryCount()
    stored = torch.tensor([[1.0, 1.625, -3.0, 96.0]]).to(dtype)  # 1.0: the other side of the tie; 1.625: wrong
    got = round_trip(x, 1.0, dtype, stored, count)
    assert got.tolist() == [[1.0, 1.5, -3.0, 96.0]]
    assert (count.adopted, count.total) == (1, 4)


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


def test_local_sliding_window_model_directory(tmp_path):
    model = e2e.build_model(arch="mistral", seed=4, sliding_window=6)  # once refused, now served windowed
    model.save_pretrained(tmp_path)
    report = e2e.run_e2e("indexed", model=str(tmp_path), num_requests=5, decode_steps=4, block_size=4)
    text = _assert_passes(report)
    assert "sliding window 6 (window_left 5)" in text


def test_attention_without_step_context_raises():
    model = e2e.build_model(seed=0)
    with pytest.raises(ValueError, match="pagedkv_step"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_cli_arch_and_kv_cache_dtype(capsys):
    args = ["e2e", "--backend", "indexed", "--requests", "4", "--decode-steps", "3", "--block-size", "4"]
    assert cli.main(args + ["--arch", "gemma2", "--sliding-window", "5", "--kv-cache-dtype", "fp8_e5m2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("tokens identical: yes")
    assert any("sliding window 5 (window_left 4)" in line for line in out)
    assert any(line.startswith("kv cache fp8_e5m2") for line in out)
    with pytest.raises(SystemExit) as exc:  # argparse refuses it
        cli.main(args + ["--kv-cache-dtype", "int8"])
    assert exc.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err


def test_cli_reports_and_exit_status(capsys):
    args = ["e2e", "--backend", "loop", "--requests", "4", "--decode-steps", "3", "--block-size", "4"]
    assert cli.main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("e2e: max |logit diff| ") and last.endswith(", tokens identical: yes")
    assert cli.main(["e2e", "--impl", "pagedkv.tools.mutants:gqa_modulo", "--requests", "4", "--decode-steps", "3",
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


def test_a_deepseek_v3_model_served_from_the_paged_latent_cache_matches_dense():
    """MLA: one latent pool (32 + 8 rope columns, V its first 32), the query absorbed into the latent space;
    tokens identical to transformers' own expanded attention in float64."""
    report = e2e.run_e2e("indexed", arch="deepseek_v3", **SMALL)
    text = _assert_passes(report)
    assert "multi-head latent attention from the paged latent cache" in text
    assert report.cache_stats["cow_copies"] >= 1 and report.cache_stats["cached_tokens"] > 0, text


@pytest.mark.slow  # Triton's interpreter serves the MLA model in about a minute
def test_the_triton_backend_serves_the_deepseek_v3_model():
    _assert_passes(e2e.run_e2e("triton", arch="deepseek_v3", **TINY))


def test_an_mla_kernel_reading_the_rope_columns_at_the_wrong_offset_fails_the_deepseek_v3_e2e():
    report = e2e.run_e2e(mutants.rope_read_at_wrong_offset, arch="deepseek_v3", **FAULT)
    assert not report.ok and not report.tokens_identical, "\n".join(report.lines())
