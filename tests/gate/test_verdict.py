"""The machine-readable verdict and declared non-promises, through a nested pytest run of the suite.

A candidate that does not promise a property declares it with the reason; the property still runs,
its failure is a finding (``XFAIL``) with its case file and the reason, listed in the summary and the
JSON verdict, and the run passes. A property it promises and fails is a failure in the JSON verdict with
its case file and replay command. An unknown property name is a usage error naming the known ones.
"""

import json
import textwrap
from pathlib import Path

import pytest


PROPERTY = "paged_attention_matches_fp64_dense_reference"
PROMISED = "a_request_alone_equals_the_same_request_in_a_batch"

#: A plain-torch attention whose outputs are scaled by ``1 + 0.01 * batch size``: it fails the reference
#: property (declared not promised) and the alone-equals-batched one (promised) at once.
CANDIDATE = textwrap.dedent('''
    import torch

    from pagedkv.backends.capabilities import Capabilities

    name = "scaled_attention"
    capabilities = Capabilities(dtypes={{"float32"}}, non_promises={non_promises!r})


    def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        bs = k_cache.shape[1]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = torch.zeros_like(query)
        qsl = query_start_loc.tolist()
        for b, n in enumerate(seq_lens.tolist()):
            q = query[qsl[b]:qsl[b + 1]]
            if q.shape[0] == 0:
                continue
            pos = torch.arange(n)
            table = block_tables[b].long()
            k = k_cache[table[pos // bs], pos % bs].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            v = v_cache[table[pos // bs], pos % bs].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
            logits = torch.einsum("qhd,khd->hqk", q, k) * scale
            rows = torch.arange(q.shape[0]).unsqueeze(1) + (n - q.shape[0])
            logits = logits.masked_fill(pos.unsqueeze(0) > rows, float("-inf"))
            out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v) * (1 + 0.01 * len(qsl))
        return out
    ''')


def test_a_non_promise_is_a_finding_and_a_promise_a_failure_in_the_json_verdict(pytester, monkeypatch):
    reason = "outputs are scaled by the batch size on purpose"
    pytester.makepyfile(candidate=CANDIDATE.format(non_promises={PROPERTY: reason}))
    pytester.makeini("[pytest]\npagedkv_report_json = out/verdict.json\n")
    monkeypatch.setenv("PAGEDKV_PROFILE", "smoke")
    monkeypatch.setenv("PAGEDKV_DEVICE", "cpu")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_subprocess(
        "--pyargs", "pagedkv.testing.suite", "--pagedkv-impl", str(pytester.path / "candidate.py"),
        "-k", f"test_{PROPERTY} or test_{PROMISED}", "-p", "no:cacheprovider", "-p", "no:xdist", "-rsx")
    assert result.ret == 1, result.stdout.str()
    result.stdout.fnmatch_lines(["*2 properties judged (1 failing) of 2 its ops allow (100%); 1 findings*",
                                 f"*finding on {PROPERTY} (declared non-promise: {reason})*",
                                 f"*XFAIL*finding (declared non-promise: {reason})*"])
    verdict = json.loads((pytester.path / "out" / "verdict.json").read_text())
    assert verdict["schema"] == "pagedkv-verdict/1" and verdict["passed"] is False and verdict["exit_status"] == 1
    (candidate,) = verdict["candidates"]
    assert candidate["declared_space"]["non_promises"] == {PROPERTY: reason}
    assert candidate["counts"] == {"judged": 2, "failed": 1, "findings": 1, "skipped": 0, "applicable": 2,
                                   "judged_fraction": 1.0}
    (finding,) = candidate["findings"]
    assert finding["property"] == PROPERTY and finding["non_promise"] == reason
    (failed,) = candidate["failed"]
    assert failed["property"] == PROMISED and failed["message"]
    for entry in (finding, failed):
        (failure,) = entry["failures"]
        assert Path(failure["case_file"]).is_file() and failure["case_file"] in failure["replay"]
        assert failure["replay"].startswith("python -m pagedkv replay ")
        # replayed in a fresh process when the verdict is written: the deterministic fault fails again
        assert (failure["reproduced"], failure["replay_status"]) == (True, 1), failure


def test_an_unknown_non_promise_names_the_known_properties():
    from pagedkv.backends.capabilities import Capabilities
    from pagedkv.testing.non_promises import check_non_promises

    check_non_promises(Capabilities(non_promises={PROPERTY: "by design"}))
    with pytest.raises(ValueError, match=r"unknown property \['alone_equals_batched'\]; known: .*"
                                         "a_request_alone_equals_the_same_request_in_a_batch"):
        check_non_promises(Capabilities(non_promises={"alone_equals_batched": "not batch invariant"}))


def test_a_non_promise_needs_a_reason():
    from pagedkv.backends.capabilities import Capabilities

    with pytest.raises(ValueError, match="give the reason"):
        Capabilities(non_promises={PROPERTY: ""})
    caps = Capabilities(non_promises={PROPERTY: "by design"})
    assert caps.non_promise(PROPERTY) == "by design" and caps.non_promise("other") is None
    assert hash(caps) == hash(Capabilities(non_promises=[(PROPERTY, "by design")]))


def test_a_profile_the_project_loaded_is_kept_over_pagedkv_profile(monkeypatch):
    """``$PAGEDKV_PROFILE`` does not replace a profile the project loaded (the name says it was not
    applied); ``--hypothesis-profile`` does; with no profile of the project's, ``$PAGEDKV_PROFILE`` applies."""
    from hypothesis import settings

    from pagedkv.testing.settings import choose_profile

    before = settings.get_current_profile_name()
    settings.register_profile("the-projects-own", max_examples=7)
    try:
        monkeypatch.setenv("PAGEDKV_PROFILE", "smoke")
        settings.load_profile("the-projects-own")
        name = choose_profile()
        assert name.startswith("the-projects-own (the project's own, left as it is; PAGEDKV_PROFILE=smoke not "
                               "applied: pass --hypothesis-profile=pagedkv-smoke"), name
        assert settings.default.max_examples == 7
        assert choose_profile("pagedkv-smoke") == "pagedkv-smoke"
        settings.load_profile("default")
        assert choose_profile() == "pagedkv-smoke" and settings.default.max_examples == 5
    finally:
        settings.load_profile(before)
