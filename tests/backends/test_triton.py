"""The ``triton`` backend: its kernels against the fp64 reference, and planted faults the properties catch.

Generic cross-backend properties live in ``test_properties*.py``; this file covers what is specific
to the Triton kernels and to :mod:`pagedkv.attention.blockwise` (the kernel's algorithm in plain torch):

- hand-picked attention shapes (decode, prefill over a prefix, GQA groups 3/5/6/7, block sizes
  1/3/16/256, head dims 1..256, float16/bfloat16, ``q_len = 0`` rows, NaN in every unowned slot and
  the tail of each last block, strided cache views) for both the blockwise reference and the kernel;
- the copy kernels bit for bit against the ``loop`` backend;
- fault planting: copies of the kernel source with one line broken must make a Hypothesis property
  fail, which shows the property can see that class of bug.

Without CUDA the kernels run in Triton's interpreter, so shapes here are tiny.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedkv import get_backend  # noqa: E402

from pagedkv.attention import blockwise
from pagedkv.attention.dense import reference_attention  # noqa: E402
from pagedkv.cache.config import blocks_needed  # noqa: E402
from pagedkv.errors import (ArgumentTypeError, ArgumentValueError, BackendUnavailableError,  # noqa: E402
                            BlockIndexError, ShapeError)
from pagedkv.testing.compare import assert_attention_close, assert_bitwise_equal  # noqa: E402

try:  # first: on CPU it sets TRITON_INTERPRET=1 before triton is imported
    triton_backend = get_backend("triton")
except BackendUnavailableError as exc:
    pytest.skip(str(exc), allow_module_level=True)
loop_backend = get_backend("loop")
from pagedkv.backends.triton import attention as triton_attention, kernels as triton_kernels, launch_grid  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# --------------------------------------------------------------------------------------------------
# A paged batch: logical K/V per sequence, scattered into shuffled blocks of a NaN-poisoned pool
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnCase:
    """One attention batch. ``seqs`` holds ``(seq_len, q_len)`` per sequence."""

    seqs: tuple[tuple[int, int], ...]
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype = F32
    seed: int = 0
    strided: bool = True  # k/v caches as kv[:, 0] / kv[:, 1] of one [num_blocks, 2, bs, H, D] tensor
    spare_blocks: int = 2  # blocks no sequence owns (poisoned)
    scale: float | None = None


@dataclass
class Paged:
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    q_starts: list[int]
    max_q_len: int


def materialize(case: AttnCase) -> Paged:
    """Tensors of ``case``: every slot no sequence owns (unowned blocks, tails of last blocks) is NaN."""
    g = torch.Generator().manual_seed(case.seed)
    bs, hkv, d, dtype = case.block_size, case.num_kv_heads, case.head_dim, case.dtype
    need = [blocks_needed(s, bs) for s, _ in case.seqs]
    num_blocks = sum(need) + case.spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    kv = torch.full((num_blocks, 2, bs, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    if case.strided:
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache, v_cache = kv[:, 0].clone(), kv[:, 1].clone()
    tables = torch.full((len(case.seqs), max(need, default=0) + 1), -1, dtype=torch.int32)
    keys, values, queries, starts = [], [], [], [0]
    used = 0
    for b, (seq_len, q_len) in enumerate(case.seqs):
        ids = perm[used:used + need[b]]
        used += need[b]
        tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, hkv, d, generator=g).to(dtype).to(DEVICE)
        v = torch.randn(seq_len, hkv, d, generator=g).to(dtype).to(DEVICE)
        for p in range(seq_len):
            k_cache[ids[p // bs], p % bs] = k[p]
            v_cache[ids[p // bs], p % bs] = v[p]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, hkv * case.group, d, generator=g).to(dtype))
        starts.append(starts[-1] + q_len)
    query = torch.cat(queries) if queries else torch.empty(0, hkv * case.group, d, dtype=dtype)
    return Paged(query.to(DEVICE), k_cache, v_cache, tables.to(DEVICE),
                 torch.tensor([s for s, _ in case.seqs], dtype=torch.int32, device=DEVICE),
                 torch.tensor(starts, dtype=torch.int32, device=DEVICE), keys, values, starts,
                 max((q for _, q in case.seqs), default=0))


def max_abs_logit(paged: Paged, scale: float) -> float:
    """Largest ``|q . k| * scale`` of the batch (the tolerance policy's logit-magnitude term)."""
    best = 0.0
    for b, k in enumerate(paged.keys):
        q = paged.query[paged.q_starts[b]:paged.q_starts[b + 1]].double()
        if q.numel() and k.numel():
            k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h -> kv head h // group
            best = max(best, float(torch.einsum("qhd,khd->hqk", q, k).abs().max()) * scale)
    return best


def check_against_reference(attention, case: AttnCase) -> None:
    """``attention(paged)`` equals the fp64 dense reference over the logical K/V, under the policy."""
    paged = materialize(case)
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.head_dim)
    out = attention(paged, scale)
    assert out.shape == paged.query.shape and out.dtype == paged.query.dtype
    expected = reference_attention(paged.query, paged.keys, paged.values, paged.q_starts, scale)
    max_v = max((float(v.double().abs().max()) for v in paged.values if v.numel()), default=1.0)
    assert_attention_close(out, expected, max_abs_logit=max_abs_logit(paged, scale), max_abs_value=max_v,
                           msg=f"{case!r}: ")


