"""The gate ships: the built wheel, installed with its ``testing`` extra into a fresh virtual
environment outside the checkout, gates a backend module there with one command
(``pytest --pyargs pagedkv.testing.suite --pagedkv-impl SPEC``): a correct candidate passes, one with
a planted tail bug fails with a case file that ``python -m pagedkv replay`` reruns.

The virtual environment gets the same torch as this one (``torch==<version>``, from the local wheel
cache on a CPU machine) and no access to the checkout: the test runs from a temporary directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

#: The nightly tier: installing torch and the wheel into a fresh environment is most of a minute and a half.
#: Every run pins what the wheel is built from (tests/repo/test_architecture.py: the package list, no top-level
#: ``strategies``) and runs the same gate from the checkout (tests/gate/test_impl_gate.py).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

CANDIDATE = textwrap.dedent('''
    """A backend written outside pagedkv: it validates with pagedkv's checks and moves data with torch."""
    import torch

    from pagedkv.validation.calls import check_gather, check_scatter, check_write_kv
    from pagedkv.backends import indexed as _reference

    name = "{name}"
    paged_attention = _reference.paged_attention


    def gather(cache, block_table, seq_len):
        table, seq_len = check_gather(cache, block_table, seq_len)
        pos = torch.arange(seq_len, device=cache.device)
        bs = cache.shape[1]
        out = cache[table[pos // bs], pos % bs]
        {fault}
        return out


    def scatter(cache, block_table, values, start=0):
        table, start, n = check_scatter(cache, block_table, values, start)
        pos = torch.arange(start, start + n, device=cache.device)
        cache[table[pos // cache.shape[1]], pos % cache.shape[1]] = values


    def write_kv(k_cache, v_cache, key, value, slot_mapping):
        slots = check_write_kv(k_cache, v_cache, key, value, slot_mapping)
        keep = slots >= 0
        bs = k_cache.shape[1]
        k_cache[slots[keep] // bs, slots[keep] % bs] = key[keep]
        v_cache[slots[keep] // bs, slots[keep] % bs] = value[keep]
    ''')
TAIL_BUG = "out[(seq_len // cache.shape[1]) * cache.shape[1]:] = 0  # the partial last block read as zeros"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def venv(venv_with_wheel) -> Path:
    """A fresh virtual environment with this one's torch version, then the wheel and its ``testing`` extra."""
    return venv_with_wheel("wheel-gate", first=(f"torch=={torch.__version__.split('+')[0]}",), extra="testing")


@pytest.fixture
def gate(venv, write_candidate):
    """``gate(work, name, fault, *options, profile="dev") -> (process, env)``: the documented command in the
    environment, run from ``work`` with the candidate's folder as its only import path beside the
    environment's own (``env``, for the replay)."""

    def run(work: Path, name: str, fault: str, *options: str, profile: str = "dev") -> tuple:
        work.mkdir()
        candidate = write_candidate(name, CANDIDATE.format(name=name, fault=fault))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDKV_", "PYTHONPATH"))}
        env.update(PYTHONPATH=str(candidate.path.parent), PAGEDKV_PROFILE=profile,
                   PAGEDKV_FAILURE_DIR=str(work / "failures"))
        return _run([str(venv), "-m", "pytest", "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", candidate.spec,
                     "-p", "no:cacheprovider", *options], cwd=work, env=env), env

    return run


def test_the_installed_gate_passes_a_correct_candidate(venv, gate, tmp_path):
    """Every property of the installed suite runs and passes (the smoke profile: a few examples each;
    the search itself is this checkout's suite's job)."""
    proc, _ = gate(tmp_path / "good", "good_kv", "", profile="smoke")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "implementation under test: good_kv" in out and " passed" in out and "failed" not in out
    assert "Hypothesis profile: smoke" in out or "Hypothesis profile: pagedkv-smoke" in out, out
    assert str(ROOT) not in _run([str(venv), "-c", "import pagedkv; print(pagedkv.__file__)"], cwd=tmp_path).stdout


def test_the_installed_gate_fails_a_planted_tail_bug_with_a_replayable_case_file(venv, gate, tmp_path):
    work = tmp_path / "bad"
    proc, env = gate(work, "tail_bug_kv", TAIL_BUG, "-x")  # stops at the first failure, as a user iterating would
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    files = sorted((work / "failures").glob("*test_gather_returns_exactly_what_each_slot_holds*.json"))
    assert files and "replay: python -m pagedkv replay" in out, out
    record = json.loads(files[0].read_text())
    assert record["backend"] == "tail_bug_kv" and record["outcome"] == "failed"
    assert record["check"] == "gather_returns_exactly_what_each_slot_holds"
    replay = _run([str(venv), "-m", "pagedkv", "replay", str(files[0]), "--impl", "tail_bug_kv"], cwd=work,
                  env=env)
    assert replay.returncode == 1 and "FAILS" in replay.stdout, replay.stdout + replay.stderr


def test_the_wheel_installs_only_pagedkv_so_a_users_strategies_package_wins(venv, tmp_path):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "__init__.py").write_text("OWNER = 'the user'\n")
    probe = ("import strategies, pagedkv.testing.strategies as ours; from importlib.metadata import distribution; "
             "print(strategies.OWNER); print(distribution('pagedkv').read_text('top_level.txt').split()); "
             "print(callable(ours.cases))")
    proc = _run([str(venv), "-c", probe], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["the user", "['pagedkv']", "True"], proc.stdout
