"""The guard (:mod:`pagedkv.testing.guard`) on its own: each violation it reports, and the honest kernel
shapes it must let through (a kept thread pool whose first call is guarded, declared nondeterminism within
its tolerance, large inputs left unchanged)."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time

import pytest
import torch

from pagedkv.backends.capabilities import Capabilities
from pagedkv.testing import guard as guard_module
from pagedkv.testing.guard import ContractViolation, GuardedBackend, storage_digest


def _args(tokens: int = 4, heads: int = 2, dim: int = 8, blocks: int = 4, block_size: int = 4):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(tokens, heads, dim, generator=gen)
    k_cache = torch.randn(blocks, block_size, heads, dim, generator=gen)
    v_cache = torch.randn(blocks, block_size, heads, dim, generator=gen)
    tables = torch.tensor([[0, 1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([tokens + 2], dtype=torch.int32)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    return query, k_cache, v_cache, tables, seq_lens, qsl


def _honest(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
    """Not attention: a function of the query and the pools that writes only its own output."""
    return query * 2 + k_cache[0, 0].sum() - v_cache[1, 0].mean()


class Kernel:
    """One ``paged_attention`` per test; ``calls`` counts them."""

    name = "kernel"

    def __init__(self, fn=_honest, capabilities=None):
        self.fn, self.calls = fn, 0
        if capabilities is not None:
            self.capabilities = capabilities

    def paged_attention(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _run(kernel, *, caps=None, judge=True, args=None):
    guard = GuardedBackend(kernel, caps)
    out = guard.paged_attention(*(args or _args()))
    if judge:
        guard.judge_again()
    return out


def test_an_honest_kernel_passes_and_is_judged_twice():
    kernel = Kernel()
    out = _run(kernel)
    assert kernel.calls == 3  # the call, then once on other values and once on the case's again
    torch.testing.assert_close(out, _honest(*_args()))


@pytest.mark.parametrize("cheat, message", [
    (lambda q, *a, **k: (q * 2).as_subclass(type("Sub", (torch.Tensor,), {})), "subclass"),
    (lambda q, *a, **k: (q * 2).double(), "output dtype"),
    (lambda q, *a, **k: (q * 2)[:-1], "output shape"),
    (lambda q, *a, **k: [q * 2], "not a torch.Tensor"),
    (lambda q, *a, **k: q.mul_(2), "shares memory with its input query"),
])
def test_an_output_outside_the_contract_is_a_violation(cheat, message):
    with pytest.raises(ContractViolation, match=message):
        _run(Kernel(cheat), judge=False)


@pytest.mark.parametrize("argument, scribble", [
    ("k_cache", lambda k, v, t: k[3].zero_()),  # a block no sequence owns
    ("block_tables", lambda k, v, t: t[0, 2].fill_(0)),  # the padding
])
def test_writing_an_input_is_a_violation_naming_it(argument, scribble):
    def kernel(q, k, v, t, *rest, **kw):
        scribble(k, v, t)
        return q * 2

    with pytest.raises(ContractViolation, match=f"wrote its input {argument}"):
        _run(Kernel(kernel), judge=False)


def test_an_output_reused_for_a_later_call_is_a_violation():
    buffer = {}

    def stale(q, *a, **k):
        out = buffer.setdefault("out", torch.empty_like(q))
        return out.copy_(q * 2)

    guard = GuardedBackend(Kernel(stale))
    first = guard.paged_attention(*_args())
    with pytest.raises(ContractViolation, match="earlier output"):
        guard.paged_attention(*_args())
    assert first is buffer["out"]


def test_a_result_cached_by_shape_is_caught_when_judged_twice():
    cache = {}

    def by_shape(q, *a, **k):
        return cache.setdefault(tuple(q.shape), q * 2).clone()

    with pytest.raises(ContractViolation, match="does not depend on them"):
        _run(Kernel(by_shape))


def test_a_thread_that_writes_the_output_after_the_return_is_a_violation():
    def early(q, *a, **k):
        out = torch.zeros_like(q)

        def work():
            time.sleep(0.02)
            out.copy_(q * 2)

        threading.Thread(target=work, name="late-writer", daemon=True).start()
        return out

    with pytest.raises(ContractViolation, match="late-writer.*the output changed after the call returned"):
        _run(Kernel(early), judge=False)


def test_a_kept_thread_pool_created_by_the_first_guarded_call_is_no_violation():
    # the workers it starts stay alive, idle, after the call returns: they write nothing more
    pool = {}

    def on_pool(q, k, v, *rest, **kw):
        executor = pool.setdefault("executor", concurrent.futures.ThreadPoolExecutor(2, "kernel-pool"))
        halves = [executor.submit(torch.mul, part, 2) for part in q.split(2)]
        return torch.cat([h.result() for h in halves]) + k[0, 0].sum() - v[1, 0].mean()

    kernel = Kernel(on_pool)
    try:
        out = _run(kernel)
        assert any(t.name.startswith("kernel-pool") and t.is_alive() for t in threading.enumerate())
        torch.testing.assert_close(out, _honest(*_args()))
        assert kernel.calls == 3
    finally:
        pool["executor"].shutdown()


def _scale_ulp(out: torch.Tensor, v_cache: torch.Tensor) -> float:
    """One ulp of the scale a rerun is judged against (the largest finite |V| or |output|), in out's dtype."""
    scale = max(float(out.abs().max()), float(v_cache.abs().max()))
    return torch.finfo(out.dtype).eps * 2.0 ** math.floor(math.log2(scale))