def via_backend(module):
    """``attention(paged, scale)`` through a backend-style module (validated entry point)."""
    def attention(p: Paged, scale: float) -> torch.Tensor:
        return module.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc,
                                      scale)
    return attention


def via_kernels(kernels_module):
    """``attention(paged, scale)`` straight through a kernels module's launcher (no validation)."""
    def attention(p: Paged, scale: float) -> torch.Tensor:
        return kernels_module.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              p.query_start_loc, scale, p.max_q_len)
    return attention


# --------------------------------------------------------------------------------------------------
# (a) Hand-picked shapes: blockwise reference and kernel each equal the fp64 reference
# --------------------------------------------------------------------------------------------------

CASES = {
    "decode_mha_bs16": AttnCase(((1, 1), (5, 1), (16, 1), (17, 1)), 16, 2, 1, 8),
    "decode_gqa3_bs3": AttnCase(((7, 1), (13, 1), (3, 1)), 3, 2, 3, 8),
    "prefill_prefix_gqa5_bs3": AttnCase(((11, 4), (6, 6)), 3, 2, 5, 4),
    "mixed_gqa6_bs5_d5": AttnCase(((9, 1), (12, 5), (5, 2)), 5, 1, 6, 5),
    "prefill_gqa7_bs7_d3": AttnCase(((10, 3), (14, 1)), 7, 2, 7, 3),
    "bs1_gqa2": AttnCase(((6, 2), (3, 1), (1, 1)), 1, 2, 2, 4),
    "q_len0_in_batch": AttnCase(((5, 0), (8, 3), (4, 0), (9, 1)), 4, 2, 2, 4),
    "only_q_len0": AttnCase(((5, 0), (0, 0)), 4, 1, 1, 4),
    "empty_batch": AttnCase((), 4, 2, 2, 4),
    "mqa_head_dim1": AttnCase(((7, 2), (4, 1)), 3, 1, 4, 1),
    "multi_tile_q_and_kv": AttnCase(((70, 20), (33, 1), (16, 16)), 16, 2, 4, 16),  # 2 query tiles, 2 key tiles
    "contiguous_caches_scale": AttnCase(((9, 3), (17, 1)), 16, 2, 2, 8, strided=False, scale=0.3),
    "block_size_256": AttnCase(((300, 2), (256, 1)), 256, 1, 2, 4, spare_blocks=1),
    "fp16_decode_gqa3": AttnCase(((19, 1), (5, 1)), 16, 2, 3, 8, F16),
    "fp16_prefill_bs3": AttnCase(((11, 5), (4, 4)), 3, 2, 2, 8, F16, seed=1),
    "bf16_decode_gqa5": AttnCase(((19, 1), (5, 1)), 16, 1, 5, 8, BF16),
    "bf16_prefill_bs1": AttnCase(((7, 3), (3, 2)), 1, 2, 2, 5, BF16, seed=2),
}
CASES.update({f"head_dim_{d}_{dt}".replace("torch.", ""): AttnCase(((20, 1), (9, 3)), 16, 2, 2, d, dt, seed=d)
              for d in (64, 80, 96, 128, 256) for dt in (F32, F16)})

