"""Attention features on every backend: sliding window, logit soft-cap, ALiBi, attention sinks, fp8 KV pools.

Each backend (``loop``, ``indexed``, ``triton``, and :mod:`pagedkv.attention.blockwise`, the kernel's algorithm in
torch) is compared with a float64 dense reference written out below from the definitions (it shares no
code with :func:`pagedkv.attention.dense.attend`): ``s = scale * q.k``; ``s = softcap * tanh(s / softcap)``;
``s += slope * (k_pos - q_pos)``; keys outside ``q_pos - window_left .. q_pos`` masked; softmax whose
denominator also holds ``exp(sink)``. fp8 pools are compared against exactly what was stored: the
reference dequantizes the stored bytes (``float(byte) * scale``).

Identities: a window of at least the context equals no window, a huge soft-cap approaches none, zero
slopes equal no ALiBi, ``-inf`` sinks equal no sinks; blocks wholly outside every window may hold NaN
(the Triton kernel's decode reads ``ceil(W / block_size) + 1`` blocks at most); ``write_kv`` into an fp8
pool stores exactly ``sat(x / scale)`` rounded to nearest even, and gather returns those bytes; scaling
the stored K by ``c`` and ``k_scale`` by ``1 / c`` changes nothing beyond rounding; every bad value is
refused before anything is written, naming the argument.

Without CUDA the Triton kernels run in Triton's interpreter: shapes are small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import get_backend

from pagedkv.attention import blockwise
from pagedkv.backends import backend_features, loop as loop_module
from pagedkv.errors import (ArgumentTypeError, ArgumentValueError, BackendError, BackendUnavailableError,
                            DeviceMismatchError, DTypeMismatchError, ShapeError)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALL = frozenset({"window", "softcap", "alibi", "sinks", "fp8"})


class _Backends(dict):
    """name -> backend. One that cannot load here (Triton not installed) stays in every parameter list and
    skips the test that asks for it, with the reason: a skip in the report, not a parameter left out."""

    def __init__(self):
        super().__init__(loop=get_backend("loop"), indexed=get_backend("indexed"), blockwise=blockwise)
        self.unavailable = {}
        try:
            self["triton"] = get_backend("triton")
        except (BackendUnavailableError, ImportError) as exc:
            self.unavailable["triton"] = f"{type(exc).__name__}: {exc}"

    def __missing__(self, name: str):
        pytest.skip(f"{name} is not available here ({self.unavailable.get(name, 'unknown backend')})")


BACKENDS = _Backends()
ATTENTION = sorted({*BACKENDS, *BACKENDS.unavailable})
STORAGE = sorted(n for n in ATTENTION if n != "blockwise")  # backends with write_kv / gather / scatter
FAST = ["indexed", "loop"]  # no interpreter: these take the larger Hypothesis budgets


def _triton_or_skip(name: str) -> None:
    if name not in BACKENDS:
        pytest.skip("triton is not available here")


# --------------------------------------------------------------------------------------------------
# The reference: float64, one query row and one head at a time, straight from the definitions
# --------------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 bytes of ``x`` (``[n, H, D]``): float32 ``x / scale`` per kv head, saturated, round to nearest even."""
    top = torch.finfo(dtype).max
    y = x.to(F32) / scale.to(F32).reshape(1, -1, 1)
    return torch.where(y > top, top, torch.where(y < -top, -top, y)).to(dtype)


def reference(query, keys, values, q_starts, scale=None, window_left=-1, softcap=0.0, alibi_slopes=None,
              sinks=None, k_scale=None, v_scale=None) -> torch.Tensor:
    """``float64 [total_q, num_q_heads, head_dim]``; ``keys``/``values``: the logical K/V per sequence."""
    total_q, num_q_heads, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(total_q, num_q_heads, head_dim, dtype=torch.float64)
    for b, (k_all, v_all) in enumerate(zip(keys, values)):
        seq_len, num_kv_heads = k_all.shape[0], k_all.shape[1]
        group = num_q_heads // num_kv_heads
        k_all, v_all = k_all.cpu().double(), v_all.cpu().double()
        if k_scale is not None:
            k_all = k_all * k_scale.cpu().double().reshape(1, -1, 1)
            v_all = v_all * v_scale.cpu().double().reshape(1, -1, 1)
        lo, hi = q_starts[b], q_starts[b + 1]
        for i in range(hi - lo):
            p = seq_len - (hi - lo) + i  # the new tokens are the last q_len positions
            first = 0 if window_left < 0 else max(0, p - window_left)
            for h in range(num_q_heads):
                kv = h // group
                q = query[lo + i, h].cpu().double()
                logits = []
                for j in range(first, p + 1):
                    s = scale * float(q @ k_all[j, kv])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s += float(alibi_slopes[h]) * (j - p)
                    logits.append(s)
                extra = [] if sinks is None else [float(sinks[h])]
                m = max(logits + extra)
                w = [math.exp(s - m) for s in logits]
                denom = sum(w) + sum(math.exp(s - m) for s in extra)
                row = sum(wj * v_all[first + n, kv] for n, wj in enumerate(w)) / denom
                out[lo + i, h] = row
    return out