def _noisy(ulps_on_rerun: float, index: int = 0):
    """Exact on its first call; on every later one, output element ``index`` moves by ``ulps_on_rerun`` ulps
    of the scale (a reduction order that changes from run to run)."""
    state = {"n": 0}

    def kernel(q, k_cache, v_cache, *a, **k):
        state["n"] += 1
        out = _honest(q, k_cache, v_cache, *a, **k)
        if state["n"] > 1:
            flat = out.view(-1)
            flat[index] = flat[index] + ulps_on_rerun * _scale_ulp(out, v_cache)
        return out

    return kernel


def test_declared_nondeterminism_is_compared_within_its_tolerance():
    caps = Capabilities(nondeterminism_ulp=2)
    _run(Kernel(_noisy(2), caps), caps=caps)  # within: passes
    with pytest.raises(ContractViolation, match="more than the declared nondeterminism_ulp=2"):
        _run(Kernel(_noisy(3), caps), caps=caps)


def _near_zero_args():
    """Arguments where output element 0 is about 1e-6 (a cancellation) and the others about 1."""
    query, k_cache, v_cache, *rest = _args()
    query[0, 0, 0] = (-k_cache[0, 0].sum() + v_cache[1, 0].mean()) / 2 + 1e-6
    return (query, k_cache, v_cache, *rest)


def test_declared_nondeterminism_is_measured_against_the_scale_not_a_near_zero_element():
    # Fails before the rule used the scale: element 0 (~1e-6) moved by thousands of its own ulps.
    args = _near_zero_args()
    assert abs(float(_honest(*args)[0, 0, 0])) < 1e-4
    caps = Capabilities(nondeterminism_ulp=8)
    _run(Kernel(_noisy(4), caps), caps=caps, args=args)
    with pytest.raises(ContractViolation, match="nondeterminism_ulp=8"):
        _run(Kernel(_noisy(9), caps), caps=caps, args=_near_zero_args())


def test_nan_moved_by_a_rerun_is_a_violation_whatever_the_tolerance():
    state = {"n": 0}

    def nan_moves(q, *a, **k):
        state["n"] += 1
        out = _honest(q, *a, **k)
        out.view(-1)[state["n"]] = float("nan")  # NaN at element 1 first, at element 2 on the rerun
        return out

    caps = Capabilities(nondeterminism_ulp=64)
    with pytest.raises(ContractViolation, match="judged twice"):
        _run(Kernel(nan_moves, caps), caps=caps)


def test_the_nondeterminism_cap_depends_on_the_output_dtype():
    # Fails before the per-dtype cap: 40 bfloat16 ulps (~30% of max|V|) passed under a declared 64.
    caps = Capabilities(dtypes=frozenset({"bfloat16"}), nondeterminism_ulp=64)
    assert caps.rerun_ulps(torch.bfloat16) == 2 and caps.rerun_ulps("float32") == 64
    def bf16():
        return tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in _args())

    with pytest.raises(ContractViolation, match="nondeterminism_ulp=2"):
        _run(Kernel(_noisy(40), caps), caps=caps, args=bf16())
    _run(Kernel(_noisy(1), caps), caps=caps, args=bf16())
    _run(Kernel(_noisy(40), caps), caps=caps)  # float32 output: within 64


def test_undeclared_nondeterminism_is_a_violation_that_says_how_to_declare_it():
    with pytest.raises(ContractViolation, match=r"judged twice.*Capabilities\(nondeterminism_ulp=N\)"):
        _run(Kernel(_noisy(1)))


def test_the_tolerance_is_read_from_the_backends_own_capabilities():
    _run(Kernel(_noisy(1), Capabilities(nondeterminism_ulp=1)))


def test_a_nondeterminism_tolerance_out_of_range_is_refused():
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(ValueError, match="nondeterminism_ulp"):
            Capabilities(nondeterminism_ulp=bad)


