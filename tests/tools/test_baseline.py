"""The baseline gate: the code a refactor replaces as a second backend, drift measured and gated.

A planted refactor of the ``indexed`` backend computes attention's two matmuls as broadcast
multiply-and-sum reductions (another reduction order): it conforms, it drifts, and a run that
declares it bit-exact fails with a case file that replays. A bit-identical copy (the same ops under
another module name) and ``git:HEAD:indexed`` (the committed code, in a worker process) show no drift.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pagedkv
from pagedkv.tools.baseline import BaselineError, BaselineProxy, load_baseline, parse_spec, resolve
from pagedkv.testing.cases import Case, Geometry, SeqSpec
from pagedkv.testing.properties.definitions import attention_matches_reference, run_attention
from pagedkv.tools.baseline.drift import NAN_ULP, DriftLog, judge, measure, ulp_distance

ROOT = Path(__file__).resolve().parents[2]

REFACTORED = '''
"""indexed, refactored: attention's two matmuls as broadcast multiply-and-sum reductions."""
import torch

from pagedkv.attention import dense as attention
from pagedkv.backends import indexed
from pagedkv.backends.ops import backend_op

name = "refactored_indexed"
FEATURES = indexed.FEATURES
gather, scatter, write_kv = indexed.gather, indexed.scatter, indexed.write_kv


def _attend(query, key, value, scale, *, window_left=-1, softcap=0.0, alibi_slopes=None, sinks=None,
            k_scale=None, v_scale=None):
    q_len, num_q_heads, head_dim = query.shape
    seq_len, num_kv_heads = key.shape[0], key.shape[1]
    group = num_q_heads // num_kv_heads
    key = key.float() if k_scale is None else key.float() * k_scale.float().view(-1, 1)
    value = value.float() if v_scale is None else value.float() * v_scale.float().view(-1, 1)
    q = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k = key.permute(1, 0, 2).unsqueeze(1)
    v = value.permute(1, 0, 2).unsqueeze(1)
    logits = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale  # was torch.matmul(q, k^T)
    k_pos = torch.arange(seq_len, device=query.device)
    logits = attention.feature_logits(logits, k_pos[seq_len - q_len:], k_pos, window_left=window_left,
                                      softcap=softcap, alibi_slopes=None if alibi_slopes is None
                                      else alibi_slopes.view(num_kv_heads, group))
    probs = attention.softmax_with_sinks(logits, None if sinks is None else sinks.view(num_kv_heads, group))
    out = (probs.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)  # was torch.matmul(probs, v)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(query.dtype)


@backend_op(FEATURES)
def paged_attention(query, k_cache, v_cache, args):
    out = torch.empty_like(query)
    features = dict(window_left=args.window_left, softcap=args.softcap, alibi_slopes=args.alibi_slopes,
                    sinks=args.sinks, k_scale=args.k_scale, v_scale=args.v_scale)
    starts = args.q_starts
    for b, seq_len in enumerate(args.seq_lens):
        lo, hi = starts[b], starts[b + 1]
        if hi > lo:
            key = indexed.gather(k_cache, args.block_tables[b], seq_len, validate=False)
            value = indexed.gather(v_cache, args.block_tables[b], seq_len, validate=False)
            out[lo:hi] = _attend(query[lo:hi], key, value, args.scale, **features)
    return out
'''

COPY = '''
"""indexed under another module name: the same ops, bit for bit."""
from pagedkv.backends.indexed import FEATURES, gather, paged_attention, scatter, write_kv  # noqa: F401