def assert_matches(out: torch.Tensor, ref: torch.Tensor, query_dtype: torch.dtype, slack: float = 0.0) -> None:
    """Finite, and within the output dtype's tolerance (2 ulp of float16/bfloat16, 2e-5 float32) plus slack."""
    assert out.shape == ref.shape
    assert bool(torch.isfinite(out).all()), "non-finite output"
    tol = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2}[query_dtype]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol + slack)


# --------------------------------------------------------------------------------------------------
# A paged batch: logical K/V scattered into shuffled blocks of a poisoned pool
# --------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list  # logical K per sequence, in the pool's dtype (the stored bytes for fp8)
    values: list
    q_starts: list
    tables: list  # physical block ids per sequence
    scales: dict  # {"k_scale": ..., "v_scale": ...} for fp8 pools, else {}

    def call(self, backend, **kw):
        return backend.paged_attention(self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                       self.query_start_loc, kw.pop("scale", None), **self.scales, **kw)

    def ref(self, **kw):
        scales = {} if not self.scales else {"k_scale": _per_head(self.scales["k_scale"], self.num_kv_heads),
                                             "v_scale": _per_head(self.scales["v_scale"], self.num_kv_heads)}
        return reference(self.query, self.keys, self.values, self.q_starts, **scales, **kw)

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def slack(self, scale=None, softcap=0.0, alibi_slopes=None, **_) -> float:
        """The float32 logit error's share of the tolerance: ``8 eps * max|logit| * max(max|V|, 1)``."""
        scale = 1.0 / math.sqrt(self.query.shape[-1]) if scale is None else scale
        sk = 1.0 if not self.scales else float(_per_head(self.scales["k_scale"], self.num_kv_heads).max())
        sv = 1.0 if not self.scales else float(_per_head(self.scales["v_scale"], self.num_kv_heads).max())
        finite = [k.float().nan_to_num(0) for k in self.keys if k.numel()]
        k_norm = max([float(k.norm(dim=-1).max()) for k in finite] + [0.0]) * sk
        v_max = max([float(v.float().nan_to_num(0).abs().max()) for v in self.values if v.numel()] + [0.0]) * sv
        logit = scale * float(self.query.float().norm(dim=-1).max()) * k_norm if self.query.numel() else 0.0
        logit = min(logit, softcap) if softcap > 0 else logit
        if alibi_slopes is not None:
            logit += float(alibi_slopes.abs().max()) * max(k.shape[0] for k in self.keys)
        return 8 * torch.finfo(F32).eps * logit * max(v_max, 1.0)

    def poison_positions(self, b: int, positions) -> None:
        """NaN (both pools) at logical positions ``positions`` of sequence ``b``."""
        for pos in positions:
            blk = self.tables[b][pos // self.block_size]
            self.k_cache[blk, pos % self.block_size] = float("nan")
            self.v_cache[blk, pos % self.block_size] = float("nan")


def _per_head(scale, num_kv_heads: int) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.to(F32).reshape(-1).expand(num_kv_heads).cpu()
    return torch.full((num_kv_heads,), scale, dtype=F32)


def make_batch(seqs, block_size=4, num_kv_heads=2, group=2, head_dim=8, dtype=F32, query_dtype=None, seed=0,
               strided=True, k_scale=None, v_scale=None, spare_blocks=2, magnitude=1.0) -> Batch:
    """``seqs``: ``(seq_len, q_len)`` per sequence. fp8 ``dtype`` needs ``k_scale``/``v_scale``; K/V are
    drawn in float32 and quantized by :func:`quantize`. Unowned slots and block tails hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    fp8 = dtype in (E4M3, E5M2)
    query_dtype = query_dtype or (F32 if fp8 else dtype)
    need = [-(-s // block_size) for s, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim) if strided else (2, num_blocks, block_size,
                                                                                 num_kv_heads, head_dim)
    kv = torch.full(shape, float("nan"), dtype=F32).to(dtype)
    k_cache, v_cache = (kv[:, 0], kv[:, 1]) if strided else (kv[0], kv[1])
    tables, keys, values, start = [], [], [], 0
    for (seq_len, _), n in zip(seqs, need):
        table = perm[start:start + n]
        start += n
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) * magnitude
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) * magnitude
        if fp8:
            k = quantize(k, _per_head(k_scale, num_kv_heads), dtype)
            v = quantize(v, _per_head(v_scale, num_kv_heads), dtype)
        else:
            k, v = k.to(dtype), v.to(dtype)
        for pos in range(seq_len):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(need + [1]) + 1
    block_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q_starts = [0]
    for _, q_len in seqs:
        q_starts.append(q_starts[-1] + q_len)
    query = torch.randn(q_starts[-1], num_kv_heads * group, head_dim, generator=gen).to(query_dtype)
    scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    to = (lambda x: x.to(DEVICE))
    return Batch(to(query), to(k_cache), to(v_cache), to(block_tables),
                 to(torch.tensor([s for s, _ in seqs], dtype=torch.int32)),
                 to(torch.tensor(q_starts, dtype=torch.int32)), keys, values, q_starts, tables,
                 {k: (to(x) if isinstance(x, torch.Tensor) else x) for k, x in scales.items()})


def _slopes(n: int, seed: int = 1) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 0.5).to(DEVICE)


def _sinks(n: int, seed: int = 2) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


# decode and prefill over a cached prefix, a partial last block, an empty query and GQA 2
SEQS = ((11, 1), (9, 4), (5, 0), (6, 6))
BS = 4


def test_every_backend_declares_every_feature():
    for name, backend in BACKENDS.items():
        assert isinstance(backend.FEATURES, frozenset), name
        assert backend.FEATURES == ALL == backend_features(backend), name
    assert backend_features(object()) == frozenset()  # no FEATURES: declares none


# --------------------------------------------------------------------------------------------------
# Each feature against the reference
# --------------------------------------------------------------------------------------------------


FEATURE_CASES = {
    "window_0": dict(window_left=0),
    "window_1": dict(window_left=1),
    "window_bs-1": dict(window_left=BS - 1),
    "window_bs": dict(window_left=BS),
    "window_5": dict(window_left=5),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="slopes"),
    "sinks": dict(sinks="sinks"),
    "all": dict(window_left=3, softcap=2.0, alibi_slopes="slopes", sinks="sinks", scale=0.7),
}


def _features(spec: dict, num_q_heads: int) -> dict:
    out = dict(spec)
    if out.get("alibi_slopes") == "slopes":
        out["alibi_slopes"] = _slopes(num_q_heads)
    if out.get("sinks") == "sinks":
        out["sinks"] = _sinks(num_q_heads)
    return out


@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
@pytest.mark.parametrize("name", ATTENTION)
def test_feature_matches_fp64_reference(name, case):
    batch = make_batch(SEQS, block_size=BS)
    kw = _features(FEATURE_CASES[case], batch.query.shape[1])
    out = batch.call(BACKENDS[name], **dict(kw))
    assert_matches(out, batch.ref(**kw), F32)


FP8_CASES = {
    "e4m3_per_tensor": (E4M3, 0.05, 0.02, F32),
    "e5m2_per_tensor": (E5M2, 0.5, 0.25, F32),
    "e4m3_per_head_f16_query": (E4M3, "per_head", "per_head", F16),
    "e5m2_per_head_bf16_query": (E5M2, "per_head", 0.3, BF16),
}


def _fp8_batch(case: str, **kw) -> Batch:
    dtype, ks, vs, qd = FP8_CASES[case]
    ks = torch.tensor([0.03, 0.11]) if ks == "per_head" else ks
    vs = torch.tensor([0.2, 0.007]) if vs == "per_head" else vs
    return make_batch(SEQS, block_size=BS, dtype=dtype, query_dtype=qd, k_scale=ks, v_scale=vs, magnitude=3.0, **kw)


@pytest.mark.parametrize("case", sorted(FP8_CASES))
@pytest.mark.parametrize("name", ATTENTION)
def test_fp8_pool_matches_fp64_reference_on_the_stored_bytes(name, case):
    batch = _fp8_batch(case)
    out = batch.call(BACKENDS[name])
    assert out.dtype == batch.query.dtype
    assert_matches(out, batch.ref(), batch.query.dtype)
    kw = dict(window_left=2, softcap=3.0, alibi_slopes=_slopes(4), sinks=_sinks(4))
    assert_matches(batch.call(BACKENDS[name], **kw), batch.ref(**kw), batch.query.dtype)


@pytest.mark.parametrize("name", ATTENTION)
def test_decode_at_context_600_with_a_512_token_window(name):
    """The issue's example: a decode at context 600 with a 512-token window (block_size 16)."""
    batch = make_batch(((600, 1), (530, 1)), block_size=16, num_kv_heads=1, group=2, head_dim=4, seed=3)
    out = batch.call(BACKENDS[name], window_left=512)
    assert_matches(out, batch.ref(window_left=512), F32)


# --------------------------------------------------------------------------------------------------
# Identities
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ATTENTION)
def test_identities_of_each_feature(name):
    """Window >= context == none; zero slopes == none; -inf sinks == none (bit for bit); a huge soft-cap
    approaches none (float32 rounding)."""
    backend = BACKENDS[name]
    batch = make_batch(SEQS, block_size=BS)
    plain = batch.call(backend)
    hq = batch.query.shape[1]
    longest = max(s for s, _ in SEQS)
    for w in (longest - 1, longest, longest + 7, 10**6):
        assert torch.equal(batch.call(backend, window_left=w), plain), f"window_left={w}"
    assert torch.equal(batch.call(backend, alibi_slopes=torch.zeros(hq, device=DEVICE)), plain)
    assert torch.equal(batch.call(backend, sinks=torch.full((hq,), float("-inf"), device=DEVICE)), plain)
    torch.testing.assert_close(batch.call(backend, softcap=1e7), plain, rtol=1e-6, atol=1e-6)
    # and the opposite direction: each feature, switched on with a value that matters, changes the output
    assert not torch.allclose(batch.call(backend, window_left=1), plain)
    assert not torch.allclose(batch.call(backend, softcap=0.1), plain)
    assert not torch.allclose(batch.call(backend, alibi_slopes=torch.ones(hq, device=DEVICE)), plain)
    assert not torch.allclose(batch.call(backend, sinks=torch.ones(hq, device=DEVICE)), plain)