def _large_args(monkeypatch):
    """The arguments, the pools counted as large (over the snapshot limit) without allocating 64 MiB."""
    monkeypatch.setattr(guard_module, "MAX_SNAPSHOT_BYTES", 1 << 14)
    monkeypatch.setattr(guard_module, "DIGEST_CHUNK", 1 << 10)
    return _args(blocks=64, block_size=16, heads=2, dim=32)  # 256 KiB pools, 32 chunks each


def test_a_large_input_written_is_a_violation(monkeypatch):
    def scribbles(q, k, v, *rest, **kw):
        v[40, 3, 1, 7] += 1  # one element of an unowned block of a large pool
        return q * 2

    with pytest.raises(ContractViolation, match=r"wrote its input v_cache at bytes .*index 40 of dim 0"):
        _run(Kernel(scribbles), args=_large_args(monkeypatch), judge=False)


def test_a_large_input_left_unchanged_passes(monkeypatch):
    _run(Kernel(), args=_large_args(monkeypatch), judge=False)


def test_a_storage_digest_sees_one_changed_word_and_reads_the_whole_storage_of_a_view():
    pool = torch.randn(3 << 20)  # 12 MiB: more than one chunk
    view = pool[:10]  # the digest covers the storage, not only the view
    before = storage_digest(view)
    pool[-5] = torch.nextafter(pool[-5], torch.tensor(float("inf")))
    after = storage_digest(view)
    assert before.shape == after.shape and not torch.equal(before, after)
    assert torch.equal(storage_digest(pool), after)


def test_each_xdist_worker_makes_its_own_cuda_device_current(monkeypatch):
    from pagedkv.testing import space

    chosen = []
    monkeypatch.delenv("PAGEDKV_DEVICE", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    assert space.select_device() == "cuda:1" and chosen == [torch.device("cuda:1")]
    assert space.select_device("cpu") == "cpu" and len(chosen) == 1


def test_the_guard_synchronises_every_cuda_device_its_tensors_are_on(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    meta = [("a", torch.empty(1, device="meta")), ("b", torch.empty(1, device="meta"))]
    guard_module._synchronize(meta)
    assert synced == []

    class OnDevice:  # stands in for CUDA tensors on two devices (no CUDA here)
        def __init__(self, index):
            self.device = torch.device("cuda", index)

    guard_module._synchronize([("a", OnDevice(1)), ("b", OnDevice(0))], OnDevice(1))
    assert sorted(d.index for d in synced) == [0, 1]


def test_the_state_machine_property_runs_its_calls_under_the_guard():
    # a write_kv that zeroes its key input once written: the pools hold the right values, so only the guard sees it
    from pagedkv.testing import execute
    from pagedkv.testing.registry import properties
    from pagedkv.testing.settings import mutant_settings
    from pagedkv.tools.mutants.cheats import CHEATS

    prop = properties()["cache_state_machine_holds_its_invariants"]
    outcome = execute.run(prop, (CHEATS["scribbles_key"](),), "cpu", mutant_settings("smoke", shrink=False))
    assert outcome.failed, outcome.status
    assert isinstance(outcome.failures[0].error, ContractViolation), outcome.first_line
    assert "wrote its input key" in outcome.first_line


def test_a_kernel_that_scribbles_only_on_large_pools_is_caught_at_the_limit_case():
    # over 64 MiB of inputs the call is not copied: the storage digest sees the write (it was never checked)
    from pagedkv.testing import execute
    from pagedkv.testing.registry import properties
    from pagedkv.testing.settings import mutant_settings
    from pagedkv.tools.mutants.backends import IndexedBackend

    class ScribblesLargePools(IndexedBackend):
        name = "scribbles_large_pools"

        def paged_attention(self, query, k_cache, v_cache, *args, **kwargs):
            out = IndexedBackend.paged_attention(self, query, k_cache, v_cache, *args, **kwargs)
            if k_cache.untyped_storage().nbytes() > (16 << 20):  # only where no copy is taken
                k_cache[1].fill_(1)  # a block no sequence of the limit case owns
            return out

    prop = properties()["paged_attention_is_exact_past_2_24_slots_at_a_declared_geometry"]
    outcome = execute.run(prop, (ScribblesLargePools(),), "cpu", mutant_settings("smoke", shrink=False))
    assert outcome.failed, outcome.status
    assert isinstance(outcome.failures[0].error, ContractViolation), outcome.first_line
    assert "wrote its input k_cache" in outcome.first_line
    honest = execute.run(prop, (IndexedBackend(),), "cpu", mutant_settings("smoke", shrink=False))
    assert honest.status == "passed", honest.first_line