IMPLS = {"blockwise": via_backend(blockwise), "triton": via_backend(triton_backend)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attention_matches_fp64_reference(impl, case):
    check_against_reference(IMPLS[impl], case)


def test_attention_accepts_int64_metadata_strided_query_and_validate_false():
    case = CASES["mixed_gqa6_bs5_d5"]
    p = materialize(case)
    wide = torch.full((p.query.shape[0], p.query.shape[1], 2 * case.head_dim), float("nan"), dtype=case.dtype,
                      device=DEVICE)
    wide[..., ::2] = p.query  # query as a stride-2 view in head_dim
    wide_tables = torch.full((p.block_tables.shape[0], p.block_tables.shape[1] + 3), 7, dtype=torch.int64,
                             device=DEVICE)
    wide_tables[:, :p.block_tables.shape[1]] = p.block_tables
    out = triton_backend.paged_attention(wide[..., ::2], p.k_cache, p.v_cache, wide_tables[:, :p.block_tables.shape[1]],
                                         p.seq_lens.long(), p.query_start_loc.long())
    expected = triton_backend.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              p.query_start_loc)
    assert_bitwise_equal(out, expected)
    unchecked = triton_backend.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                               p.query_start_loc, validate=False)
    assert_bitwise_equal(unchecked, expected)


def test_attention_validates_before_launch():
    p = materialize(CASES["decode_gqa3_bs3"])
    bad = p.block_tables.clone()
    bad[0, 0] = p.k_cache.shape[0]
    with pytest.raises(BlockIndexError, match="block_tables"):
        triton_backend.paged_attention(p.query, p.k_cache, p.v_cache, bad, p.seq_lens, p.query_start_loc)
    with pytest.raises(ShapeError, match="num_q_heads"):
        triton_backend.paged_attention(p.query[:, :5], p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                       p.query_start_loc)


# --------------------------------------------------------------------------------------------------
# Copy kernels: bit for bit equal to the loop backend (poison and frame included)
# --------------------------------------------------------------------------------------------------

COPY_GEOMETRIES = [(1, 2, 3, F32), (3, 3, 5, F16), (16, 2, 8, BF16), (5, 1, 64, F32)]  # bs, H, D, dtype


