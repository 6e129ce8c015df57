"""The conformance suite gates any implementation: a backend module written outside the project, named
with ``PAGEDKV_IMPL``, runs under the same properties from another directory
(``pytest --pyargs pagedkv.testing.suite``); one missing an op gets those tests skipped with a reason
naming the op; a broken signature is a usage error."""

import textwrap

import pytest

SELECT = ["--pyargs", "pagedkv.testing.suite", "-k",
          "test_gather_returns_exactly_what_each_slot_holds or test_paged_attention_matches_fp64_dense_reference"]

CANDIDATE = textwrap.dedent('''
    """A candidate written from scratch: pure torch, no pagedkv import."""
    import math

    import torch

    name = "{name}"


    def gather(cache, block_table, seq_len):
        table = torch.as_tensor(block_table, dtype=torch.int64, device=cache.device)
        pos = torch.arange(seq_len, device=cache.device)
        return cache[table[pos // cache.shape[1]], pos % cache.shape[1]]
    ''')

ATTENTION = textwrap.dedent('''

    def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
        out = torch.empty_like(query)
        qsl = query_start_loc.tolist()
        for b, n in enumerate(seq_lens.tolist()):
            q = query[qsl[b]:qsl[b + 1]].float()
            if q.shape[0] == 0:
                continue
            group = q.shape[1] // k_cache.shape[2]
            k = gather(k_cache, block_tables[b], n).float().repeat_interleave(group, 1)
            v = gather(v_cache, block_tables[b], n).float().repeat_interleave(group, 1)
            logits = torch.einsum("qhd,khd->hqk", q, k) * scale
            rows = torch.arange(q.shape[0]).unsqueeze(1) + (n - q.shape[0])
            logits = logits.masked_fill(torch.arange(n).unsqueeze(0) > rows, float("-inf"))
            out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).to(query.dtype)
        return out
    ''')


@pytest.fixture
def gate(pytester, write_candidate, monkeypatch):
    """``gate(module, source) -> (exit status, output)``: the suite's gather and attention properties over
    a module written outside the project and named with ``$PAGEDKV_IMPL``, run from another directory."""
    monkeypatch.setenv("PAGEDKV_PROFILE", "ci")
    monkeypatch.setenv("PAGEDKV_DEVICE", "cpu")
    monkeypatch.setenv("PAGEDKV_FAILURE_DIR", str(pytester.path / "failures"))

    def run(module: str, source: str):
        monkeypatch.setenv("PAGEDKV_IMPL", write_candidate(module, source).spec)
        result = pytester.runpytest_subprocess(*SELECT, "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                                               "-W", "ignore::pytest.PytestAssertRewriteWarning", timeout=600)
        return result.ret, str(result.stdout) + str(result.stderr)

    return run


def test_a_candidate_outside_the_project_runs_and_passes(gate):
    status, out = gate("outside_candidate", CANDIDATE.format(name="outside_candidate") + ATTENTION)
    assert status == 0, out
    assert "2 passed" in out and "[outside_candidate" not in out.split("passed")[-1]


def test_a_candidate_missing_paged_attention_has_those_tests_skipped_naming_the_op(gate):
    status, out = gate("gather_only_candidate", CANDIDATE.format(name="gather_only_candidate"))
    assert status == 0, out
    assert "1 passed, 1 skipped" in out, out
    skip_lines = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skip_lines) == 1 and "'paged_attention'" in skip_lines[0], out


def test_a_broken_signature_is_a_usage_error_naming_the_op(gate):
    source = CANDIDATE.format(name="bad_signature") + "\n\ndef write_kv(k_cache, v_cache, key, value):\n    pass\n"
    status, out = gate("bad_signature", source)
    assert status == 4, out  # pytest's usage-error status
    assert "write_kv" in out and "slot_mapping" in out, out
