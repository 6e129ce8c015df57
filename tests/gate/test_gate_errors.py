"""The gate's usage errors: a wrong capabilities field is one line naming it and the known fields
(exit 4), a misspelled ``capabilities`` attribute is warned about, and a named candidate whose run
judged no conformance property fails with the command that runs the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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


def _pytest(pytester, *args):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", *args, timeout=300)
    return result, str(result.stdout), str(result.stderr)


def test_a_wrong_capabilities_field_is_a_one_line_usage_error(pytester, write_candidate):
    spec = write_candidate("bad_field", BAD_FIELD, attr="backend").spec
    result, out, err = _pytest(pytester, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "--co")
    assert result.ret == 4, out + err
    assert "INTERNALERROR" not in out + err
    assert "did you mean 'head_dims'?" in err and "block_sizes" in err, err


def test_a_misspelled_capabilities_attribute_is_warned_about(pytester, write_candidate):
    spec = write_candidate("misspelled", MISSPELLED, attr="backend").spec
    result, out, err = _pytest(pytester, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "--co", "-q")
    assert result.ret == 0, out + err
    assert "has 'capabilites': a misspelling?" in out, out


@pytest.mark.parametrize("how", ["env", "option"])
def test_a_named_candidate_with_no_property_judged_is_a_usage_error(pytester, monkeypatch, how):
    pytester.makepyfile(**{"tests/test_own": "def test_own():\n    assert True\n"})
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    args = ()
    if how == "env":
        monkeypatch.setenv("PAGEDKV_IMPL", "indexed")
    else:
        args = ("--pagedkv-impl", "indexed")
    result, out, err = _pytest(pytester, *args)
    assert result.ret == 4, out + err
    assert "1 passed" in out
    assert "pytest --pyargs pagedkv.testing.suite --pagedkv-impl indexed" in out, out


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


def gather(cache, block_table, seq_len):  # two bugs the explicit examples (block sizes 4 and 128) miss,
    if cache.shape[1] not in (4, 128) and seq_len == 0:  # next to each other: the shrinker meets both
        raise RuntimeError("this block size is not supported here")
    out = indexed.gather(cache, block_table, seq_len)
    if cache.shape[1] not in (4, 128) and seq_len >= 1:
        out = out.clone()
        out[0] = 0.0  # a wrong value at position 0
    return out
"""


NO_LOCAL_CONSTANTS = """
from hypothesis.internal.conjecture import providers

providers._get_local_constants = providers.Constants
"""


def test_two_distinct_failures_get_two_case_files_that_each_replay_to_their_own(pytester, write_candidate,
                                                                                 monkeypatch):
    spec = write_candidate("two_bugs", TWO_BUGS).spec
    # one search whatever the repository's modules hold: without the constants Hypothesis harvests from local
    # (here, editable) modules, whose every new literal would move it (a user's installed wheel has none)
    pytester.makeconftest(NO_LOCAL_CONSTANTS)
    monkeypatch.setenv("PAGEDKV_PROFILE", "ci")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "f"))
    result, out, _ = _pytest(pytester, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-k",
                             "gather_returns_exactly")
    assert result.ret == 1, out[-3000:]
    files = sorted((pytester.path / "f").glob("*.json"))
    assert len(files) == 2, (files, out[-3000:])
    replays = set(re.findall(r"replay: python -m pagedkv replay \S+", out))  # CI repeats them in the summary
    assert len(replays) == 2, out[-3000:]
    verdicts = set()
    for path in files:
        replay = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(path), "--impl", spec],
                                env=os.environ, capture_output=True, text=True, timeout=300)
        assert replay.returncode == 1, replay.stdout
        verdicts.add("RuntimeError" in replay.stdout)
    assert verdicts == {True, False}  # one replays to the exception, the other to the wrong value


def test_a_candidate_in_the_working_directory_but_off_sys_path_is_explained(tmp_path, monkeypatch):
    """The pytest console script leaves the working directory off ``sys.path``: a user's package sitting there
    does not import, and the error says why and how to fix it (a user trial of the wheel hit exactly this; a
    module missing altogether gets no such hint)."""
    from pagedkv.backends import load_backend
    from pagedkv.errors import BackendError

    (tmp_path / "myengine").mkdir()
    (tmp_path / "myengine" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(BackendError, match=r"'myengine' is in the working directory.*pythonpath = \[\"\.\"\]"):
        load_backend("myengine.kv:backend")
    with pytest.raises(BackendError) as missing:
        load_backend("nosuchengine.kv:backend")
    assert "working directory" not in str(missing.value)


def test_a_spec_naming_the_cache_manager_factory_itself_says_where_to_point(write_candidate):
    """``--pagedkv-impl mine:cache_manager`` names the factory the machine calls with a ``ManagerConfig``; loaded as
    a backend it is called with no arguments. The error says to point the spec at the module that holds it."""
    from pagedkv.backends import load_backend
    from pagedkv.errors import BackendError

    candidate = write_candidate("my_manager_engine", """
        def cache_manager(config):
            raise AssertionError("never built here")
        """, attr="cache_manager")
    with pytest.raises(BackendError, match=r"point the spec at what holds it \('my_manager_engine'"):
        load_backend(candidate.spec)


def test_a_candidate_that_does_not_load_leaves_a_verdict_saying_why(pytester):
    """A run refused before any test (exit 4: the named candidate does not import) replaces an earlier green
    verdict with one that did not pass, carrying its exit status and the reason, not "unfinished"."""
    report = pytester.path / "out" / "verdict.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"passed": True}))  # an earlier run's green verdict
    result, out, err = _pytest(pytester, "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", "no_such_engine.kv",
                               f"--pagedkv-report-json={report}")
    assert result.ret == 4, out + err
    verdict = json.loads(report.read_text())
    assert verdict["passed"] is False and verdict["exit_status"] == 4 and "unfinished" not in verdict, verdict
    assert "no_such_engine" in verdict["usage_error"], verdict


def test_a_report_path_given_with_a_space_that_moves_the_rootdir_is_explained(tmp_path):
    """``--pagedkv-report-json FILE`` with FILE existing outside the repository: pytest reads FILE as a test path
    before it knows the option, chooses a rootdir above the repository and leaves its ``pythonpath`` out, so the
    candidate does not import. The error says so and how to write it; with ``=`` the same run loads it (a user
    trial hit this rerunning a gate whose verdict file was there from the run before)."""
    repo = tmp_path / "repo"
    (repo / "myengine").mkdir(parents=True)
    (repo / "myengine" / "__init__.py").write_text("")
    (repo / "myengine" / "kv.py").write_text("from pagedkv import get_backend\n\nbackend = get_backend('indexed')\n")
    (repo / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    (tmp_path / "verdict.json").write_text("{}")  # the run before's verdict
    base = [sys.executable, "-P", "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl",
            "myengine.kv:backend", "-p", "no:cacheprovider", "-p", "no:xdist", "--co", "-q"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDKV_IMPL")}
    spaced = subprocess.run([*base, "--pagedkv-report-json", "../verdict.json"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=300)
    assert spaced.returncode == 4, spaced.stdout + spaced.stderr
    assert "cannot import backend module 'myengine.kv'" in spaced.stderr, spaced.stderr
    assert "write it with '=' (--pagedkv-report-json=FILE)" in spaced.stderr, spaced.stderr
    joined = subprocess.run([*base, "--pagedkv-report-json=../verdict.json"], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=300)
    assert joined.returncode == 0, joined.stdout + joined.stderr