def poisoned_pool(num_blocks, block_size, heads, head_dim, dtype, seed):
    """A strided cache view ``kv[:, 1]`` of random values with NaN sprinkled in (payloads must survive)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, 2, block_size, heads, head_dim, generator=g).to(dtype)
    kv[torch.rand(kv.shape, generator=g) < 0.2] = float("nan")
    return kv.to(DEVICE)[:, 1]


@pytest.mark.parametrize("bs,heads,head_dim,dtype", COPY_GEOMETRIES)
def test_gather_equals_loop_bitwise(bs, heads, head_dim, dtype):
    cache = poisoned_pool(7, bs, heads, head_dim, dtype, seed=bs)
    table = torch.tensor([4, 0, 6, 2, 5, 1, 3][: blocks_needed(3 * bs + 1, bs)] + [-1, -1], dtype=torch.int32,
                         device=DEVICE)
    for seq_len in sorted({0, 1, bs - 1, bs, bs + 1, 3 * bs + 1}):
        need = blocks_needed(seq_len, bs)
        for tab in (table, table.long(), table[:need].tolist()):
            assert_bitwise_equal(triton_backend.gather(cache, tab, seq_len), loop_backend.gather(cache, tab, seq_len),
                                 msg=f"seq_len={seq_len}: ")


@pytest.mark.parametrize("bs,heads,head_dim,dtype", COPY_GEOMETRIES)
def test_scatter_equals_loop_bitwise(bs, heads, head_dim, dtype):
    g = torch.Generator().manual_seed(bs)
    table = torch.tensor([3, 6, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    for start, n in ((0, 0), (0, 1), (bs - 1, 2), (1, 3 * bs), (bs, 2 * bs + 1)):
        if blocks_needed(start + n, bs) > table.numel():
            continue
        values = torch.randn(n, heads, 2 * head_dim, generator=g).to(dtype).to(DEVICE)[..., ::2]  # strided values
        ours, theirs = poisoned_pool(7, bs, heads, head_dim, dtype, seed=1), poisoned_pool(7, bs, heads, head_dim,
                                                                                           dtype, seed=1)
        triton_backend.scatter(ours, table, values, start)
        loop_backend.scatter(theirs, table, values, start)
        assert_bitwise_equal(ours, theirs, msg=f"start={start} n={n}: ")


#: V widths of their own beside K's (MLA: 512 of 576): narrower, wider, and MLA's shape at a small scale.
WRITE_GEOMETRIES = COPY_GEOMETRIES + [(3, 3, 5, F32, 2), (2, 2, 3, F16, 6), (4, 1, 9, F32, 8)]


@pytest.mark.parametrize("bs,heads,head_dim,dtype,head_dim_v", [(*g, g[2]) for g in COPY_GEOMETRIES]
                         + WRITE_GEOMETRIES[len(COPY_GEOMETRIES):])
def test_write_kv_equals_loop_bitwise(bs, heads, head_dim, dtype, head_dim_v):
    g = torch.Generator().manual_seed(bs)
    num_slots = 7 * bs
    slots = torch.randperm(num_slots, generator=g)[: min(num_slots, 9)]
    slots[::3] = -1  # padding tokens: skipped
    n = slots.numel()
    key = torch.randn(n, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(n, heads, head_dim_v, generator=g).to(dtype).to(DEVICE)
    caches = [poisoned_pool(7, bs, heads, d, dtype, seed=s) for s, d in ((1, head_dim), (2, head_dim_v)) * 2]
    triton_backend.write_kv(caches[0], caches[1], key, value, slots.to(DEVICE))
    loop_backend.write_kv(caches[2], caches[3], key, value, slots.to(DEVICE))
    assert_bitwise_equal(caches[0], caches[2], msg="k_cache: ")
    assert_bitwise_equal(caches[1], caches[3], msg="v_cache: ")
    triton_backend.write_kv(caches[0], caches[1], key[:0], value[:0], slots[:0].to(DEVICE))  # no tokens: no-op
    assert_bitwise_equal(caches[0], caches[2])


def test_failed_write_writes_nothing():
    cache = poisoned_pool(4, 3, 2, 4, F32, seed=0)
    before = cache.clone()
    values = torch.zeros(5, 2, 4, device=DEVICE)
    with pytest.raises(BlockIndexError):
        triton_backend.scatter(cache, [0, 9], values, 1)
    with pytest.raises(BlockIndexError):
        triton_backend.write_kv(cache, cache.clone(), values, values, torch.tensor([0, 1, 2, 3, 12], device=DEVICE))
    assert_bitwise_equal(cache, before)


# --------------------------------------------------------------------------------------------------
# Importing the backend without CUDA
# --------------------------------------------------------------------------------------------------

_IMPORT_PROBE = """
import os, sys
if sys.argv[1] == "triton-first":
    import triton
import pagedkv
from pagedkv.errors import BackendUnavailableError
try:
    pagedkv.get_backend("triton")
    print("ok", os.environ.get("TRITON_INTERPRET"))
except BackendUnavailableError as e:
    print("unavailable:", e)
print("available:", pagedkv.available_backends())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback to Triton's interpreter")
@pytest.mark.parametrize("how", ["unset", "interpret-0", "triton-first"])
def test_cpu_import_uses_interpreter_or_says_why_not(how):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if how == "interpret-0":
        env["TRITON_INTERPRET"] = "0"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, how], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    available = res.stdout.split("available:")[-1]
    if how == "unset":
        assert "ok 1" in res.stdout and "'triton'" in available, res.stdout
    else:
        assert "unavailable:" in res.stdout and "TRITON_INTERPRET=1 before importing triton" in res.stdout, res.stdout
        assert "'triton'" not in available, res.stdout


# --------------------------------------------------------------------------------------------------
# (b) Fault planting: the property must fail on kernel copies with one line broken
# --------------------------------------------------------------------------------------------------

# Each fault is an exact line of the kernel source and its broken replacement.
FAULTS = {
    # The kernel maps kv head -> query heads (a program serves one kv head's whole group); the broken
    # line serves heads kv_head, kv_head + num_kv_heads, ...: query head h reading kv head
    # h % num_kv_heads instead of h // (num_q_heads // num_kv_heads).
    "gqa_h_mod_num_kv_heads": ("    q_head = kv_head * QUERIES_PER_KV + g\n",
                               "    q_head = g * num_kv_heads + kv_head\n"),
    # The per-token mask on the last block removed: only whole blocks are masked, so the slots past
    # seq_len in the last block (poisoned) are loaded. Table reads stay in bounds.
    "no_tail_mask_last_block": ("        tok_ok = kpos < seq_len\n",
                                "        tok_ok = blk_idx < num_seq_blocks\n"),
}