name = "indexed_copy"
'''

CASE = Case(Geometry(12, 4, 2, 8, 3), (SeqSpec(tuple(range(8)), 30, 4), SeqSpec((9, 10), 7, 1)), seed=3)


@pytest.fixture(scope="module")
def plants(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("plants")
    (folder / "refactored_indexed.py").write_text(REFACTORED)
    (folder / "indexed_copy.py").write_text(COPY)
    return folder


@pytest.fixture(autouse=True)
def cache_home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pagedkv-cache"))
    monkeypatch.setenv("PAGEDKV_BASELINE_REPO", str(ROOT))


@pytest.fixture
def suite(pytester, monkeypatch):
    """``suite(*options) -> (exit status, stdout)``: the suite's attention properties under ``dev``, with
    case files under ``failures/`` of the run's directory (``pytester.path``)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    monkeypatch.setenv("PAGEDKV_PROFILE", "dev")

    def run(*options: str) -> tuple[int, str]:
        result = pytester.runpytest_subprocess("--pyargs", "pagedkv.testing.suite", "-k", "attention_matches", "-n",
                                               "0", "-p", "no:cacheprovider", "-q", *options, timeout=300)
        return result.ret, str(result.stdout)

    return run


def _table_row(output: str, prop: str = "paged_attention_matches_fp64_dense_reference") -> tuple[str, str, int]:
    row = next(line for line in output.splitlines() if line.startswith(prop + " "))
    ulp, rel, examples = row.split()[1:4]
    return ulp, rel, int(examples)


# -- the drift arithmetic -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ulp_distance_counts_representable_values(dtype):
    x = torch.tensor([1.0, -2.5, 0.0, 3.0], dtype=dtype)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    twice = torch.nextafter(up, torch.full_like(x, float("inf")))
    assert ulp_distance(up, x).tolist() == [1, 1, 1, 1]
    assert ulp_distance(twice, x).tolist() == [2, 2, 2, 2]
    zeros = torch.tensor([0.0, -0.0], dtype=dtype)
    assert ulp_distance(zeros, zeros.flip(0)).tolist() == [0, 0]
    nan = torch.tensor([float("nan"), float("nan")], dtype=dtype)
    assert ulp_distance(nan, torch.tensor([float("nan"), 1.0], dtype=dtype)).tolist() == [0, NAN_ULP]
    tiny = torch.tensor([torch.finfo(dtype).tiny], dtype=dtype)  # across zero: both sides count
    assert ulp_distance(tiny, -tiny).item() == 2 * ulp_distance(tiny, torch.zeros_like(tiny)).item()


def test_drift_log_keeps_the_worst_case_and_merges():
    cand, base = pagedkv.load_backend("indexed"), pagedkv.get_backend("indexed")
    log, other = DriftLog(), DriftLog()
    log.add("p", measure(cand, base, CASE), CASE)
    worse = CASE.replace(seed=4)
    drift = measure(cand, base, worse)
    drift.ulp, drift.rel = 7, 1e-6  # as a drifting backend would report
    other.add("p", drift, worse)
    log.merge(other)
    assert (log.props["p"].examples, log.props["p"].ulp, log.props["p"].case["seed"]) == (2, 7, 4)
    assert judge(drift, exact=True) and judge(drift, max_ulp=6) and judge(drift, max_ulp=7) is None
    assert DriftLog.from_json(log.to_json()).props["p"].ulp == 7


def test_a_reordered_reduction_conforms_and_drifts(plants, monkeypatch):
    monkeypatch.syspath_prepend(str(plants))
    refactored = pagedkv.load_backend("refactored_indexed")
    attention_matches_reference(refactored, CASE)  # within the tolerance policy: the verdict passes
    drift = measure(refactored, pagedkv.get_backend("indexed"), CASE)
    assert drift.diverged == [] and drift.ulp > 0 and 0 < drift.rel < 1e-2  # relative: large only near 0
    out = run_attention(refactored, CASE)
    w = drift.where
    assert out[w["row"], w["query_head"], w["dim"]].item() == w["candidate"]
    assert w["candidate"] != w["baseline"]


# -- the baseline in its own process ---------------------------------------------------------------------
def test_spec_forms():
    assert parse_spec("git:HEAD~1", "triton") == ("git", "HEAD~1", "triton")
    assert parse_spec("git:v1:my.kv:backend") == ("git", "v1", "my.kv:backend")
    assert parse_spec("wheel:dist/a-1.0-py3-none-any.whl:indexed") == ("wheel", "dist/a-1.0-py3-none-any.whl",
                                                                       "indexed")
    assert parse_spec("path:/old/site-packages", "indexed") == ("path", "/old/site-packages", "indexed")
    assert parse_spec("indexed") == ("plain", "", "indexed")
    with pytest.raises(pagedkv.BackendError, match="names no backend"):
        parse_spec("git:HEAD")
    with pytest.raises(pagedkv.BackendError, match="git rev-parse failed"):
        resolve("git:no-such-revision-anywhere", "indexed")


def test_git_head_runs_in_a_worker_from_the_extracted_tree():
    baseline = load_baseline("git:HEAD", "indexed")
    assert isinstance(baseline, BaselineProxy)
    assert baseline.origin.startswith(os.environ["PAGEDKV_CACHE_DIR"]) and baseline.origin.endswith("indexed.py")
    assert baseline.pagedkv_origin.startswith(str(baseline.tree))  # the tree's pagedkv, not this one
    assert baseline.FEATURES == pagedkv.get_backend("indexed").FEATURES
    case = CASE.replace(layout="kv_interleaved")  # views of one arena: the writes must land in both halves
    drift = measure(pagedkv.get_backend("indexed"), baseline, case)
    assert drift.compared == ["gather", "scatter", "write_kv", "paged_attention"]
    assert (drift.diverged, drift.ulp, drift.where) == ([], 0, None)
    k, v = case.caches()
    key = torch.randn(3, 2, 8)
    baseline.write_kv(k, v, key, -key, torch.tensor([5, -1, 17]))
    assert torch.equal(k[1, 1], key[0]) and torch.equal(v[4, 1], -key[2])
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def test_a_baseline_error_comes_back_as_its_type_with_the_remote_traceback():
    baseline = load_baseline("git:HEAD", "indexed")
    k, _ = CASE.caches()
    with pytest.raises(pagedkv.BlockIndexError, match="outside") as info:
        baseline.gather(k, torch.tensor([99]), 2)
    assert isinstance(info.value.__cause__, BaselineError)
    assert "remote traceback" in str(info.value.__cause__) and "validation/calls.py" in str(info.value.__cause__)
    assert torch.isfinite(baseline.gather(k, torch.tensor([0, 1]), 5)).all()  # the worker lives on


def test_a_crash_and_a_foreign_error_are_reported(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "indexed_copy.py").write_text(textwrap.dedent('''
        import os, signal
        name = "crashing"
        def gather(cache, block_table, seq_len):
            if seq_len == 0:
                raise KeyError("no such thing")
            os.kill(os.getpid(), signal.SIGKILL)
    '''))
    baseline = BaselineProxy(f"path:{tree}", tree, "indexed_copy", f"path:{tree}")
    try:
        k, _ = CASE.caches()
        with pytest.raises(BaselineError, match=r"raised KeyError in gather: 'no such thing'"):
            baseline.gather(k, [0], 0)
        with pytest.raises(BaselineError, match=r"died while running gather: killed by SIGKILL"):
            baseline.gather(k, [0], 3)
        with pytest.raises(BaselineError, match="KeyError"):  # a fresh worker serves the next call
            baseline.gather(k, [0], 0)
    finally:
        baseline.close()


def test_path_baseline_shadows_a_module_of_the_same_name(plants, tmp_path, monkeypatch):
    """The candidate and the baseline are both ``indexed_copy``: the baseline's comes from its tree."""
    monkeypatch.syspath_prepend(str(plants))
    old = tmp_path / "old"
    old.mkdir()
    (old / "indexed_copy.py").write_text(REFACTORED)  # the "old" version: the other reduction order
    baseline = load_baseline(f"path:{old}", "indexed_copy")
    assert baseline.origin == str(old / "indexed_copy.py")
    assert measure(pagedkv.load_backend("indexed_copy"), baseline, CASE).ulp > 0


# -- the suite, end to end ---------------------------------------------------------------------------------
def test_suite_reports_drift_of_a_conforming_refactor(plants, suite, pytester):
    status, out = suite("--pagedkv-impl", str(plants / "refactored_indexed.py"), "--pagedkv-baseline", "indexed")
    assert status == 0, out[-3000:]
    assert "pagedkv drift against baseline indexed" in out
    ulp, rel, examples = _table_row(out)
    assert int(ulp) > 0 and 0 < float(rel) < 1e-2 and examples >= 10
    worst = json.loads((pytester.path / "failures" / "drift" / "paged_attention_matches_fp64_dense_reference.json")
                       .read_text())
    assert (worst["other"], worst["check"]) == ("indexed", "paged_attention_matches_fp64_dense_reference")
    assert f"attention {ulp} ulp" in worst["error"]


def test_declared_exact_run_fails_with_a_case_file_that_replays(plants, suite, pytester):
    impl = str(plants / "refactored_indexed.py")
    status, out = suite("--pagedkv-impl", impl, "--pagedkv-baseline", "indexed", "--pagedkv-baseline-exact")
    assert status == 1, out[-3000:]
    assert "declared bit-exact with the baseline, but attention" in out
    command = re.search(r"replay: (python -m pagedkv replay \S+ --impl \S+ --other indexed --exact)", out)
    assert command, out[-3000:]
    path = command.group(1).split()[4]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    replayed = subprocess.run([sys.executable, "-m", "pagedkv", "replay", path, "--impl", impl, "--other", "indexed",
                               "--exact"], cwd=pytester.path, env=env, capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 1, replayed.stdout
    assert "conformance holds: paged_attention_matches_fp64_dense_reference" in replayed.stdout
    assert "DRIFT FAILS: declared bit-exact" in replayed.stdout and "PASSES" not in replayed.stdout  # one verdict
    cand = re.search(r"candidate  \S+: \[([^\]]+)\]", replayed.stdout).group(1)
    base = re.search(r"baseline   indexed: \[([^\]]+)\]", replayed.stdout).group(1)
    assert cand != base
    unrated = subprocess.run([sys.executable, "-m", "pagedkv", "replay", path, "--impl", impl, "--other", "indexed"],
                             cwd=pytester.path, env=env, capture_output=True, text=True, timeout=120)
    assert unrated.returncode == 0 and "drift within the gate" in unrated.stdout
    assert "PASSES: paged_attention_matches_fp64_dense_reference" in unrated.stdout and "FAILS" not in unrated.stdout


@pytest.mark.parametrize("impl, baseline", [("COPY", "indexed"), ("indexed", "git:HEAD:indexed")],
                         ids=["copy-under-another-name", "git-head"])
def test_a_bit_identical_baseline_reports_zero_drift(plants, suite, impl, baseline):
    impl = str(plants / "indexed_copy.py") if impl == "COPY" else impl
    status, out = suite("--pagedkv-impl", impl, "--pagedkv-baseline", baseline, "--pagedkv-baseline-exact")
    assert status == 0, out[-3000:]
    ulp, rel, examples = _table_row(out)
    assert (ulp, rel) == ("0", "0") and examples >= 10
