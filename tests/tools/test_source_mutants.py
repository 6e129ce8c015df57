"""Generated source mutants: the operators, loading a mutant in a child, and the kill-rate runner end to end."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

import pytest

from pagedkv.tools.mutants.kill_rate_tables import counts, line_table
from pagedkv.tools.mutants.generate import BOOTSTRAP, OPERATORS, generate, module_name_for, sample

KERNEL = '''\
import torch


def kernel(x, pos, stride_a, stride_b, n, scale=0.5):
    """A docstring with a < b that is never mutated."""
    mask = (pos < n) & (pos >= 0)
    blk = pos // 4 + 1
    off = blk * stride_a + (pos % 4) * stride_b
    s = torch.where(mask, x * scale, float("-inf"))
    m = torch.maximum(s, torch.zeros_like(s)).to(torch.float32)
    idx = off.to(torch.int64)
    keep = n > 0  # pragma: no mutate
    return m * 1.4426950408889634, idx, x.shape[0], keep
'''


def _kinds(mutants):
    return {m.operator for m in mutants}


def test_generator_produces_every_operator_kind_and_only_valid_line_preserving_mutants(tmp_path):
    path = tmp_path / "kern.py"
    path.write_text(KERNEL)
    mutants = generate(path, module="kern")
    assert _kinds(mutants) == set(OPERATORS)
    lines = KERNEL.splitlines()
    for m in mutants:
        text = m.mutated_source()
        ast.parse(text)
        new_lines = text.splitlines()
        assert len(new_lines) == len(lines)
        changed = [i + 1 for i, (a, b) in enumerate(zip(lines, new_lines)) if a != b]
        assert changed == [m.line], m.diff  # one line, the reported one; every other line byte-identical
        assert m.line not in (4, 5, 12), m.diff  # signature defaults, docstring, pragma line
    diffs = {m.diff for m in mutants}
    for expected in ("(pos < n)  ->  (pos <= n)", "pos // 4 + 1  ->  pos // 4", 'float("-inf")  ->  -1e30',
                     "torch.int64  ->  torch.int32", "stride_a  ->  stride_b", "1.4426950408889634  ->  1.0"):
        assert any(expected.split("  ->  ")[1] in d and expected.split("  ->  ")[0] in d for d in diffs), expected
    guards = [m for m in mutants if m.operator == "guard" and m.line == 9]
    assert {g.replacement for g in guards} == {"(x * scale)", 'float("-inf")'}
    assert len({m.id for m in mutants}) == len(mutants)
    picked = sample(mutants, 8, seed=3)
    assert len(picked) == 8 and _kinds(picked) == set(OPERATORS)  # one of each kind before any twice
    assert sample(mutants, 8, seed=3) == picked


def test_a_mutant_loads_in_a_child_under_the_original_name_and_changes_behaviour(tmp_path):
    pkg = tmp_path / "mutpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kern.py").write_text("def below(x, n):\n    return x < n\n")
    assert module_name_for(pkg / "kern.py") == "mutpkg.kern"
    (m,) = [m for m in generate(pkg / "kern.py") if m.operator == "boundary"]
    mutated = tmp_path / "scratch" / "kern.py"
    mutated.parent.mkdir()
    mutated.write_text(m.mutated_source())
    probe = textwrap.dedent(f"""
        import inspect, sys
        if sys.argv[1] == "mutant":
            install_mutant("mutpkg.kern", {str(mutated)!r}, {str(pkg / 'kern.py')!r})
        import mutpkg.kern as k
        print(k.below(3, 3), k.__file__ == {str(mutated)!r}, "<=" in inspect.getsource(k.below))
    """)
    out = {mode: subprocess.run([sys.executable, "-c", BOOTSTRAP + probe, mode], cwd=tmp_path, capture_output=True,
                                text=True, check=True).stdout.split() for mode in ("original", "mutant")}
    assert out == {"original": ["False", "False", "False"], "mutant": ["True", "True", "True"]}
    assert (pkg / "kern.py").read_text() == "def below(x, n):\n    return x < n\n"  # never edited


TINY = '''\
import torch

from pagedkv.validation.calls import check_gather

name = "tiny"


def gather(cache, block_table, seq_len, validate=True):
    table, seq_len = check_gather(cache, block_table, seq_len)
    pos = torch.arange(max(seq_len, 0), device=cache.device)
    bs = cache.shape[1]
    return cache[table[pos // bs], pos % bs]
'''

CRASHY = '''\
import os
import signal

name = "crashy"


def gather(cache, block_table, seq_len, validate=True):
    os.kill(os.getpid(), signal.SIGSEGV)
'''


@pytest.mark.slow  # the kill-rate runner end to end in child processes; .github/workflows/mutation.yml runs it nightly
def test_kill_rates_kill_a_planted_mutant_in_k_of_n_and_report_an_equivalent_survivor(tmp_path, monkeypatch):
    from pagedkv.cli import main

    pkg = tmp_path / "tinypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.py").write_text(TINY)
    (pkg / "crashy.py").write_text(CRASHY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    mutants = generate(pkg / "tiny.py")
    (planted,) = [m for m in mutants if m.line == 12 and m.operator == "index" and "table[pos % bs]" in m.after]
    (equivalent,) = [m for m in mutants if m.line == 10 and m.operator == "guard" and m.replacement == "seq_len"]
    report = tmp_path / "report.json"
    status = main(["mutate", "--impl", "tinypkg.tiny", "--source", "tinypkg/tiny.py", "--only", planted.id,
                   equivalent.id, "--variants", "tinypkg.crashy", "--seeds", "3", "--no-explicit-examples",
                   "--properties", "gather_returns_exactly_what_each_slot_holds", "--no-baseline",
                   "--budget-s", "60", "--case-dir", str(tmp_path / "cases"), "--json", str(report),
                   "--equivalent", f"{equivalent.id}=validated seq_len is never negative"])
    data = json.loads(report.read_text())
    rows = {r["id"]: r for r in data["mutants"]}
    assert status == 0  # the only survivor is marked equivalent
    killed = rows[planted.id]
    assert killed["status"] == "killed" and killed["generated_killed"] == killed["generated_runs"] == 3
    assert killed["first_property"] == "gather_returns_exactly_what_each_slot_holds"
    assert json.loads(open(killed["case_file"]).read())["check"] == killed["first_property"]
    survivor = rows[equivalent.id]
    assert survivor["status"] == "equivalent" and survivor["generated_killed"] == 0
    assert survivor["mutant_loaded"] and killed["mutant_loaded"]  # the backend ran the mutated file
    assert survivor["generated_runs"] == 3 and survivor["note"] == "validated seq_len is never negative"
    crashy = rows["tinypkg.crashy"]  # each seed's run is forked: every crash ends one run, and the next seed runs
    assert crashy["status"] == "crashed" and crashy["note"] == "signal 11 in 3 of 3 runs"
    assert crashy["generated_killed"] == crashy["generated_runs"] == 3
    assert crashy["first_property"] == "gather_returns_exactly_what_each_slot_holds"
    kept = json.loads(open(crashy["case_file"]).read())  # the case each crashed run was running
    assert kept["check"] == crashy["first_property"] and kept["outcome"] == "running"
    assert counts(list(rows.values()))["killed"] == 2
    (line10,) = [e for e in line_table(list(rows.values())) if e["line"] == 10]
    assert line10["pinned"] and line10["equivalent"][0]["id"] == equivalent.id


@pytest.mark.parametrize("bad", ["no_equals", "id="])
def test_an_equivalent_mark_needs_its_argument(bad, capsys):
    from pagedkv.cli import main

    with pytest.raises(SystemExit, match="ID=WHY"):
        main(["mutate", "--equivalent", bad.replace("no_equals", "x-0001")])


def test_an_earlier_report_rerenders_with_new_equivalence_arguments_and_runs_nothing(tmp_path):
    from pagedkv.cli import main

    survivor, killed = ("k-0001", "survived"), ("k-0002", "killed")
    rows = [{"id": i, "kind": "source", "operator": "boundary", "file": "k.py", "line": n, "function": "f",
             "before": "a < b", "after": "a <= b", "diff": "a < b -> a <= b", "status": status, "note": "",
             "wall_s": 1.0, "budget_spent": False, "explicit_killed": 0, "explicit_runs": 0, "explicit_partial": 0,
             "generated_killed": int(status == "killed"), "generated_runs": 1, "generated_partial": 0,
             "median_examples": None, "median_seconds": None, "first_property": "", "case_file": "", "error": "",
             "runs": []} for n, (i, status) in enumerate((survivor, killed), start=1)]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"config": {"impl": "k"}, "mutants": rows}))
    out = tmp_path / "out.json"
    argue = ["--equivalent", "k-0001=only on ROCm", "--equivalent", "k-0002=wrong"]
    assert main(["mutate", "--from-json", str(earlier), "--json", str(out), *argue]) == 0
    got = {r["id"]: r for r in json.loads(out.read_text())["mutants"]}
    assert got["k-0001"]["status"] == "equivalent" and got["k-0001"]["note"] == "only on ROCm"
    assert got["k-0002"]["status"] == "killed" and "the argument is wrong" in got["k-0002"]["note"]
    assert main(["mutate", "--from-json", str(earlier), "--json", str(out)]) == 1  # the survivor stands
    not_a_report = tmp_path / "bad.json"
    not_a_report.write_text("[]")
    with pytest.raises(SystemExit, match="not a report"):
        main(["mutate", "--from-json", str(not_a_report)])


def test_a_mutant_of_a_file_that_changed_since_generation_is_refused(tmp_path):
    src = tmp_path / "kernel.py"
    src.write_text("def f(x):\n    return x + 1\n")
    mutant = generate(src)[0]
    mutated = mutant.mutated_source()
    assert mutated != src.read_text() and len(mutated.splitlines()) == 2
    src.write_text('def f(x):\n    """A docstring line shifts every offset."""\n    return x + 1\n')
    with pytest.raises(ValueError, match="changed since mutant"):
        mutant.mutated_source()


def test_a_kill_rate_run_draws_what_the_suite_draws_under_the_same_profile(tmp_path, monkeypatch):
    """The runner hands the execution core the profile's count; the property's cap and the interpreter's
    (a tenth of the profile's count: 10 under ``ci``) are applied there, once, as in the suite."""
    from pagedkv.backends import get_backend
    from pagedkv.testing import space
    from pagedkv.testing.registry import properties
    from pagedkv.tools.mutants.kill_rates import _one_run

    monkeypatch.setattr(space, "interpreted", lambda backend: True)  # as if Triton interpreted the backend
    backend, name = get_backend("indexed"), "gather_returns_exactly_what_each_slot_holds"
    ctx = {"backend": backend, "caps": space.capabilities_under_test(backend, for_drawing=True),
           "props": properties(), "limit": 100, "case_dir": tmp_path, "running": tmp_path / "running.json",
           "workdir": tmp_path, "deadline": None, "saved": {True: False, False: False}}
    job = {"id": "baseline", "impl": "indexed", "device": "cpu", "properties": [name]}
    run = _one_run(job, 0, False, ctx, on_property=lambda name: None)
    assert not run["killed"] and run["examples"] == space.example_cap([backend], 100) == 10