@pytest.mark.parametrize("name", ATTENTION)
def test_alibi_is_relative_to_each_querys_own_position_visible_with_sinks(name):
    """A per-row constant added to every logit cancels in softmax, except against a sink: bias relative
    to the start of the query chunk instead of each row's own position is caught here."""
    batch = make_batch(((9, 4),), block_size=BS, seed=5)
    hq = batch.query.shape[1]
    kw = dict(alibi_slopes=torch.full((hq,), 0.8, device=DEVICE), sinks=torch.zeros(hq, device=DEVICE))
    out = batch.call(BACKENDS[name], **dict(kw))
    assert_matches(out, batch.ref(**kw), F32)
    wrong = reference(batch.query, batch.keys, batch.values, batch.q_starts, sinks=kw["sinks"].cpu(),
                      alibi_slopes=kw["alibi_slopes"].cpu())
    # the same math with the bias measured from the first query row differs visibly
    shifted = torch.zeros_like(wrong)
    for i in range(4):
        slopes = kw["alibi_slopes"].cpu()
        sinks = kw["sinks"].cpu() - slopes * i  # slope * (k - q0) = slope * (k - q_i) + slope * i: as lowering the sink
        shifted[i] = reference(batch.query[i:i + 1], [batch.keys[0][:9 - 3 + i]], [batch.values[0][:9 - 3 + i]],
                               [0, 1], sinks=sinks, alibi_slopes=slopes)[0]
    assert (shifted - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("name", ATTENTION)
@pytest.mark.parametrize("window", [0, 1, BS - 1, BS, 6])
def test_blocks_outside_every_window_may_hold_nan(name, window):
    batch = make_batch(((23, 1), (21, 3), (13, 5)), block_size=BS, seed=7)
    clean = batch.call(BACKENDS[name], window_left=window)
    for b, (seq_len, q_len) in enumerate(((23, 1), (21, 3), (13, 5))):
        first_visible = max(0, seq_len - q_len - window)  # of the sequence's first query row
        batch.poison_positions(b, range(first_visible // BS * BS))  # every block wholly before it
    out = batch.call(BACKENDS[name], window_left=window)
    assert torch.equal(out, clean)
    assert_matches(out, batch.ref(window_left=window), F32)


@pytest.mark.parametrize("seq_len,window,block_size", [(600, 512, 16), (37, 8, 4), (37, 9, 4), (40, 0, 4), (33, 15, 16),
                                                       (64, 16, 16), (50, 17, 16), (29, 5, 3)])
def test_triton_decode_over_a_window_reads_only_its_blocks(seq_len, window, block_size):
    """Every block but the ``ceil(W / block_size) + 1`` that can hold the window is NaN in K and V, and
    in the block that holds the window's start the positions before it are NaN too: the kernel must
    load nothing outside the window (a NaN V would reach the output through 0 * NaN)."""
    _triton_or_skip("triton")
    batch = make_batch(((seq_len, 1),), block_size=block_size, num_kv_heads=2, group=3, head_dim=4, seed=seq_len)
    p = seq_len - 1
    first = max(0, p - window)
    batch.poison_positions(0, range(first))
    kept = {batch.tables[0][pos // block_size] for pos in range(first, seq_len)}
    assert len(kept) <= math.ceil(window / block_size) + 1
    poisoned = set(batch.tables[0]) - kept
    assert all(bool(batch.v_cache[blk].isnan().all()) for blk in poisoned)
    out = batch.call(BACKENDS["triton"], window_left=window)
    assert_matches(out, batch.ref(window_left=window), F32)


@given(data=st.data())
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("name", FAST)
def test_random_feature_combinations_match_the_reference(name, data):
    _check_random_combination(name, data)


@given(data=st.data())
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("name", ["triton", "blockwise"])
def test_random_feature_combinations_match_the_reference_fused(name, data):
    if name == "triton":
        _triton_or_skip(name)
    _check_random_combination(name, data)


def _check_random_combination(name, data):
    bs = data.draw(st.sampled_from([1, 2, 3, 4, 5, 8]), label="block_size")
    seqs = data.draw(st.lists(st.integers(1, 12).flatmap(lambda s: st.tuples(st.just(s), st.integers(0, min(s, 4)))),
                              min_size=1, max_size=3), label="seqs")
    context = max(s for s, _ in seqs)
    window = data.draw(st.sampled_from([-1, 0, 1, bs - 1, bs, context, context + 3]) | st.integers(-1, 14),
                       label="window_left")
    softcap = data.draw(st.sampled_from([0.0, 0.5, 4.0, 1e4]), label="softcap")
    group = data.draw(st.sampled_from([1, 2, 3]), label="group")
    h = 2 * group
    alibi = data.draw(st.booleans(), label="alibi")
    sinks = data.draw(st.sampled_from([None, "finite", "mixed"]), label="sinks")
    fp8 = data.draw(st.sampled_from([None, E4M3, E5M2]), label="fp8")
    k_scale = data.draw(st.sampled_from([0.01, 0.25, 1.0, "per_head"]), label="k_scale") if fp8 else None
    k_scale = torch.tensor([0.02, 0.6]) if k_scale == "per_head" else k_scale
    batch = make_batch(seqs, block_size=bs, num_kv_heads=2, group=group, head_dim=4, seed=data.draw(
        st.integers(0, 2**16), label="seed"), dtype=fp8 or F32, k_scale=k_scale, v_scale=0.125,
        strided=data.draw(st.booleans(), label="strided"), magnitude=2.0 if fp8 else 1.0)
    kw = dict(window_left=window, softcap=softcap)
    if alibi:
        kw["alibi_slopes"] = _slopes(h, seed=bs)
    if sinks:
        s = _sinks(h)
        if sinks == "mixed":
            s[::2] = float("-inf")
        kw["sinks"] = s
    out = batch.call(BACKENDS[name], **dict(kw))
    assert_matches(out, batch.ref(**kw), F32, slack=batch.slack(**kw))


# --------------------------------------------------------------------------------------------------
# fp8 pools: write, gather, scatter, scales
# --------------------------------------------------------------------------------------------------


def _tricky_values(dtype: torch.dtype) -> torch.Tensor:
    """Every midpoint between neighbouring fp8 values (ties), one float32 ulp either side, the extremes,
    zeros, float32 subnormals, NaN and values beyond the finite range (saturated)."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = torch.unique(codes[torch.isfinite(codes)])
    mids = (finite[1:].double() + finite[:-1].double()) / 2
    mids = mids.float()  # exact: midpoints of fp8 values have few bits
    up = torch.nextafter(mids, torch.tensor(float("inf")))
    down = torch.nextafter(mids, torch.tensor(float("-inf")))
    top = torch.finfo(dtype).max
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, top, -top, top * 1.01, -top * 4, 1e30, float("inf"),
                            float("-inf"), float("nan")])
    return torch.cat([finite, mids, up, down, special])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("name", STORAGE)
def test_fp8_write_kv_stores_exactly_the_quantized_bytes_and_gather_returns_them(name, dtype):
    backend = BACKENDS[name]
    values = _tricky_values(dtype)
    num_kv_heads, head_dim, block_size = 2, 8, 5
    n = -(-values.numel() // (num_kv_heads * head_dim))
    flat = torch.cat([values, torch.randn(n * num_kv_heads * head_dim - values.numel()) * 100])
    gen = torch.Generator().manual_seed(0)
    key = flat[torch.randperm(flat.numel(), generator=gen)].view(n, num_kv_heads, head_dim)
    value = -key.flip(0)
    k_scale = torch.tensor([1.0, 0.375])  # 1.0: the ties above are ties of x / scale exactly
    v_scale = 2.0 ** -3
    num_blocks = -(-n // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[3] = -1  # a padding token: skipped
    poison = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(dtype)
    k_cache, v_cache = poison.clone().to(DEVICE), poison.clone().to(DEVICE)
    backend.write_kv(k_cache, v_cache, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), k_scale=k_scale.to(DEVICE),
                     v_scale=v_scale)
    want_k, want_v = poison.clone(), poison.clone()
    qk, qv = quantize(key, k_scale, dtype), quantize(value, torch.tensor([v_scale] * 2), dtype)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = qk[i]
            want_v[slot // block_size, slot % block_size] = qv[i]
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))
    # gather moves the stored bytes back untouched
    table = torch.randperm(num_blocks, generator=gen)
    got = backend.gather(k_cache, table.to(DEVICE), num_blocks * block_size - 2)
    want = want_k[table].reshape(-1, num_kv_heads, head_dim)[:num_blocks * block_size - 2]
    assert got.dtype == dtype
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("name", STORAGE)
def test_fp8_scatter_then_gather_round_trips_the_bytes_and_touches_nothing_else(name):
    backend = BACKENDS[name]
    gen = torch.Generator().manual_seed(4)
    pool = torch.randint(0, 256, (6, 3, 2, 16), dtype=torch.uint8, generator=gen).view(E4M3).to(DEVICE)
    before = pool.clone()
    values = torch.randint(0, 256, (7, 2, 16), dtype=torch.uint8, generator=gen).view(E4M3).to(DEVICE)
    table = torch.tensor([4, 1, 5, 0], device=DEVICE)
    backend.scatter(pool, table, values, 2)
    got = backend.gather(pool, table, 9)
    assert torch.equal(got[2:].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got[:2].view(torch.uint8), before[4, :2].view(torch.uint8))
    untouched = [b for b in range(6) if b not in (4, 1, 5)]
    assert torch.equal(pool[untouched].view(torch.uint8), before[untouched].view(torch.uint8))


@given(data=st.data())
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@pytest.mark.parametrize("name", STORAGE)
def test_fp8_write_kv_equals_the_quantization_for_drawn_values_and_scales(name, data):
    dtype = data.draw(st.sampled_from([E4M3, E5M2]))
    n = data.draw(st.integers(1, 6))
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    key = torch.tensor(data.draw(st.lists(floats, min_size=n * 4, max_size=n * 4)), dtype=F32).view(n, 2, 2)
    src = data.draw(st.sampled_from([F32, F16, BF16]))
    key = key.to(src)
    scale = data.draw(st.floats(2.0 ** -20, 2.0 ** 20, width=32) | st.sampled_from([1.0, 0.5, 3.0]))
    slots = torch.tensor(data.draw(st.permutations(range(8)))[:n])
    pool = torch.zeros(4, 2, 2, 2).to(dtype)
    k_cache, v_cache = pool.clone().to(DEVICE), pool.clone().to(DEVICE)
    BACKENDS[name].write_kv(k_cache, v_cache, key.to(DEVICE), key.to(DEVICE), slots.to(DEVICE), k_scale=scale,
                            v_scale=torch.tensor([scale, 1.0], device=DEVICE))
    want_k = quantize(key, torch.tensor([scale, scale]), dtype).view(torch.uint8)
    want_v = quantize(key, torch.tensor([scale, 1.0]), dtype).view(torch.uint8)
    flat_k, flat_v = k_cache.cpu().view(torch.uint8).view(8, 2, 2), v_cache.cpu().view(torch.uint8).view(8, 2, 2)
    assert torch.equal(flat_k[slots], want_k)
    assert torch.equal(flat_v[slots], want_v)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy sees the planted NaN / inf
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("name", ATTENTION)
def test_fp8_nan_or_inf_in_a_visible_slot_reaches_the_output(name, dtype):
    """A stored NaN (e4m3fn has no inf; e5m2 has both) is read as NaN / inf, never as a finite number
    (a float16 reinterpretation of e4m3fn's NaN code would read 480); other sequences stay finite."""
    batch = make_batch(((7, 2), (6, 1)), block_size=BS, dtype=dtype, k_scale=0.5, v_scale=0.5, seed=11)
    blk = batch.tables[0][1]
    batch.v_cache[blk, 1, 0] = float("nan")  # position 5 of sequence 0, kv head 0: seen by both its rows
    if dtype == E5M2:
        batch.k_cache[blk, 1, 1, 0] = float("inf")  # kv head 1: an inf key
    out = batch.call(BACKENDS[name])
    assert bool(out[0:2, 0:2].isnan().all())  # query heads 0 and 1 use kv head 0
    assert bool(torch.isfinite(out[2:]).all())
    if dtype == E5M2:
        assert not bool(torch.isfinite(out[0:2, 2:]).all())
    else:
        assert bool(torch.isfinite(out[0:2, 2:]).all())


@pytest.mark.parametrize("c", [2.0, 8.0, 3.0, 0.3])
@pytest.mark.parametrize("name", ATTENTION)
def test_scaling_stored_k_by_c_and_k_scale_by_one_over_c_changes_nothing_beyond_rounding(name, c):
    """Read side: a pool holding ``K * c`` read with ``k_scale / c`` (and V likewise) dequantizes to the
    same values: bit for bit when ``c`` is a power of two (exact), within the fp8 rounding of ``K * c``
    otherwise. Write side: ``write_kv(c * x, k_scale = c * s)`` stores the bytes of ``write_kv(x, s)``
    when ``c`` is a power of two."""
    batch = make_batch(SEQS, block_size=BS, dtype=E4M3, k_scale=0.1, v_scale=0.12)  # |stored| < 448 / 8
    base = batch.call(BACKENDS[name], window_left=5, sinks=_sinks(4))
    scaled = make_batch(SEQS, block_size=BS, dtype=E4M3, k_scale=0.1, v_scale=0.12)
    scaled.k_cache.copy_((batch.k_cache.float() * c).to(E4M3))
    scaled.v_cache.copy_((batch.v_cache.float() * c).to(E4M3))
    scaled.scales = {"k_scale": 0.1 / c, "v_scale": 0.12 / c}
    out = scaled.call(BACKENDS[name], window_left=5, sinks=_sinks(4))
    if math.log2(c).is_integer():  # stored * c and scale / c are exact: the same float32 K and V
        assert torch.equal(out, base)
    else:  # K * c rounds to fp8 again: up to 2**-4 relative per element in e4m3
        torch.testing.assert_close(out, base, rtol=0.1, atol=0.1)
    if name == "blockwise" or not math.log2(c).is_integer():
        return
    x = torch.randn(5, 2, 8) * 4
    pools = []
    for factor in (1.0, c):
        k = torch.zeros(2, 4, 2, 8).to(E4M3).to(DEVICE)
        v = k.clone()
        BACKENDS[name].write_kv(k, v, (x * factor).to(DEVICE), (x * factor).to(DEVICE),
                                torch.arange(5, device=DEVICE), k_scale=0.05 * factor, v_scale=0.3 * factor)
        pools.append((k.cpu().view(torch.uint8), v.cpu().view(torch.uint8)))
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


@pytest.mark.parametrize("name", ATTENTION)
@pytest.mark.parametrize("form", ["float16", "bfloat16", "list", "tuple"])
def test_slopes_and_sinks_in_the_models_dtype_equal_their_float32_values(name, form):
    """Slopes and sinks in float16 / bfloat16 or as Python floats (vLLM's and FlashInfer's forms) are
    converted once to float32: the output is bit-identical to passing that float32 tensor."""
    backend = BACKENDS[name]
    batch = make_batch(SEQS, block_size=BS, seed=11)
    hq = batch.query.shape[1]
    low = {"float16": F16, "bfloat16": BF16}.get(form, BF16)
    slopes, sinks = _slopes(hq).to(low), _sinks(hq).to(low)  # values a float32 tensor and the low dtype share
    sinks[0] = float("-inf")
    exact = dict(alibi_slopes=slopes.float(), sinks=sinks.float())
    if form in ("list", "tuple"):
        kind = list if form == "list" else tuple
        given = {k: kind(float(x) for x in v.cpu()) for k, v in exact.items()}
    else:
        given = dict(alibi_slopes=slopes, sinks=sinks)
    want = batch.call(backend, **exact)
    assert torch.equal(batch.call(backend, **given), want)
    assert_matches(want, batch.ref(**{k: v.cpu() for k, v in exact.items()}), F32,
                   slack=batch.slack(alibi_slopes=exact["alibi_slopes"]))
    if name in STORAGE:  # below level "full" too (metadata: no value read; none: normalised only)
        for level in ("metadata", "none"):
            out = backend.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.seq_lens, batch.query_start_loc, None, level, **given)
            assert torch.equal(out, want), level


def test_check_paged_attention_returns_float32_slopes_and_sinks():
    from pagedkv.validation.calls import check_paged_attention

    batch = make_batch(((5, 2),), block_size=BS)
    args = check_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, alibi_slopes=[0.25, 0.5, 0.125, 1.0],
                                 sinks=torch.tensor([0.5, -1.0, float("-inf"), 2.0], dtype=BF16, device=DEVICE))
    assert args.alibi_slopes.dtype == F32 and args.sinks.dtype == F32
    assert args.alibi_slopes.tolist() == [0.25, 0.5, 0.125, 1.0]
    assert args.sinks.tolist() == [0.5, -1.0, float("-inf"), 2.0]


# --------------------------------------------------------------------------------------------------
# Bad values are refused before anything is written, naming the argument
# --------------------------------------------------------------------------------------------------


def _meta(n):
    return torch.zeros(n, device="meta")


BAD_ATTENTION = [
    (dict(window_left=-2), ArgumentValueError, "window_left"),
    (dict(window_left=1.5), ArgumentTypeError, "window_left"),
    (dict(window_left=True), ArgumentTypeError, "window_left"),
    (dict(softcap=-1.0), ArgumentValueError, "softcap"),
    (dict(softcap=float("inf")), ArgumentValueError, "softcap"),
    (dict(softcap=float("nan")), ArgumentValueError, "softcap"),
    (dict(softcap="4"), ArgumentTypeError, "softcap"),
    (dict(alibi_slopes=torch.zeros(5)), ShapeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(4, 1)), ShapeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(4, dtype=torch.float64)), DTypeMismatchError, "alibi_slopes"),
    (dict(alibi_slopes=["0.5"] * 4), ArgumentTypeError, "alibi_slopes[0]"),
    (dict(alibi_slopes=[0.0, 0.0, True, 0.0]), ArgumentTypeError, "alibi_slopes[2]"),
    (dict(alibi_slopes=0.5), ArgumentTypeError, "alibi_slopes"),
    (dict(alibi_slopes=[0.0] * 3), ShapeError, "alibi_slopes"),
    (dict(alibi_slopes=[0.0, float("inf"), 0.0, 0.0]), ArgumentValueError, "alibi_slopes[1]"),
    (dict(alibi_slopes=torch.tensor([0.0, float("nan"), 0.0, 0.0])), ArgumentValueError, "alibi_slopes[1]"),
    (dict(alibi_slopes=_meta(4)), DeviceMismatchError, "alibi_slopes"),
    (dict(sinks=torch.zeros(3)), ShapeError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.int32)), DTypeMismatchError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), DTypeMismatchError, "sinks"),
    (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0], dtype=torch.bfloat16)), ArgumentValueError, "sinks[1]"),
    (dict(sinks=torch.tensor([0.0, 0.0, float("inf"), 0.0])), ArgumentValueError, "sinks[2]"),
    (dict(sinks=torch.tensor([float("nan"), 0.0, 0.0, 0.0])), ArgumentValueError, "sinks[0]"),
    (dict(sinks=_meta(4)), DeviceMismatchError, "sinks"),
    (dict(k_scale=1.0, v_scale=1.0), ArgumentTypeError, "k_scale"),  # scales on a float32 pool
]

