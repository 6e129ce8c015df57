"""The sync-free hot path: validation levels, the ``torch.library`` custom ops, ``torch.compile`` and CUDA graphs.

``write_kv`` and ``paged_attention`` at validation level ``"metadata"`` read no tensor data on the host,
so a decode step (write the new token's K/V, attend) compiles to one graph with ``fullgraph=True`` and,
on a GPU, runs under ``torch.cuda.set_sync_debug_mode("error")`` and inside a captured CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.attention.dense import paged_attention_sync_free
from pagedkv.backends import available_backends, get_backend, indexed
from pagedkv.errors import ArgumentTypeError, BlockIndexError, DTypeMismatchError, ShapeError
from pagedkv.validation.calls import LEVELS, validation_level

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the gpu profile's sync and graph checks)")
HAS_TRITON = "triton" in available_backends()


def _decode_inputs(device="cpu", dtype=torch.float32, batch=3, nb=24, bs=4, kvh=2, group=2, d=16, seed=0):
    """Pools with poison in unowned blocks, one new token per sequence, tables padded with -1."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
    v = torch.randn(nb, bs, kvh, d, generator=g).to(device, dtype)
    k[-1], v[-1] = float("nan"), float("inf")  # never owned: must not reach the output
    lens = [5 + 4 * b for b in range(batch)]
    width = max(math.ceil(n / bs) for n in lens) + 1
    tables, slots, nxt = torch.full((batch, width), -1, dtype=torch.int32), [], 0
    for b, n in enumerate(lens):
        need = math.ceil(n / bs)
        tables[b, :need] = torch.arange(nxt, nxt + need)
        slots.append(int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs)
        nxt += need
    return dict(
        query=torch.randn(batch, kvh * group, d, generator=g).to(device, dtype), k_cache=k, v_cache=v,
        key=torch.randn(batch, kvh, d, generator=g).to(device, dtype),
        value=torch.randn(batch, kvh, d, generator=g).to(device, dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device))


def _decode_step(backend, level):
    def step(query, k_cache, v_cache, key, value, slot_mapping, block_tables, seq_lens, query_start_loc):
        backend.write_kv(k_cache, v_cache, key, value, slot_mapping, level)
        return backend.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, None, level)
    return step


