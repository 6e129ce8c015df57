"""The gate's usage errors: a wrong capabilities field is one line naming it and the known fields
(exit 4), a misspelled ``capabilities`` attribute is warned about, and a named candidate whose run
judged no conformance property fails with the command that runs the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

BAD_FIELD = """
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities
class Backend:
    name = "bad_field"
    capabilities = Capabilities(head_dim=(64,))
    write_kv = staticmethod(indexed.write_kv)
backend = Backend()
"""
MISSPELLED = """
from pagedkv.backends import indexed
from pagedkv.backends.capabilities import Capabilities, Sizes
class Backend:
    name = "misspelled"
    capabilites = Capabilities(head_dims=Sizes(values={64}))
    write_kv = staticmethod(indexed.write_kv)
backend = Backend()
"""


def _pytest(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), **(env or {})})


def test_a_wrong_capabilities_field_is_a_one_line_usage_error(tmp_path):
    (tmp_path / "bad_field.py").write_text(textwrap.dedent(BAD_FIELD))
    proc = _pytest(tmp_path, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "bad_field:backend", "--co")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "INTERNALERROR" not in proc.stdout + proc.stderr
    assert "did you mean 'head_dims'?" in proc.stderr and "block_sizes" in proc.stderr, proc.stderr


def test_a_misspelled_capabilities_attribute_is_warned_about(tmp_path):
    (tmp_path / "misspelled.py").write_text(textwrap.dedent(MISSPELLED))
    proc = _pytest(tmp_path, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "misspelled:backend", "--co",
                   "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has 'capabilites': a misspelling?" in proc.stdout, proc.stdout


@pytest.mark.parametrize("how", ["env", "option"])
def test_a_named_candidate_with_no_property_judged_is_a_usage_error(tmp_path, how):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_own.py").write_text("def test_own():\n    assert True\n")
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    args, env = ((), {"PAGEDKV_IMPL": "indexed"}) if how == "env" else (("--pagedkv-impl", "indexed"), {})
    proc = _pytest(tmp_path, *args, env=env)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "pytest --pyargs pagedkv.testing.suite --pagedkv-impl indexed" in proc.stdout, proc.stdout


def test_the_console_script_names_itself_and_finds_candidates_in_the_working_directory(tmp_path):
    import shutil

    script = shutil.which("pagedkv")
    if script is None:
        pytest.skip("the pagedkv console script is not installed here")
    assert subprocess.run([script, "--help"], capture_output=True, text=True).stdout.startswith("usage: pagedkv ")
    (tmp_path / "local_kv.py").write_text("from pagedkv.backends.indexed import *  # noqa: F403\n"
                                          "from pagedkv.backends.indexed import name  # noqa: F401\n")
    from pagedkv.testing.cases import Case, Geometry, SeqSpec
    from pagedkv.testing.casefiles.writing import save_failure

    path = save_failure("gather_returns_exactly_what_each_slot_holds", "local_kv",
                        Case(Geometry(4, 2), (SeqSpec((1, 3), 3),)), path=tmp_path / "case.json")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([script, "replay", str(path), "--impl", "local_kv"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PASSES" in proc.stdout, proc.stdout + proc.stderr


TWO_BUGS = """
import torch
from pagedkv.backends import indexed

name = "two_bugs"


def gather(cache, block_table, seq_len):  # two bugs the explicit examples (block sizes 4 and 128) miss
    if cache.shape[1] in (3, 7) or (cache.shape[1] in (1, 2, 5) and seq_len == 0):  # next to the wrong value:
        raise RuntimeError("this block size is not supported here")  # the shrinker meets both
    out = indexed.gather(cache, block_table, seq_len)
    if cache.shape[1] in (1, 2, 5) and seq_len >= 1:
        out = out.clone()
        out[0] = 0.0  # a wrong value at position 0
    return out
"""


def test_two_distinct_failures_get_two_case_files_that_each_replay_to_their_own(tmp_path):
    (tmp_path / "two_bugs.py").write_text(textwrap.dedent(TWO_BUGS))
    proc = _pytest(tmp_path, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "two_bugs", "-k",
                   "gather_returns_exactly", env={"PAGEDKV_PROFILE": "ci", "PAGEDKV_FAILURE_DIR": str(tmp_path / "f")})
    assert proc.returncode == 1, proc.stdout[-3000:]
    files = sorted((tmp_path / "f").glob("*.json"))
    assert len(files) == 2, (files, proc.stdout[-3000:])
    replays = set(re.findall(r"replay: python -m pagedkv replay \S+", proc.stdout))  # CI repeats them in the summary
    assert len(replays) == 2, proc.stdout[-3000:]
    verdicts = set()
    for path in files:
        replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--impl", "two_bugs"],
                                cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                                text=True, timeout=300)
        assert replay.returncode == 1, replay.stdout
        verdicts.add("RuntimeError" in replay.stdout)
    assert verdicts == {True, False}  # one replays to the exception, the other to the wrong value