BAD_FP8 = [  # on an fp8 pool; for write_kv and paged_attention alike
    (dict(k_scale=None, v_scale=0.1), ArgumentTypeError, "k_scale"),
    (dict(k_scale=0.1, v_scale=None), ArgumentTypeError, "v_scale"),
    (dict(k_scale=0.0, v_scale=0.1), ArgumentValueError, "k_scale"),
    (dict(k_scale=-0.5, v_scale=0.1), ArgumentValueError, "k_scale"),
    (dict(k_scale=float("inf"), v_scale=0.1), ArgumentValueError, "k_scale"),
    (dict(k_scale=0.1, v_scale=float("nan")), ArgumentValueError, "v_scale"),
    (dict(k_scale=torch.tensor([0.1, 0.0]), v_scale=0.1), ArgumentValueError, "k_scale[1]"),
    (dict(k_scale=torch.tensor([0.1, 0.1, 0.1]), v_scale=0.1), ShapeError, "k_scale"),
    (dict(k_scale=torch.tensor([0.1, 0.1], dtype=torch.float64), v_scale=0.1), DTypeMismatchError, "k_scale"),
    (dict(k_scale=True, v_scale=0.1), ArgumentTypeError, "k_scale"),
    (dict(k_scale="0.1", v_scale=0.1), ArgumentTypeError, "k_scale"),
    (dict(k_scale=0.1, v_scale=_meta(2)), DeviceMismatchError, "v_scale"),
]


