"""Cheating candidates (:mod:`pagedkv.tools.mutants.cheats`) are caught by the gate's core, and each
failure's case file replays in a fresh process to the failure, or says why it cannot.

Each cheat runs the registered properties (attention and ``write_kv`` first) through
:func:`pagedkv.testing.execute.run` under the ``smoke`` profile without shrinking, and stops at the
first failure, which must be the check :data:`CAUGHT_BY` names for it (the property and the words of the
guard or comparison that fails it: a harness error or another check is no catch). An honest control
(the same ``indexed`` backend without the trick) runs through the same loop and fails nothing. Replay
then runs in a new interpreter, where the cheat's state (caches, call counts) starts empty (every run
for the cheats whose failure depends on that state, under ``slow`` for the others).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.testing import execute
from pagedkv.testing.compare import Mismatch
from pagedkv.testing.guard import ContractViolation
from pagedkv.tools.mutants.backends import IndexedBackend
from pagedkv.tools.mutants.cheats import CHEATS
from pagedkv.testing.settings import mutant_settings as hypothesis_settings
from pagedkv.testing.registry import properties

ATTENTION = "paged_attention_matches_fp64_dense_reference"
WRITE = "write_kv_lands_at_slot_mapping_and_skips_negative_slots"
FIRST = (ATTENTION, WRITE)
ROOT = Path(__file__).resolve().parents[2]

#: cheat -> (the property that catches it, the guard's violation or None for the reference comparison, the
#: words of the message that say which check it was).
CAUGHT_BY = {
    "bfloat16_inside": (ATTENTION, None, "vs fp64 reference"),
    "cache_by_pointer": (ATTENTION, ContractViolation, "returned the same bits for other"),
    "cache_by_shape": (ATTENTION, ContractViolation, "returned the same bits for other"),
    "float32_output": (ATTENTION, ContractViolation, "output dtype torch.float32"),
    "lazy_subclass": (ATTENTION, ContractViolation, "output is a torch.Tensor subclass"),
    "nondeterministic_ulp": (ATTENTION, ContractViolation, "judged twice"),
    "output_in_query": (ATTENTION, ContractViolation, "shares memory with its input query"),
    "right_first_calls": (ATTENTION, None, "vs fp64 reference"),
    "scribbles_key": (WRITE, ContractViolation, "wrote its input key"),
    "scribbles_table_padding": (ATTENTION, ContractViolation, "wrote its input block_tables"),
    "scribbles_unused_slots": (ATTENTION, ContractViolation, "wrote its input k_cache"),
    "skips_last_row": (ATTENTION, None, "got nan"),
    "stale_buffer": (ATTENTION, ContractViolation, "an output the suite still holds changed"),
    "thread_returns_early": (ATTENTION, ContractViolation, "was still writing: the output changed"),
    "ulp_noise_one_in_ten": (ATTENTION, ContractViolation, "judged twice"),
    "write_skipped_by_pointer": (WRITE, ContractViolation, "write_kv judged twice"),
}


class Honest(IndexedBackend):
    """The control: the backend every cheat is built on, without a trick."""

    name = "honest"


class KeptThreadPool(IndexedBackend):
    """Honest: computes each sequence's rows on a pool of worker threads it creates on first use and keeps
    (idle workers stay alive after every call), waiting for them before it returns."""

    name = "kept_thread_pool"

    def paged_attention(self, query, *args, **kwargs):
        import concurrent.futures

        pool = self.__dict__.setdefault("_pool", concurrent.futures.ThreadPoolExecutor(2, "attention-pool"))
        return pool.submit(IndexedBackend.paged_attention, self, query, *args, **kwargs).result()


class DeclaredNondeterminism(IndexedBackend):
    """Honest: a split reduction whose order changes from call to call moves one element by an ulp at
    random, and the backend says so (``nondeterminism_ulp=1``)."""

    name = "declared_nondeterminism"

    def __init__(self):
        from pagedkv.backends.capabilities import Capabilities

        self.capabilities = Capabilities(nondeterminism_ulp=1)

    paged_attention = CHEATS["nondeterministic_ulp"].paged_attention


class SplitKRandomOrder(IndexedBackend):
    """Honest: flash-decoding split-K, each sequence's keys in splits of 4, every split's (max, sum,
    accumulator) in float32, the partials merged in a random order (as atomics would): right within float32
    rounding, never bit-identical from call to call, declared as ``nondeterminism_ulp=8`` and the
    bit-identical invariances as bounded non-promises."""

    name = "split_k_random_order"
    SPLIT = 4

    def __init__(self):
        import random

        from pagedkv.backends.capabilities import Capabilities, NonPromise
        from pagedkv.testing.non_promises import bound_kind, known_properties

        reason = "split-K partials merged in a random order"
        self.capabilities = Capabilities(nondeterminism_ulp=8, non_promises={
            p: NonPromise(reason) for p in known_properties() if bound_kind(p) == "bit_identical"})
        self._rng = random.Random()  # from the OS: another order every run

    def paged_attention(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None):
        import torch

        from pagedkv.adapter import check_paged_attention

        args = check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
        hkv, d = k_cache.shape[2], query.shape[-1]
        g = query.shape[1] // hkv
        out = torch.empty_like(query)
        for b, ctx in enumerate(args.seq_lens):
            q0, q1 = args.q_starts[b], args.q_starts[b + 1]
            if q1 == q0:
                continue
            blocks = args.block_tables[b, :-(-ctx // k_cache.shape[1])].to(torch.int64)
            k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].float()
            v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].float()
            q = query[q0:q1].float().view(q1 - q0, hkv, g, d)
            qpos = torch.arange(ctx - (q1 - q0), ctx).view(-1, 1)
            parts = []
            for s0 in range(0, ctx, self.SPLIT):
                logits = torch.einsum("qhgd,khd->hgqk", q, k[s0:s0 + self.SPLIT]) * args.scale
                kpos = torch.arange(s0, min(ctx, s0 + self.SPLIT)).view(1, -1)
                logits = logits.masked_fill(kpos > qpos, float("-inf"))
                m = logits.amax(-1, keepdim=True)
                p = torch.exp(logits - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
                parts.append((m, p.sum(-1, keepdim=True), torch.einsum("hgqk,khd->hgqd", p, v[s0:s0 + self.SPLIT])))
            self._rng.shuffle(parts)
            top = torch.stack([m for m, _, _ in parts]).amax(0)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            num, den = torch.zeros_like(parts[0][2]), torch.zeros_like(parts[0][1])
            for m, total, acc in parts:
                w = torch.where(torch.isfinite(m), torch.exp(m - top), torch.zeros_like(m))
                num, den = num + acc * w, den + total * w
            out[q0:q1] = (num / den).permute(2, 0, 1, 3).reshape(q1 - q0, -1, d).to(query.dtype)
        return out


#: Honest kernels the guard must let through, each run through the loop that catches the cheats.
HONEST = {cls.name: cls for cls in (Honest, KeptThreadPool, DeclaredNondeterminism, SplitKRandomOrder)}


def _catch(name: str, folder: Path, only: tuple | None = None):
    """``(property, outcome)`` of the first property that fails the cheat (or honest kernel, :data:`HONEST`), or
    ``(None, None)``; ``only``: these properties, else all but the state machines and limits."""
    props = properties()
    backend = HONEST[name]() if name in HONEST else CHEATS[name]()
    for pname in only or FIRST + tuple(p for p in props if p not in FIRST):
        prop = props[pname]
        if prop.kind in ("machine", "limit"):  # a state machine writes no case file; limits are not about cheating
            continue
        outcome = execute.run(prop, (backend,), "cpu", hypothesis_settings("smoke", shrink=False),
                              spec=f"pagedkv.tools.mutants.cheats:{name}", case_file=folder / f"{name}.json")
        if outcome.failed:
            return pname, outcome
    return None, None


#: Cheats whose failure depends on state a fresh process starts without (caches, call counts, pointers
#: seen): their replay in a new interpreter runs on every CI run; the others' under ``slow``.
STATEFUL = ("cache_by_pointer", "right_first_calls", "ulp_noise_one_in_ten", "write_skipped_by_pointer")


def test_every_cheat_has_the_check_that_catches_it():
    assert sorted(CAUGHT_BY) == sorted(CHEATS)


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_a_cheat_is_caught_by_its_check_leaving_one_case_file(name, tmp_path, record_property):
    caught_by, outcome = _catch(name, tmp_path)
    assert caught_by is not None, f"{name} passed every property"
    failure = outcome.failures[0]
    record_property("caught_by", f"{caught_by}: {failure.first_line}")
    prop, violation, words = CAUGHT_BY[name]
    assert caught_by == prop, failure.first_line
    assert isinstance(failure.error, Mismatch), f"not a check's failure: {failure.first_line}"
    assert isinstance(failure.error, ContractViolation) == (violation is ContractViolation), failure.first_line
    assert words in str(failure.error), failure.first_line
    record = json.loads(failure.case_file.read_text())
    assert record["outcome"] in ("failed", "raised") and isinstance(record["history"], list)
    assert [p.name for p in tmp_path.glob("*.json")] == [failure.case_file.name], "a passing example left a case file"


CATCHING = tuple(sorted({prop for prop, _, _ in CAUGHT_BY.values()}))


# every property for the deterministic controls (50 s each on one core); a kernel nondeterministic by design
# declares the self-comparing invariance properties as bounded non-promises, not through the guard's tolerance
@pytest.mark.parametrize("name, only", [(n, CATCHING) for n in sorted(HONEST)] + [
    pytest.param(n, None, id=f"{n}-every-property", marks=pytest.mark.slow) for n in ("honest", "kept_thread_pool")])
def test_an_honest_control_through_the_same_loop_fails_nothing(name, only, tmp_path):
    caught_by, outcome = _catch(name, tmp_path, only)
    assert caught_by is None, f"{caught_by}: {outcome.failures[0].first_line}"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in STATEFUL else pytest.mark.slow)
                                  for n in sorted(CHEATS)])
def test_a_cheats_case_file_replays_in_a_fresh_process(name, tmp_path, record_property):
    caught_by, outcome = _catch(name, tmp_path)
    assert caught_by is not None, f"{name} passed every property"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "replay", str(outcome.failures[0].case_file), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=600)
    verdict = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    record_property("replay", f"exit {proc.returncode}: {verdict}")
    assert "PASSES" not in proc.stdout, proc.stdout
    assert (proc.returncode, verdict.split(":")[0]) in ((1, "FAILS"), (3, "did not reproduce (depends on earlier "
                                                                          "calls / nondeterministic)")), proc.stdout


@pytest.mark.parametrize("prop", ["a_nan_value_shows_exactly_in_the_outputs_that_read_it",
                                  "decoding_token_by_token_equals_one_prefill_and_chunked_prefill"])
def test_a_kernel_nondeterministic_by_design_passes_the_properties_that_rerun_it(prop, tmp_path):
    # Fails before the NaN property compared its reruns within nondeterminism_ulp (bit for bit: outputs that
    # do not read the NaN "changed") and before the rerun's ulps were measured against the values' scale.
    outcome = execute.run(properties()[prop], (SplitKRandomOrder(),), "cpu", hypothesis_settings("smoke"),
                          case_file=tmp_path / "split.json")
    assert outcome.status == "passed", outcome.first_line
    assert not list(tmp_path.iterdir())


def test_a_rejected_case_is_no_failure_and_leaves_no_case_file(tmp_path):
    from hypothesis import assume

    from pagedkv.backends import get_backend

    class RejectsEvenSeeds:  # a property whose check rejects half its cases, as assume() does inside a search
        def __init__(self, prop):
            self._prop = prop

        def __getattr__(self, name):
            return getattr(self._prop, name)

        def check(self, backend, case, device):
            assume(case.seed % 2)
            return self._prop.check(backend, case, device)

    prop = RejectsEvenSeeds(properties()["gather_returns_exactly_what_each_slot_holds"])
    outcome = execute.run(prop, (get_backend("indexed"),), "cpu", hypothesis_settings("smoke"),
                          case_file=tmp_path / "gather.json")
    assert outcome.status == "passed", outcome.first_line
    assert not list(tmp_path.iterdir())
    nan = execute.run(properties()["a_nan_value_shows_exactly_in_the_outputs_that_read_it"], (get_backend("indexed"),),
                      "cpu", hypothesis_settings("smoke"), case_file=tmp_path / "nan.json")
    assert nan.status == "passed" and not list(tmp_path.iterdir()), nan.first_line


def test_fresh_memory_is_filled_in_a_judged_call_without_loading_inductor():
    # a stale-buffer cheat is caught because torch.empty is NaN-filled inside the call; getting there must
    # not import inductor (1.8 s in every fresh process: each replay and each gate run)
    probe = ("import sys, torch\n"
             "from pagedkv.testing.guard import _fill_fresh_memory\n"
             "with _fill_fresh_memory():\n"
             "    fresh, on = torch.empty(64), torch.are_deterministic_algorithms_enabled()\n"
             "print(bool(fresh.isnan().all()), on, torch.are_deterministic_algorithms_enabled(), "
             "'torch._inductor' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False", "False"], done.stdout


def test_a_kernel_nondeterministic_by_design_passes_prefix_caching_within_its_declared_ulps(tmp_path):
    """Prefix caching on and off read the same K/V through other blocks: a split-K kernel merging its partials
    in a random order agrees within its ``nondeterminism_ulp``, which the property honours (it cannot be declared
    a non-promise: it judges K/V too)."""
    caught_by, outcome = _catch("split_k_random_order", tmp_path, ("prefix_caching_changes_no_output",))
    assert caught_by is None, f"{caught_by}: {outcome.failures[0].first_line}"
