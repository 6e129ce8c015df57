"""Smoke test of ``python -m pagedkv bench``: a tiny sweep runs and writes JSON, CSV and PNG.

No timing is asserted here: performance is judged by the benchmark's own limits table.
"""

from __future__ import annotations

import csv
import json

import pytest

from pagedkv import cli
from pagedkv.cli.bench.report import failed, format_limits, limits, load_rows
from pagedkv.cli.bench.sweep import CSV_COLUMNS, Row

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the test and bench extras install it)")


def test_tiny_sweep_writes_results(tmp_path, capsys):
    status = cli.main(["bench", "--device", "cpu", "--seq-lens", "8,40", "--block-sizes", "1,16",
                       "--min-time", "0.001", "--rounds", "1", "--no-progress", "--malloc", "system",
                       "--out-dir", str(tmp_path), "--name", "smoke"])
    assert status == 0
    out = capsys.readouterr().out
    assert "limits" in out and "gather (indexed) / copy bound" in out

    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert doc["columns"] == list(CSV_COLUMNS)
    assert doc["environment"]["threads"] == 1
    assert {v["target"] for v in doc["limits"]} >= {"gather (indexed) / gather (loop), L >= 512"}
    rows = load_rows(tmp_path / "smoke.json")
    seen = {(r.op, r.impl) for r in rows}
    for op in ("gather", "scatter", "write_kv", "attention"):
        assert (op, "copy") in seen and (op, "clone") in seen
        assert (op, "indexed") in seen
    for op in ("gather", "scatter", "write_kv"):
        assert (op, "loop") in seen
    assert ("gather", "elementwise") in seen and ("attention", "indexed+sdpa") in seen
    assert all(r.time_s and r.time_s > 0 for r in rows if not r.note)
    assert all(r.x_copy is not None and r.pct_copy_bw is not None for r in rows if r.time_s)
    assert all(r.peak_extra_bytes is not None for r in rows if r.impl == "indexed" and not r.note)

    with (tmp_path / "smoke.csv").open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        assert len(list(reader)) == len(rows)
    png = (tmp_path / "smoke.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_limits_table_reports_each_target():
    rows = [Row(op="gather", impl=impl, device="cpu", dtype="float32", preset="8x128", num_kv_heads=8,
                      head_dim=128, block_size=16, seq_len=512, time_s=t, x_copy=t, x_clone=t,
                      peak_extra_bytes=512 * 8 * 128 * 4, extra_beyond_output_bytes=0)
            for impl, t in (("loop", 2.0), ("indexed", 1.5))]
    import torch

    verdicts = {v.target: v for v in limits(rows, torch.device("cpu"))}
    v = verdicts["gather (indexed) / copy bound, L >= 512, every block size"]
    assert v.measured == 1.5 and v.passed is False
    v = verdicts["gather (indexed) / gather (loop), L >= 512"]
    assert v.measured == 0.75 and v.passed is True
    assert verdicts["gather (indexed) / gather (loop), whole sweep [informational]"].measured == 0.75
    assert verdicts["scatter (indexed) / copy bound, L >= 4096"].passed is None  # no points: n/a
    assert "FAIL" in format_limits(list(verdicts.values()))


def test_the_loop_target_counts_the_issue_grid_and_reports_the_short_sequences_apart():
    import torch

    def row(impl, L, t):
        return Row(op="gather", impl=impl, device="cpu", dtype="float32", preset="8x128", num_kv_heads=8,
                   head_dim=128, block_size=256, seq_len=L, time_s=t, x_copy=t, x_clone=t)

    rows = [row("loop", 64, 1.0), row("indexed", 64, 1.02), row("loop", 512, 2.0), row("indexed", 512, 1.0)]
    verdicts = {v.target: v for v in limits(rows, torch.device("cpu"))}
    hard = verdicts["gather (indexed) / gather (loop), L >= 512"]
    assert hard.measured == 0.5 and hard.passed is True and hard.points == 1
    soft = verdicts["gather (indexed) / gather (loop), whole sweep [informational]"]
    assert soft.measured == 1.02 and soft.passed is False and soft.informational
    assert soft not in failed(list(verdicts.values()))


def test_gpu_limits_are_evaluated_from_bandwidth_columns():
    import torch

    def row(op, impl, bs, L, pct, t=1.0, batch=1):
        return Row(op=op, impl=impl, device="cuda", dtype="float16", preset="8x128", num_kv_heads=8,
                         head_dim=128, block_size=bs, seq_len=L, batch=batch, time_s=t, pct_copy_bw=pct)

    rows = [row("gather", "indexed", 16, 4096, 93.0), row("gather", "indexed", 1, 4096, 79.0),
            row("write_kv", "indexed", 16, 4096, 60.0),
            row("attention", "triton", 16, 16384, 85.0, t=1.0, batch=16),
            row("attention", "indexed+sdpa", 16, 16384, 40.0, t=2.0, batch=16)]
    verdicts = {v.target: v for v in limits(rows, torch.device("cuda"))}
    assert verdicts["gather (indexed) % copy bandwidth, bs >= 16, L >= 4096"].passed is True
    assert verdicts["gather (indexed) % copy bandwidth, bs = 1, L >= 4096"].passed is False
    assert verdicts["write_kv (indexed) % copy bandwidth, L >= 4096"].passed is True
    assert verdicts["fused decode attention (triton) % copy bandwidth, batch x context >= 64k"].passed is True
    assert verdicts["fused decode attention (triton) % copy bandwidth, batch x context >= 256k"].passed is False
    assert verdicts["fused decode (triton) / gather-then-SDPA time, batch x context >= 16k"].measured == 0.5


TINY = ["bench", "--device", "cpu", "--seq-lens", "8", "--block-sizes", "16", "--min-time", "0.001", "--rounds", "1",
        "--malloc", "system", "--no-plot"]


@pytest.mark.parametrize("bad", [["--impls", "bogus"], ["--impls", "indexed,no/such/file.py"],
                                 ["--impls", "pagedkv.tools.mutants:nope"], ["--ops", "gather,nope"],
                                 ["--presets", "huge"], ["--dtypes", "float8"]])
def test_a_bad_selection_is_a_usage_error(bad, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(TINY + ["--out-dir", str(tmp_path)] + bad)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_a_candidate_is_timed_on_the_ops_it_provides(tmp_path, capsys):
    (tmp_path / "gather_only.py").write_text(
        "from pagedkv.backends import indexed\nname = 'gather_only'\n"
        "def gather(cache, block_table, seq_len):\n    return indexed.gather(cache, block_table, seq_len)\n")
    spec = str(tmp_path / "gather_only.py")
    status = cli.main(TINY + ["--ops", "gather,scatter", "--impls", f"indexed,{spec}", "--out-dir", str(tmp_path),
                              "--name", "cand"])
    assert status == 0
    out = capsys.readouterr()
    rows = load_rows(tmp_path / "cand.json")
    timed = {(r.op, r.impl) for r in rows if r.time_s}
    assert ("gather", spec) in timed and ("gather", "indexed") in timed
    assert not any(r.impl == spec for r in rows if r.op == "scatter")
    assert f"note: {spec}: candidate provides no scatter" in out.out
    assert f"gather ({spec}) / copy bound" in out.out  # the candidate faces the indexed backend's copy targets
    assert "point" not in out.err  # stdout is not a terminal: no progress bar


def test_check_exits_1_when_a_limit_fails(tmp_path, monkeypatch, capsys):
    from pagedkv.cli import bench
    from pagedkv.cli.bench.report import Verdict, failed

    informational = Verdict("x / y [informational]", 3.0, 1.0, "<=", False, informational=True)
    hard = Verdict("gather (indexed) / copy bound", 3.0, 1.25, "<=", False)
    assert failed([informational, hard]) == [hard]
    args = TINY + ["--ops", "gather", "--impls", "indexed", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(bench, "limits", lambda rows, device: [informational])
    assert cli.main(args + ["--check"]) == 0
    monkeypatch.setattr(bench, "limits", lambda rows, device: [informational, hard])
    assert cli.main(args) == 0  # without --check the verdict is only printed
    assert cli.main(args + ["--check"]) == 1
    assert "check: 1 limit(s) failed: gather (indexed) / copy bound" in capsys.readouterr().out


def test_a_candidate_is_timed_only_inside_its_declared_space_and_results_stay_out_of_a_users_files(tmp_path,
                                                                                                monkeypatch):
    from pagedkv.backends.capabilities import Capabilities, Sizes
    from pagedkv.cli.bench import _default_out_dir
    from pagedkv.cli.bench.sweep import _outside_declared

    class Kernel:
        capabilities = Capabilities(block_sizes=Sizes(values={16, 32}), head_dims=Sizes(values={64, 128}),
                                    dtypes={"float16"})

    assert "block_size 1" in _outside_declared(Kernel(), 1, 8, 128, "float16")
    assert "dtype float32" in _outside_declared(Kernel(), 16, 8, 128, "float32")
    assert _outside_declared(Kernel(), 16, 8, 128, "float16") is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "tinyserve"\n')
    assert _default_out_dir() == ".pagedkv-bench"