def _snapshot(*pools):
    return [p.detach().cpu().view(torch.uint8).clone() if p.element_size() == 1 else
            p.detach().cpu().view(torch.int32 if p.element_size() == 4 else torch.int16).clone() for p in pools]


def _unchanged(before, *pools):
    return all(torch.equal(b, a) for b, a in zip(before, _snapshot(*pools)))


@pytest.mark.parametrize("name", ATTENTION)
def test_bad_feature_values_are_refused_naming_the_argument(name):
    backend = BACKENDS[name]
    batch = make_batch(SEQS, block_size=BS)
    before = _snapshot(batch.k_cache, batch.v_cache)
    for kw, error, arg in BAD_ATTENTION:
        kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
              for k, v in kw.items()}
        with pytest.raises(error, match=arg.replace("[", r"\[")):
            batch.call(backend, **kw)
    fp8 = _fp8_batch("e4m3_per_tensor")
    fp8_before = _snapshot(fp8.k_cache, fp8.v_cache)
    for kw, error, arg in BAD_FP8:
        fp8.scales = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
                      for k, v in kw.items()}
        with pytest.raises(error, match=arg.replace("[", r"\[")):
            fp8.call(backend)
    fp8.scales = {"k_scale": 0.1, "v_scale": 0.1}
    with pytest.raises(DTypeMismatchError, match="query"):
        backend.paged_attention(fp8.query.to(E4M3), fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens,
                                fp8.query_start_loc, k_scale=0.1, v_scale=0.1)
    assert _unchanged(before, batch.k_cache, batch.v_cache)
    assert _unchanged(fp8_before, fp8.k_cache, fp8.v_cache)


