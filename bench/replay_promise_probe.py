"""The replay promise of fine-grained hits checked against vLLM itself, with and without EAGLE beside Mamba:
after every step of the release's searches in ``qwen3-next-fine`` (the ``ci`` kill-rate search of each seed, as
``bench/vllm_mutant_layout_kill_rate.py release`` runs it), each request whose prompt is computed and whose state
at its replay boundary its own step computed, with no connector or drafts, is looked up by vLLM's coordinator with
its prompt extended by one token. Where the promise covers it at that moment (its count of blocks that entered the
free queue within what the queue holds: ``ManagerMachine.replay_hit``), the lookup must hit at least its replay
boundary (``floor((P - 1) / u) * u``, under EAGLE ``floor(P / u) * u - u``). Also counted: the requests the count
leaves out, hittable or not (how often the promise stands down where vLLM would still hit).

    python bench/replay_promise_probe.py --seeds 0-39 --json out.json

A lookup only reads vLLM's index (``HybridKVCacheCoordinator.find_longest_cache_hit``); the searches run as
without the probe.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-9", help="FIRST-LAST")
    parser.add_argument("--programs", type=int, default=100, help="programs per seed (ci: 100)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import ManagerMachine, machine_for
    from pagedkv.testing.settings import manager_kill_rate_settings
    from pagedkv.tools.mutants.kill_rates import MANAGER_MACHINE, property_seed
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    counts: collections.Counter = collections.Counter()
    broken: list[dict] = []

    def probe(machine) -> None:
        if not getattr(machine, "replay_window", False) or machine.connector or machine.speculative:
            return
        free = machine.m.counts()[0]
        for q in [*machine.live.values(), *machine.replayable]:
            if (q.replay_open is None or not q.adopted or q.pending() or q.embedded()
                    or not q.reserved == q.committed >= q.num_prompt):
                continue
            r = machine.replay_boundary(q)
            if not r:
                continue
            promised = machine.pool_entries - q.replay_open <= free
            tokens = [*q.tokens[:q.num_prompt], 3]
            extras = sorted((p, key) for p, key in q.extras.items() if p < q.num_prompt)
            request = machine.m._request(-1, tokens, q.namespace, extras)
            _, hit, _ = machine.m.manager.coordinator.find_longest_cache_hit(request.block_hashes, len(tokens) - 1)
            counts["EAGLE" if machine.eagle_server else "no EAGLE", "promised" if promised else "left out",
                   "hits" if hit >= r else "misses"] += 1
            if promised and hit < r:
                broken.append(dict(eagle=machine.eagle_server, boundary=r, hit=hit,
                                   entered=machine.pool_entries - q.replay_open, free=free,
                                   program=programs.as_text(list(machine.record or []))))

    judge_now = ManagerMachine.judge_now

    def judged(self):
        judge_now(self)
        probe(self)

    ManagerMachine.judge_now = judged  # every rule's steps (a served turn's too) end in judge_now or check
    check = ManagerMachine.check

    def checked(self):
        check(self)
        probe(self)

    ManagerMachine.check = checked
    runs = []
    for seed in range(int(first), int(last or first) + 1):
        machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=("qwen3-next-fine",),
                              name="qwen3-next-fine")
        with forced_seed(property_seed(seed, MANAGER_MACHINE)):
            steps = programs.run_recorded(machine, manager_kill_rate_settings(args.programs))
        runs.append(dict(seed=seed, programs=machine.examples_run, error=steps.error[:240] if steps else ""))
        print(json.dumps({**runs[-1], "broken": len(broken)}), flush=True)
    out = dict(layout="qwen3-next-fine", programs_per_seed=args.programs, runs=runs,
               lookups={", ".join(key): n for key, n in sorted(counts.items())}, broken=broken[:5],
               num_broken=len(broken))
    json.dump(out, open(args.json, "w"), indent=1)
    print(json.dumps(out["lookups"]), "broken:", len(broken))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