def plant(fault: str, tmp_path: Path):
    """Import a copy of :mod:`pagedkv.backends.triton.attention` with ``fault`` planted, as a separate module."""
    source = Path(triton_attention.__file__).read_text()
    line, broken = FAULTS[fault]
    assert source.count(line) == 1, f"fault {fault!r}: target line not found exactly once in the kernel source"
    path = tmp_path / f"faulty_{fault}.py"
    path.write_text(source.replace(line, broken))
    spec = importlib.util.spec_from_file_location(f"pagedkv_faulty_{fault}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@st.composite
def small_attention_cases(draw) -> AttnCase:
    """Random small batches: <= 3 sequences, <= 6 blocks each, <= 4 query heads, head_dim <= 8."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]) if num_kv_heads == 2 else st.sampled_from([1, 2, 3, 4]))
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        seq_len = draw(st.integers(0, 6 * block_size))
        seqs.append((seq_len, draw(st.integers(0, min(seq_len, 4)))))
    return AttnCase(tuple(seqs), block_size, num_kv_heads, group, draw(st.sampled_from([1, 3, 4, 8])),
                    draw(st.sampled_from([F32, F32, F16, BF16])), seed=draw(st.integers(0, 2**16)),
                    strided=draw(st.booleans()), spare_blocks=draw(st.integers(0, 2)))


def fused_matches_reference(attention, max_examples: int = 25):
    """The property as a runnable test: ``attention`` equals the fp64 reference on random small cases."""
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=small_attention_cases())
    def prop(case):
        check_against_reference(attention, case)
    return prop


def test_property_holds_for_the_kernel():
    fused_matches_reference(via_kernels(triton_kernels))()


@pytest.mark.parametrize("fault", FAULTS)
def test_property_catches_planted_fault(fault, tmp_path):
    faulty = plant(fault, tmp_path)
    with pytest.raises(AssertionError):
        fused_matches_reference(via_kernels(faulty))()


# --------------------------------------------------------------------------------------------------
# Split-K decode: the context split across programs and merged equals the unsplit kernel
# --------------------------------------------------------------------------------------------------

SPLIT_CASES = {
    **{k: CASES[k] for k in ("decode_mha_bs16", "decode_gqa3_bs3", "mixed_gqa6_bs5_d5", "multi_tile_q_and_kv",
                             "q_len0_in_batch", "only_q_len0", "empty_batch", "block_size_256", "fp16_decode_gqa3",
                             "bf16_decode_gqa5", "head_dim_80_float32")},
    # splits that see no key: contexts shorter than the split count
    "short_contexts": AttnCase(((1, 1), (2, 1), (3, 1), (1, 0)), 1, 2, 4, 8),
    "long_decode": AttnCase(((300, 1), (97, 1)), 16, 1, 4, 16, seed=5),
}


def via_splits(n: int | None):
    """The validated backend with the context split into ``n`` parts (``None``: no forced count)."""
    def attention(p: Paged, scale: float, **features) -> torch.Tensor:
        with triton_kernels.splits(n):
            return triton_backend.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                                  p.query_start_loc, scale, **features)
    return attention


def assert_split_close(split: torch.Tensor, unsplit: torch.Tensor, msg: str = "") -> None:
    """Split and unsplit outputs agree within the float32 tolerance (one output rounding apart otherwise)."""
    if split.dtype == F32:
        torch.testing.assert_close(split, unsplit, rtol=2e-5, atol=2e-5, msg=lambda m: f"{msg}{m}")
    else:
        eps = torch.finfo(split.dtype).eps
        torch.testing.assert_close(split.float(), unsplit.float(), rtol=2 * eps, atol=2 * eps,
                                   msg=lambda m: f"{msg}{m}")


@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("case", SPLIT_CASES.values(), ids=SPLIT_CASES.keys())
def test_split_k_equals_unsplit_and_the_reference(case, num_splits):
    check_against_reference(via_splits(num_splits), case)
    p = materialize(case)
    scale = 1.0 / math.sqrt(case.head_dim)
    assert_split_close(via_splits(num_splits)(p, scale), via_splits(1)(p, scale), msg=f"{num_splits} splits: ")


@pytest.mark.parametrize("features", [dict(window_left=0), dict(window_left=5), dict(window_left=40),
                                      dict(sinks=True), dict(sinks=True, window_left=3), dict(softcap=2.0),
                                      dict(alibi=True, window_left=7)], ids=str)
def test_split_k_with_features_equals_unsplit(features):
    """Windows leave most splits without a visible key; a sink joins the first split only."""
    case = AttnCase(((70, 1), (9, 1), (33, 3), (1, 1)), 4, 2, 3, 8, seed=3)
    p = materialize(case)
    heads = case.num_kv_heads * case.group
    g = torch.Generator().manual_seed(0)
    kw = {k: v for k, v in features.items() if k in ("window_left", "softcap")}
    if features.get("sinks"):
        kw["sinks"] = torch.randn(heads, generator=g).to(DEVICE)
    if features.get("alibi"):
        kw["alibi_slopes"] = torch.rand(heads, generator=g).to(DEVICE)
    scale = 1.0 / math.sqrt(case.head_dim)
    expected = blockwise.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                         p.query_start_loc, scale, **kw)
    unsplit = via_splits(1)(p, scale, **kw)
    for n in (2, 5, 16):
        out = via_splits(n)(p, scale, **kw)
        assert_split_close(out, unsplit, msg=f"{n} splits {features}: ")
        assert_split_close(out, expected, msg=f"{n} splits vs blockwise {features}: ")


def test_split_k_auto_count_is_one_on_cpu_and_a_keyword_overrides_it():
    p = materialize(SPLIT_CASES["long_decode"])
    assert triton_kernels.num_splits_for(p.query, 2, 1, 320, 1, True) == (1 if DEVICE == "cpu" else
                                                                          triton_kernels.num_splits_for(
                                                                              p.query, 2, 1, 320, 1, True))
    assert triton_kernels.num_splits_for(p.query, 2, 1, 320, 1, True, num_splits=4) == 4
    with triton_kernels.splits(6):
        assert triton_kernels.num_splits_for(p.query, 2, 1, 320, 1, False) == 6
    via = triton_kernels.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                         p.query_start_loc, 0.25, p.max_q_len, num_splits=4)
    assert_split_close(via, via_splits(4)(p, 0.25))


def _attend(p: Paged, scale: float, **kw) -> torch.Tensor:
    return triton_backend.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                          p.query_start_loc, scale, **kw)


@pytest.mark.parametrize("name", ["short_contexts", "long_decode", "mixed_gqa6_bs5_d5"])
def test_num_splits_argument_equals_unsplit_and_overrides_the_environment(name, monkeypatch):
    """``num_splits`` on the public op splits the context (equal to ``num_splits=1`` within float32
    rounding, and to the forced split); the argument wins over ``$PAGEDKV_NUM_SPLITS``."""
    p = materialize(SPLIT_CASES[name])
    scale = 1.0 / math.sqrt(SPLIT_CASES[name].head_dim)
    unsplit = _attend(p, scale, num_splits=1)
    assert_bitwise_equal(unsplit, via_splits(1)(p, scale), "num_splits=1 vs splits(1): ")
    for n in (2, 5):
        out = _attend(p, scale, num_splits=n)
        assert_bitwise_equal(out, via_splits(n)(p, scale), f"num_splits={n} vs splits({n}): ")
        assert_split_close(out, unsplit, msg=f"num_splits={n}: ")
    monkeypatch.setenv(launch_grid.SPLITS_ENV, "4")
    assert_bitwise_equal(_attend(p, scale), via_splits(4)(p, scale), "$PAGEDKV_NUM_SPLITS=4: ")
    assert_bitwise_equal(_attend(p, scale, num_splits=1), unsplit, "num_splits=1 under $PAGEDKV_NUM_SPLITS=4: ")


def test_num_splits_is_validated_by_every_backend_before_any_launch(monkeypatch):
    p = materialize(SPLIT_CASES["short_contexts"])
    for backend in (triton_backend, get_backend("loop"), get_backend("indexed")):
        for bad, error in ((0, ArgumentValueError), (-2, ArgumentValueError), (65536, ArgumentValueError),
                           (2.0, ArgumentTypeError), (True, ArgumentTypeError), ("4", ArgumentTypeError)):
            with pytest.raises(error, match="num_splits"):
                backend.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                        p.query_start_loc, num_splits=bad)
    loop = get_backend("loop")
    plain = loop.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc)
    assert_bitwise_equal(loop.paged_attention(p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              p.query_start_loc, num_splits=3), plain, "loop ignores num_splits: ")
    for text in ("0", "two"):
        monkeypatch.setenv(launch_grid.SPLITS_ENV, text)
        with pytest.raises(ArgumentValueError, match=launch_grid.SPLITS_ENV):
            _attend(p, 0.5)


def test_triton_declares_split_k_and_the_suite_draws_split_counts_for_it():
    from pagedkv.backends.capabilities import capabilities_of

    assert capabilities_of(triton_backend).split_k
    assert not capabilities_of(get_backend("loop")).split_k and not capabilities_of(get_backend("indexed")).split_k


class SplitBackend:
    """The ``triton`` backend with every attention launch split into a fixed number of parts."""

    def __init__(self, num_splits: int):
        self.num_splits = num_splits
        self.name = f"triton-split{num_splits}"
        self.FEATURES = triton_backend.FEATURES
        self.gather, self.scatter = triton_backend.gather, triton_backend.scatter
        self.write_kv = triton_backend.write_kv

    def paged_attention(self, *args, **kwargs):
        with triton_kernels.splits(self.num_splits):
            return triton_backend.paged_attention(*args, **kwargs)


#: The conformance suite draws split counts for this backend (``Case.num_splits``), so every attention
#: property there already runs split; these two also run at a fixed count of 3 for every launch: the
#: reference, and a request alone equals itself in a batch (decode and prefill tiles step through keys
#: alike, so a split decode rounds the same beside a prefill as alone).
SPLIT_PROPERTIES = ["paged_attention_matches_fp64_dense_reference",
                    "a_request_alone_equals_the_same_request_in_a_batch"]


#: examples per property here (the explicit examples run too); PAGEDKV_PROFILE=gpu/nightly: the profile's count
SPLIT_EXAMPLES = None if os.environ.get("PAGEDKV_PROFILE") in ("gpu", "nightly") else 8


@pytest.mark.slow(reason="every push runs these properties on the triton backend at drawn split counts (1, 2, 3 and "
                        "the empty-split edge) and test_split_k_equals_unsplit_and_the_reference at 2, 3 and 8 splits; "
                        "every launch of a run split in 3 waits for the nightly tier")
@pytest.mark.parametrize("prop", SPLIT_PROPERTIES)
def test_suite_attention_properties_hold_for_a_fixed_split(prop):
    import dataclasses

    from pagedkv.testing.registry import properties
    from pagedkv.tools.mutants.kill_table import case_summary, run_property

    chosen = properties()[prop]
    if SPLIT_EXAMPLES is not None:
        chosen = dataclasses.replace(chosen, max_examples=min(chosen.max_examples or SPLIT_EXAMPLES, SPLIT_EXAMPLES))
    profile = os.environ.get("PAGEDKV_PROFILE", "dev")
    outcome = run_property(SplitBackend(3), chosen, profile if profile in ("gpu", "nightly") else "dev", DEVICE)
    assert not outcome.failed, f"{prop} with 3 splits: {outcome.first_line}\n{case_summary(outcome)}"
    assert outcome.examples_judged > 0 and outcome.status != "skipped", outcome.first_line


@pytest.mark.parametrize("name", ["decode_mha_bs16", "q_len0_in_batch", "mixed_gqa6_bs5_d5", "multi_tile_q_and_kv"])
def test_unknown_max_q_len_is_bounded_by_total_q(name):
    """``max_q_len < 0`` (no host read of ``query_start_loc``): decode tiles when ``total_q <= batch``, packed
    query tiles found by search, split or not."""
    for n in (1, 3):
        check_against_reference(lambda p, scale, n=n: triton_kernels.paged_attention(
            p.query, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, p.query_start_loc, scale, -1, num_splits=n),
            CASES[name])