@pytest.fixture
def inductor_without_probes():
    """Inductor with its CPU vector ISA read from the CPU's flags (``cpp.vec_isa_ok``) and no precompiled
    header: on a fresh machine the ISA probes and the header took 10 of a compile's 17 s; the kernel it
    generates is compiled and run all the same."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": True, "cpp_cache_precompile_headers": False}):
        yield


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _run(step, x):
    """``step`` on copies of the pools: (output, k_cache, v_cache)."""
    x = {**x, "k_cache": x["k_cache"].clone(), "v_cache": x["v_cache"].clone()}
    return step(**x), x["k_cache"], x["v_cache"]


def test_validate_accepts_bools_and_the_three_levels():
    assert [validation_level(v) for v in (True, False, *LEVELS)] == ["full", "none", *LEVELS]
    for bad in ("meta", 1, None):
        with pytest.raises(ArgumentTypeError, match="validate must be"):
            validation_level(bad)


def test_metadata_level_catches_metadata_faults_and_leaves_data_faults_to_full():
    x = _decode_inputs()
    dup = x["slot_mapping"].clone()
    dup[1] = dup[0]
    with pytest.raises(ShapeError, match="twice"):
        indexed.write_kv(x["k_cache"], x["v_cache"], x["key"], x["value"], dup)
    indexed.write_kv(x["k_cache"], x["v_cache"], x["key"], x["value"], dup, "metadata")  # not checked: not read
    with pytest.raises(DTypeMismatchError):
        indexed.write_kv(x["k_cache"], x["v_cache"], x["key"].double(), x["value"], x["slot_mapping"], "metadata")
    with pytest.raises(ShapeError, match="overlaps"):
        indexed.write_kv(x["k_cache"], x["v_cache"], x["k_cache"][0, :3], x["value"], x["slot_mapping"], "metadata")
    bad = x["block_tables"].clone()
    bad[0, 0] = 999
    args = (x["query"], x["k_cache"], x["v_cache"], bad, x["seq_lens"], x["query_start_loc"])
    with pytest.raises(BlockIndexError):
        indexed.paged_attention(*args)
    with pytest.raises(ShapeError, match="query_start_loc must have"):
        indexed.paged_attention(*args[:5], x["query_start_loc"][:-1], None, "metadata")


@pytest.mark.parametrize("features", [{}, {"window_left": 3}, {"softcap": 2.0}, {"alibi": True}, {"sinks": True}])
def test_sync_free_attention_equals_the_gathering_path(features):
    """The algorithm the custom op runs on a GPU, run here: equal to level "full" within float32 tolerance."""
    x = _decode_inputs(batch=4, seed=3)
    q_len = [0, 3, 1, 2]  # prefill rows over a cached prefix, a sequence with no query
    x["query_start_loc"] = torch.tensor([0, *torch.tensor(q_len).cumsum(0).tolist()], dtype=torch.int32)
    x["query"] = torch.randn(sum(q_len), *x["query"].shape[1:])
    heads = x["query"].shape[1]
    kw = {"window_left": features.get("window_left", -1), "softcap": features.get("softcap", 0.0),
          "alibi_slopes": torch.rand(heads) if "alibi" in features else None,
          "sinks": torch.randn(heads) if "sinks" in features else None}
    meta = [x[k] for k in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")]
    expected = indexed.paged_attention(*meta, None, **kw)
    got = paged_attention_sync_free(*meta, 1 / math.sqrt(meta[0].shape[-1]), **kw)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_sync_free_writes_skip_padding_rows():
    x = _decode_inputs()
    for slots in ([-1, 9, -1], [-1, -1, -1]):
        k, v = x["k_cache"].clone(), x["v_cache"].clone()
        indexed.write_slots_sync_free(k, v, x["key"], x["value"], torch.tensor(slots))
        ek, ev = x["k_cache"].clone(), x["v_cache"].clone()
        indexed.write_kv(ek, ev, x["key"], x["value"], torch.tensor(slots))
        assert _same_bits(k, ek) and _same_bits(v, ev)


def _op_args(x, fp8=False):
    scales = (torch.full((2,), 0.5), torch.full((2,), 0.25)) if fp8 else (None, None)
    k, v = x["k_cache"].nan_to_num(), x["v_cache"].nan_to_num(posinf=1.0)  # opcheck compares pools with allclose
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    write = (k, v, x["key"], x["value"], x["slot_mapping"], *scales, False)
    attend = (x["query"], k, v, x["block_tables"], x["seq_lens"], x["query_start_loc"], 0.25, -1, 0.0, None, None,
              *scales)
    return write, attend


#: opcheck's schema test does arithmetic on every input, which CPU torch lacks for float8: fp8 runs the rest
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
def test_opcheck_indexed_ops(fp8):
    write, attend = _op_args(_decode_inputs(), fp8)
    kw = {"test_utils": FP8_OPCHECKS} if fp8 else {}
    torch.library.opcheck(torch.ops.pagedkv.write_kv.default, write, **kw)
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, attend, **kw)
    window = attend[:7] + (2, 3.0, torch.rand(4), torch.randn(4)) + attend[11:]
    torch.library.opcheck(torch.ops.pagedkv.paged_attention.default, window, **kw)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_opcheck_triton_ops():
    get_backend("triton")
    write, attend = _op_args(_decode_inputs())
    torch.library.opcheck(torch.ops.pagedkv.triton_write_kv.default, write)
    torch.library.opcheck(torch.ops.pagedkv.triton_paged_attention.default, attend[:7] + (-1,) + attend[7:])


@pytest.mark.parametrize("name", ["indexed", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed"))])
def test_a_decode_step_compiles_to_one_graph_and_matches_eager(name, inductor_without_probes):
    backend = get_backend(name)
    x = _decode_inputs()
    step = _decode_step(backend, "metadata")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(**{**x, "k_cache": x["k_cache"].clone(), "v_cache": x["v_cache"].clone()})
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(step, fullgraph=True)
    out, k, v = _run(compiled, x)
    ref, ek, ev = _run(_decode_step(backend, "full"), x)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    assert _same_bits(k, ek) and _same_bits(v, ev)


def test_compiled_metadata_level_still_refuses_an_overlapping_key(inductor_without_probes):
    x = _decode_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda k, v, key, value, s: indexed.write_kv(k, v, key, value, s, "metadata"),
                             fullgraph=True)
    k = x["k_cache"].clone()
    with pytest.raises(ShapeError, match="overlaps"):  # judged inside the op, on the real tensors
        compiled(k, x["v_cache"], k[0, :3], x["value"], x["slot_mapping"])


@needs_cuda
@pytest.mark.parametrize("name", ["indexed", "triton"])
def test_metadata_level_never_synchronises_on_cuda(name):
    if name == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    backend, x = get_backend(name), _decode_inputs("cuda")
    step = _decode_step(backend, "metadata")
    ref, _, _ = _run(_decode_step(backend, "full"), x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _, _ = _run(step, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@needs_cuda
@pytest.mark.parametrize("name", ["indexed", "triton"])
def test_a_decode_step_runs_in_a_captured_cuda_graph(name):
    if name == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    backend, x = get_backend(name), _decode_inputs("cuda")
    step = _decode_step(backend, "metadata")
    ref, ek, _ = _run(_decode_step(backend, "full"), x)
    static = {**x, "k_cache": x["k_cache"].clone(), "v_cache": x["v_cache"].clone()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(**{**static, "k_cache": static["k_cache"].clone(), "v_cache": static["v_cache"].clone()})  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(**static)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    assert _same_bits(static["k_cache"], ek)