def test_a_value_out_of_range_is_an_argument_value_error_not_a_shape_error():
    """Values out of range and shapes that do not fit are told apart by type; both stay ``ValueError``."""
    from pagedkv.validation.arguments import check_kv_scale, check_scale, check_softcap, check_window

    assert issubclass(ArgumentValueError, ValueError) and not issubclass(ArgumentValueError, ShapeError)
    for call, message in ((lambda: check_softcap(float("inf")), "softcap must be finite and >= 0 (0: off), got inf"),
                          (lambda: check_window(-3), "window_left must be -1 (no window) or >= 0, got -3"),
                          (lambda: check_scale(float("nan"), 8), "scale must be finite, got nan"),
                          (lambda: check_kv_scale("k_scale", -1.0, 2, "cpu"),
                           "k_scale must be finite and > 0, got -1.0")):
        with pytest.raises(ArgumentValueError) as info:
            call()
        assert str(info.value) == message
    with pytest.raises(ShapeError, match="k_scale must be a number"):
        check_kv_scale("k_scale", torch.ones(3), 2, "cpu")


@pytest.mark.parametrize("name", STORAGE)
def test_bad_write_kv_scales_are_refused_with_both_pools_unchanged(name):
    backend = BACKENDS[name]
    k_cache = torch.full((3, 4, 2, 8), float("nan")).to(E5M2).to(DEVICE)
    v_cache = k_cache.clone()
    key = torch.randn(5, 2, 8, device=DEVICE)
    slots = torch.arange(5, device=DEVICE)
    before = _snapshot(k_cache, v_cache)
    for kw, error, arg in BAD_FP8:
        kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v)
              for k, v in kw.items()}
        with pytest.raises(error, match=arg.replace("[", r"\[")):
            backend.write_kv(k_cache, v_cache, key, key, slots, **kw)
    with pytest.raises(DTypeMismatchError, match="key"):
        backend.write_kv(k_cache, v_cache, key.to(E5M2), key, slots, k_scale=1.0, v_scale=1.0)
    with pytest.raises(DTypeMismatchError, match="value"):
        backend.write_kv(k_cache, v_cache, key, key.double(), slots, k_scale=1.0, v_scale=1.0)
    float_pool = torch.zeros(3, 4, 2, 8, device=DEVICE)
    float_v = float_pool.clone()
    with pytest.raises(ArgumentTypeError, match="k_scale"):
        backend.write_kv(float_pool, float_v, key, key, slots, k_scale=1.0, v_scale=1.0)
    assert _unchanged(before, k_cache, v_cache)
    assert bool((float_pool == 0).all()) and bool((float_v == 0).all())


