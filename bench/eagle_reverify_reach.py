"""How often the gate's searches reach the cache where ``eagle-reverify-skipped`` differs from vLLM: every EAGLE
lookup the machine models (``ManagerMachine.coordinated_hit``, under EAGLE) is run through
:func:`pagedkv.testing.managers.lookup.coordinated_hit` as it is (a verified group that shrinks the candidate
clears every EAGLE verification, vLLM's ``eagle_verified.clear()``) and as the fault has it (the clear skipped),
over the same modelled cache; a lookup where the two hits differ is one the machine would judge the fault at.

    python bench/eagle_reverify_reach.py --layouts deepseek-v4 two-window-block-sizes --seeds d 1 2 --json X.json

Each search is the release's (vLLM unmodified) kill-rate search of the layout (``bench/
vllm_mutant_layout_kill_rate.py``: ``property_seed(seed, "cache_manager")``, ``manager_kill_rate_settings``), or,
for ``d``, the layout's derandomized search under ``ci``'s settings. Per search: programs, modelled EAGLE lookups,
those with a positive hit, those whose loop ran more than one pass, those where a pass shrank the candidate to a
positive length (``repass``: the next pass looks up below a hit), those where a sliding-window group shrank it to
a positive length after another window group had verified it (``window-shrink``: the first half of the fault's
state), those where a verified group shrank it (``cleared``: the clear ran), and those where the fault's hit
differs (``differ``), with the first few programs. ``--revisit``: the same searches with one candidate traffic
shape added (:func:`with_revisit`); ``--retention N``: the layouts served with sparse prefix-cache retention
(``protocol.LAYOUT_RETENTION``; the gate serves these two layouts dense).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import json
import sys
import time


def _loops():
    """``(exact, fault)``: the model's coordinated lookup, counting into a Counter, and the fault's copy."""
    from pagedkv.testing.managers import lookup

    source = inspect.getsource(lookup.coordinated_hit)
    clear = "elif new < curr:\n                verified.clear()"
    assert source.count(clear) == 1 and source.count("    while True:\n") == 1
    source = source.replace("def coordinated_hit(", "def coordinated_hit(stats, reverify, ")
    source = source.replace(clear, "elif new < curr:\n                stats['clears'] += 1\n"
                                   "                if reverify:\n                    verified.clear()")
    source = source.replace("    while True:\n", "    while True:\n        stats['passes'] += 1\n")
    drop, end = "            if drop:\n", "        hit_length = curr\n"
    assert source.count(drop) == 1 and source.count(end) == 1
    source = source.replace(drop, "            stats['wshrink'] += kind != 'full' and 0 < new < curr and any(\n"
                            "                order[i][0][0] != 'full' for i in verified - {idx})\n" + drop)
    source = source.replace(end, "        stats['repass'] += curr > 0\n" + end)
    namespace = dict(vars(lookup))
    exec(compile(source, lookup.__file__, "exec"), namespace)  # noqa: S102 - the model's own source, edited
    loop = namespace["coordinated_hit"]
    return (lambda stats, *a: loop(stats, True, *a)), (lambda stats, *a: loop(stats, False, *a))


def with_revisit(machine_class):
    """``machine_class`` with one more rule, the candidate traffic shape measured beside the gate's (not part of
    it): a finished conversation's prefixes of several lengths served one after another (prompts sharing a prefix
    of different lengths: each hit touches the windows' blocks at its own cut), memory pressure of ``pressure``
    blocks per group (what the free queue's front held evicted), then the whole conversation re-read."""
    from hypothesis import strategies as st
    from hypothesis.stateful import precondition, rule

    from pagedkv.testing.managers.machine import VOCAB, whole_inputs

    class Revisited(machine_class):
        @precondition(lambda self: self.history)
        @rule(turn=st.integers(0, 7), cuts=st.lists(st.integers(0, 15), min_size=1, max_size=3),
              pressure=st.integers(0, 8), suffix=st.lists(VOCAB, max_size=3))
        def revisit(self, turn, cuts, pressure, suffix):
            self.log("revisit", turn=turn, cuts=cuts, pressure=pressure, suffix=suffix)
            namespace, tokens, extras, _ = self.history[-1 - turn % len(self.history)]
            for cut in cuts:
                cut = 1 + cut % len(tokens)
                rid = self.new_id()
                if self.admit(rid, tokens[:cut], namespace, whole_inputs(extras, cut), cut, True):
                    self.judge_now()
                    self.release(rid)
                    self.judge_now()
            if pressure:
                self.pressure(pressure)
                self.judge_now()
            rid = self.new_id()
            if self.admit(rid, [*tokens, *suffix], namespace, extras, len(tokens) + len(suffix), True):
                self.judge_now()
                self.release(rid)

    Revisited.__name__ = machine_class.__name__
    return Revisited


def search(layout: str, seed: str, programs_per_search: int, revisit: bool = False,
           retention: int | None = None) -> dict:
    from hypothesis import Phase, settings

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import lookup, programs, protocol
    from pagedkv.testing.managers.machine import ManagerMachine, machine_for
    from pagedkv.testing.settings import manager_kill_rate_settings, manager_settings, suite_settings
    from pagedkv.tools.mutants.kill_rates import MANAGER_MACHINE, property_seed
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    if retention is not None:  # the layout served with sparse retention, for this measurement only
        protocol.LAYOUT_RETENTION[layout] = retention
    exact, fault = _loops()
    counts: collections.Counter = collections.Counter()
    found: list[str] = []
    original = ManagerMachine.coordinated_hit

    def probed(self, req):
        out = original(self, req)
        if not self.eagle:
            return out
        still = [set() for _ in self.groups]
        for g, ident in self.cached.values():
            still[g].add(ident)
        args = (self.groups, lambda g, end: req.identities[end - 1] in still[g],
                len(req.tokens) - self.caps.min_computed_on_full_hit, len(req.tokens) // self.caps.block_size
                * self.caps.block_size, self.bs, True)
        stats: collections.Counter = collections.Counter()
        hit, _ = exact(stats, *args)
        assert (hit, _) == lookup.coordinated_hit(*args)
        wrong, _ = fault(collections.Counter(), *args)
        counts["lookups"] += 1
        counts["hit"] += hit > 0
        counts["passes>1"] += stats["passes"] > 1
        counts["repass"] += stats["repass"] > 0
        counts["window-shrink"] += stats["wshrink"] > 0
        counts["cleared"] += stats["clears"] > 0
        if wrong != hit:
            counts["differ"] += 1
            if len(found) < 3:
                found.append(f"hit {hit}, fault {wrong}:\n" + programs.as_text(list(self.record or [])))
        return out

    ManagerMachine.coordinated_hit = probed
    try:
        machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=(layout,), name=layout)
        if revisit:
            machine = with_revisit(machine)
        t0 = time.perf_counter()
        if seed == "d":
            base = manager_settings(programs_per_search, 30, base=suite_settings())
            s = settings(base, phases=(Phase.explicit, Phase.generate), derandomize=True)
            context = contextlib.nullcontext()
        else:
            s = manager_kill_rate_settings(programs_per_search)
            context = forced_seed(property_seed(int(seed), MANAGER_MACHINE))
        with context:
            steps = programs.run_recorded(machine, s)
    finally:
        ManagerMachine.coordinated_hit = original
    return {"layout": layout, "seed": seed, "programs": machine.examples_run,
            **{k: counts[k] for k in ("lookups", "hit", "passes>1", "repass", "window-shrink", "cleared",
                                "differ")},
            "passed": steps is None, "error": steps.error.splitlines()[0][:240] if steps else "",
            "seconds": round(time.perf_counter() - t0, 1), "found": found}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["deepseek-v4", "two-window-block-sizes"])
    parser.add_argument("--seeds", nargs="+", default=["d", "1", "2", "3"], help="d (derandomized) or integers")
    parser.add_argument("--programs", type=int, default=100, help="programs per search (ci: 100)")
    parser.add_argument("--revisit", action="store_true", help="the machine with the candidate rule revisit")
    parser.add_argument("--retention", type=int, help="serve the layouts with this prefix-cache retention interval "
                        "(scheduler blocks; 0: vLLM 0.32's engine default), patched in for the measurement only")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for layout in args.layouts:
        for seed in args.seeds:
            rows.append(search(layout, seed, args.programs, args.revisit, args.retention))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "found"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
