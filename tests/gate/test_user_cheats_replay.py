"""Cheats written as a user's own module (loaded with ``--pagedkv-impl``, so replay needs ``--impl``) are
caught by the gate, and every case file the gate writes, replayed exactly as the gate prints the command,
is a failure (``FAILS``, exit 1) or says it did not reproduce (exit 3): never ``PASSES``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

USER_CHEATS = """
import torch

from pagedkv.backends import indexed

name = "user_cheats"


class RightFirstCalls:
    '''Right for the first 40 attention calls of the process, then every output shifted.'''
    name = "right_first_calls"
    calls = 0

    def paged_attention(self, query, *args, **kwargs):
        RightFirstCalls.calls += 1
        out = indexed.paged_attention(query, *args, **kwargs)
        return out if RightFirstCalls.calls <= 40 else out + 0.25


class RareUlpNoise:
    '''One output element one ulp off on about one call in eight (a rare race).'''
    name = "rare_ulp_noise"

    def paged_attention(self, query, *args, **kwargs):
        out = indexed.paged_attention(query, *args, **kwargs)
        if out.numel() and torch.rand(()) < 0.125:
            flat = out.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=out.dtype))
        return out


right_first_calls, rare_ulp_noise = RightFirstCalls(), RareUlpNoise()
"""


def _replay_as_printed(line: str) -> tuple[int, str]:
    """Run a replay command as the gate printed it; ``(exit status, stdout)``, asserting it is no PASSES."""
    argv = shlex.split(line)
    proc = subprocess.run([sys.executable, *argv[1:]], env=os.environ, capture_output=True, text=True, timeout=600)
    verdict = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    assert "PASSES" not in proc.stdout, f"{line}\n{proc.stdout}"
    assert proc.returncode in (1, 3), f"{line}\nexit {proc.returncode}: {verdict}\n{proc.stderr[-2000:]}"
    return proc.returncode, proc.stdout


@pytest.mark.parametrize("attr", ["right_first_calls", "rare_ulp_noise"])
def test_a_user_module_cheats_case_file_replayed_as_printed_is_no_pass(attr, write_candidate, tmp_path,
                                                                     record_property):
    # the gate's core in this process, over two properties (the cheat's calls cross them), the module loaded as
    # the user's; the replay in a fresh process, exactly as printed (with --impl: the trust rule)
    from pagedkv.backends import load_backend
    from pagedkv.testing import execute
    from pagedkv.testing.registry import properties
    from pagedkv.testing.settings import mutant_settings

    spec = write_candidate(f"user_cheats_{attr}", USER_CHEATS).spec + f":{attr}"
    backend = load_backend(spec)
    failed = None
    for name in ("a_request_alone_equals_the_same_request_in_a_batch", "paged_attention_matches_fp64_dense_reference"):
        outcome = execute.run(properties()[name], (backend,), "cpu", mutant_settings("dev", shrink=False), spec=spec,
                              case_file=tmp_path / f"{name}.json")
        if outcome.failed:
            failed = outcome.failures[0]
            break
    assert failed is not None and failed.replay.endswith(f"--impl {spec}"), attr
    status, out = _replay_as_printed(failed.replay)
    record_property("replay", f"exit {status}: {out.strip().splitlines()[-1]}")


def _gate(pytester, spec: str, folder):
    result = pytester.runpytest_subprocess(
        "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", spec, "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "-k", "paged_attention_matches_fp64 or alone_equals or batch_order", timeout=600)
    return str(result.stdout) + str(result.stderr), result.ret


@pytest.mark.slow  # two gate runs in subprocesses and a replay each (2 min on 2 cores); the in-process test above
def test_user_module_cheats_are_caught_and_their_case_files_never_replay_as_passes(pytester, write_candidate,
                                                                                 monkeypatch):
    write_candidate("user_cheats", USER_CHEATS)
    monkeypatch.setenv("PAGEDKV_PROFILE", "dev")
    replays = []
    for attr in ("right_first_calls", "rare_ulp_noise"):
        folder = pytester.path / f"failures-{attr}"
        monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(folder))
        out, status = _gate(pytester, f"user_cheats:{attr}", folder)
        assert status == 1, out[-3000:]
        printed = re.findall(r"replay: (python -m pagedkv replay \S+\.json[^\n]*)", out)
        assert printed and all(f"--impl user_cheats:{attr}" in line for line in printed), out[-3000:]
        replays += printed
    for line in replays:
        _replay_as_printed(line)
