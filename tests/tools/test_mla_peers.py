"""The MLA decode and merge peers (pagedkv.tools.peers.mla) against a float64 definition, on small fixed cases.

Each skips with the install recipe where vLLM or SGLang is missing. The kernels run in Triton's
interpreter here, so the per-push cases are few; the ``slow`` test draws more shapes and split counts.
What the whole suite finds on them is ``docs/peers.md``'s.
"""

import pytest
import torch

from pagedkv.errors import BackendUnavailableError, ShapeError
from pagedkv.tools import peers

DECODE_PEERS = ["vllm_triton_decode", "sglang_triton_decode"]


def _peer(name):
    try:
        return peers.PEERS[name]()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


def attention_fp64(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Causal paged attention in float64, bottom-right aligned: ``(out [total_q, H, head_dim_v], lse [total_q, H])``,
    natural-log LSE; a query sees the first ``seq_len - q_len + i + 1`` keys of its sequence."""
    total_q, heads = query.shape[:2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(total_q, heads, v_cache.shape[3], dtype=torch.float64)
    lse = torch.full((total_q, heads), float("-inf"), dtype=torch.float64)
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = int(query_start_loc[b]), int(query_start_loc[b + 1])
        pos = torch.arange(seq_len)
        blocks = block_tables[b, pos // block_size]
        keys = k_cache[blocks, pos % block_size].double().repeat_interleave(heads // kv_heads, 1)
        values = v_cache[blocks, pos % block_size].double().repeat_interleave(heads // kv_heads, 1)
        for i in range(hi - lo):
            n = seq_len - (hi - lo) + i + 1
            logits = torch.einsum("hd,lhd->hl", query[lo + i].double(), keys[:n]) * scale
            lse[lo + i] = torch.logsumexp(logits, -1)
            out[lo + i] = torch.einsum("hl,lhd->hd", torch.softmax(logits, -1), values[:n])
    return out, lse


def _case(mla, heads, kv_heads, head_dim, head_dim_v, seed=0, block_size=4, dtype=torch.float32):
    """Two sequences over a shuffled pool (one spare block): a decode at position 9 and a 3-token prefill over
    8 cached tokens."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-11 // block_size)
    tables = torch.randperm(2 * width + 1, generator=gen)[: 2 * width].view(2, width)
    k_cache = torch.randn(2 * width + 1, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = k_cache[..., :head_dim_v] if mla else torch.randn(k_cache.shape[:3] + (head_dim_v,),
                                                                generator=gen).to(dtype)
    query = torch.randn(4, heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor([10, 11]), torch.tensor([0, 1, 4]), head_dim ** -0.5


SHAPES = {"mla_576_512": (True, 16, 1, 576, 512), "gqa_8_to_4": (False, 4, 2, 8, 4)}


def _check_decode(peer, case, num_splits, dtype=torch.float32):
    want_out, want_lse = attention_fp64(*case)
    lse_out = peer.name == "vllm_triton_decode"  # SGLang's stage 2 writes no LSE
    got = peer.paged_attention(*case, num_splits=num_splits, **({"return_lse": True} if lse_out else {}))
    out, lse = got if lse_out else (got, None)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.double(), want_out, **tol)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
        torch.testing.assert_close(lse.double(), want_lse, **tol)  # float16 logits: float16's rounding


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", DECODE_PEERS)
def test_decode_peer_matches_the_fp64_definition(name, shape):
    """MLA (V the first 512 columns of a 576-wide latent pool, one kv head, 16 query heads) and GQA with V
    narrower than K: the output (and vLLM's LSE, natural log, token-major) equal the float64 definition, a
    prefill's queries each seeing their causal prefix; 3 splits for MLA, the default for GQA."""
    peer = _peer(name)
    _check_decode(peer, _case(*SHAPES[shape]), num_splits=3 if shape.startswith("mla") else None)


def test_vllm_decode_takes_v_as_a_view_only_of_ks_leading_columns():
    """``is_mla`` (V read from K's tile) only for a true view: a separate V pool of the same width gives that
    pool's values, not K's."""
    peer = _peer("vllm_triton_decode")
    query, k_cache, _, tables, seq_lens, qsl, scale = _case(True, 3, 1, 12, 8)
    separate = torch.randn(k_cache.shape[:3] + (8,))
    case = (query, k_cache, separate, tables, seq_lens, qsl, scale)
    torch.testing.assert_close(peer.paged_attention(*case).double(), attention_fp64(*case)[0], atol=2e-5, rtol=2e-5)


def merge_fp64(prefix_out, prefix_lse, suffix_out, suffix_lse):
    """The merge's definition in float64 (LSEs ``[H, T]``): weights ``exp(lse - logaddexp)``; ``+inf`` is "no keys"
    as ``-inf`` is; both empty give out 0 and LSE ``-inf``."""
    p = prefix_lse.double().masked_fill(prefix_lse == float("inf"), float("-inf"))
    s = suffix_lse.double().masked_fill(suffix_lse == float("inf"), float("-inf"))
    lse = torch.logaddexp(p, s)
    empty = lse == float("-inf")
    wp = torch.exp(p - lse).masked_fill(empty, 0).T.unsqueeze(-1)
    ws = torch.exp(s - lse).masked_fill(empty, 0).T.unsqueeze(-1)
    return wp * prefix_out.double() + ws * suffix_out.double(), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vllm_merge_equals_the_definition_with_empty_parts(dtype):
    """Finite LSEs, one side empty (``-inf``, and FlashAttention 2's ``+inf``), both sides empty: the merged output
    and LSE equal the float64 definition, and no NaN appears."""
    peer = _peer("vllm_merge_attn_states")
    gen = torch.Generator().manual_seed(1)
    tokens, heads, head_dim = 6, 3, 48
    prefix_out, suffix_out = (torch.randn(tokens, heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    prefix_lse, suffix_lse = (torch.randn(heads, tokens, generator=gen) * 4 for _ in range(2))
    prefix_lse[0, 1] = suffix_lse[0, 1] = float("-inf")  # both empty
    prefix_lse[1, 2] = float("-inf")  # the prefix empty
    suffix_lse[2, 3] = float("inf")  # the suffix empty, FlashAttention 2's way
    out, lse = peer.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse)
    want_out, want_lse = merge_fp64(prefix_out, prefix_lse, suffix_out, suffix_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (heads, tokens)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert (out[1, 0] == 0).all() and lse[0, 1] == float("-inf")


def test_mla_peers_refuse_bad_shapes_before_a_launch():
    """A V pool whose leading sizes are not K's, and token-major LSEs given to vLLM's head-major merge: refused
    with the argument named (nothing launched, nothing written)."""
    decode = _peer("vllm_triton_decode")
    query, k_cache, v_cache, tables, seq_lens, qsl, scale = _case(False, 4, 2, 8, 4)
    with pytest.raises(ShapeError, match="v_cache"):
        decode.paged_attention(query, k_cache, v_cache[:5], tables, seq_lens, qsl, scale)
    merge = _peer("vllm_merge_attn_states")
    out = torch.zeros(5, 3, 8)
    with pytest.raises(ShapeError, match="prefix_lse"):
        merge.merge_attn_states(out, torch.zeros(5, 3), out, torch.zeros(3, 5))


@pytest.mark.slow  # interpreted launches at several shapes and split counts: about a minute on 2 cores
@pytest.mark.parametrize("name", DECODE_PEERS)
def test_decode_peers_over_shapes_and_split_counts(name):
    """MHA, GQA and MLA (576 / 512 and a small latent pool of 12 / 8), block sizes 1, 4 and 16, split counts
    1, 2, 5 and 8, float32 and float16: every output equals the float64 definition."""
    peer = _peer(name)
    shapes = [(False, 2, 2, 5, 7), (False, 4, 1, 8, 4), (True, 8, 1, 12, 8), (True, 16, 1, 576, 512)]
    runs = [(shape, block_size, splits, dtype) for shape in shapes
            for block_size, splits, dtype in ((1, 1, torch.float32), (4, 5, torch.float16), (16, 8, torch.float32),
                                              (4, 2, torch.float32))]
    for seed, (shape, block_size, splits, dtype) in enumerate(runs):
        _check_decode(peer, _case(*shape, seed=seed, block_size=block_size, dtype=dtype), splits, dtype)


def test_a_merge_alone_loads_as_a_candidate():
    """``--pagedkv-impl pagedkv.tools.peers:vllm_merge_attn_states`` names a backend with ``merge_attn_states`` and
    none of the other ops: it loads (as a cache manager alone does); an object with neither is still refused."""
    from pagedkv.backends import load_backend
    from pagedkv.errors import BackendError

    _peer("vllm_merge_attn_states")
    assert callable(load_backend("pagedkv.tools.peers:vllm_merge_attn_states").merge_attn_states)
    with pytest.raises(BackendError, match="provides none of the contract's ops"):
        load_backend("pagedkv.tools.peers.mla:SGLANG_CORE_COUNT")  # an int: no op at all


@pytest.mark.parametrize("name", DECODE_PEERS + ["vllm_merge_attn_states", "vllm_triton", "sglang_triton"])
def test_the_suite_knows_the_peers_launch_triton_kernels(name, monkeypatch):
    """On a CPU the suite gives an interpreted peer the interpreter's example count (a tenth of the profile's)
    and a palette of specialisations; a split-K decode peer draws GQA groups up to one past its 16-head tile."""
    from pagedkv.testing import space

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = _peer(name)
    caps = space.capabilities_under_test(backend, for_drawing=True)
    assert space.example_cap([backend], 100) == 10
    assert caps.specialize_on
    if caps.split_k:
        assert caps.gqa_groups.allows(17) and not caps.gqa_groups.allows(18)


def test_sglang_decode_declares_the_int32_token_table_as_its_pool_limit():
    """SGLang's ``ReqToTokenPool.req_to_token`` is int32 and its slots are the CSR ``kv_indices``, so a pool past
    2**31 slots cannot be named in SGLang itself: the decode peer declares ``sglang_triton``'s ``max_pool_bytes``
    (the 2**31-element case is then outside its space, said so), and a slot the int32 table wraps is refused
    before the kernel reads (``BlockIndexError``), never read."""
    from pagedkv.errors import BlockIndexError
    from pagedkv.testing.cases.limit import LimitCase

    peer = _peer("sglang_triton_decode")
    assert peer.capabilities.max_pool_bytes == peers.PEERS["sglang_triton"]().capabilities.max_pool_bytes == 2**32
    case, why = LimitCase.for_space("2_31_elements", peer.capabilities)
    assert case is None and "max_pool_bytes" in why
    assert LimitCase.for_space("2_24_slots", peer.capabilities)[0] is not None  # a pool SGLang allocates: judged
    past = 2**31 // 16 + 1  # block 134217729 of 16 slots: its first slot is 2**31 + 16, which int32 wraps
    with pytest.raises(BlockIndexError):
        peer._kv_indices(torch.tensor([[past]]), [0], [1], 16, (past + 1) * 16)