def test_a_backend_asked_for_a_feature_it_does_not_declare_refuses_it():
    """A backend whose ops declare only "softcap" (pagedkv.backends.ops.backend_op) refuses the other
    features, naming the feature, before anything is written."""
    from types import SimpleNamespace

    from pagedkv.backends.ops import backend_op

    declared = backend_op(frozenset({"softcap"}))
    restricted = SimpleNamespace(name="softcap_only", **{op: declared(getattr(loop_module, op).impl)
                                                          for op in ("gather", "write_kv", "paged_attention")})
    batch = make_batch(SEQS, block_size=BS)
    batch.call(restricted, softcap=2.0)  # declared: fine
    for kw, feature in ((dict(window_left=2), "window"), (dict(alibi_slopes=_slopes(4)), "alibi"),
                        (dict(sinks=_sinks(4)), "sinks")):
        with pytest.raises(BackendError, match=feature):
            batch.call(restricted, **kw)
    k_cache = torch.zeros(3, 4, 2, 8).to(E4M3).to(DEVICE)
    v_cache = k_cache.clone()
    with pytest.raises(BackendError, match="fp8"):
        restricted.write_kv(k_cache, v_cache, torch.randn(2, 2, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE),
                            torch.arange(2, device=DEVICE), k_scale=1.0, v_scale=1.0)
    assert bool((k_cache.float() == 0).all()) and bool((v_cache.float() == 0).all())
