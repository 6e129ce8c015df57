"""How close the gate's search comes to vLLM #44409 / #33775 (the planted fault ``external-alloc-before-all-touched``):
a connector load beside a local prefix hit, where a later KV-cache group's hit blocks are free (reference count 0,
still cached) and lie among the blocks an earlier group's external allocation takes from the free queue's head.

    python bench/external_alloc_reach.py --seeds 1-3 --layouts gemma3 --json out.json

Each search is the one ``bench/vllm_mutant_layout_kill_rate.py`` runs (``ci`` settings, 100 programs, seeded), on
the release. Every ``load`` of the hybrid peer is classified down the chain the fault needs: a local hit and
external tokens; a hit block free; a later group's hit block free; the load admitted (vLLM refuses it when the pool
is short of its need, which counts free hit blocks); and, among the admitted, whether the earlier group's new
blocks (``n0``, as the release allocated them after every touch) would have reached the later group's free hit
block from the queue's head (``reaches``: the fault hands that block out twice).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def probe(seeds: list[int], layouts: list[str]) -> dict:
    """Counts per chain step over the searches of ``seeds`` x ``layouts`` (the release must pass them).

    Raises:
        AssertionError: the release fails a search (its error).
    """
    from hypothesis import Phase, settings

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.settings import manager_settings, suite_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    counts: collections.Counter = collections.Counter()
    load = vm.VllmHybridCacheManager.load

    def classified_load(self, request_id):
        blocks, num_local = self.pending[request_id]
        counts["loads"] += 1
        if not (num_local and self.external[request_id]):
            return load(self, request_id)
        counts["local hit + external"] += 1
        groups = blocks.blocks
        free_hit = {g: {b.block_id for b in gb if not b.is_null and b.ref_cnt == 0} for g, gb in enumerate(groups)}
        later = set().union(*(ids for g, ids in free_hit.items() if g > 0))
        if any(free_hit.values()):
            counts["a hit block free"] += 1
        if not later:
            return load(self, request_id)
        counts["a later group's hit block free"] += 1
        queue = [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()
                 if b.block_id not in free_hit[0]]  # group 0 touches its own hit first
        held0 = sum(not b.is_null for b in groups[0])
        got = load(self, request_id)
        if got is None:
            counts["refused (pool short)"] += 1
            return got
        n0 = sum(not b.is_null for b in self.manager.coordinator.single_type_managers[0].req_to_blocks[
            str(request_id)]) - held0
        counts[f"admitted, n0={n0}"] += 1
        if later & set(queue[:max(n0, 0)]):
            counts["reaches"] += 1
        return got

    vm.VllmHybridCacheManager.load = classified_load
    base = manager_settings(100, 30, base=suite_settings())
    try:
        for seed in seeds:
            for layout in layouts:
                machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=(layout,),
                                      name="vllm_cache_manager_manager")
                with forced_seed(seed):
                    failed = programs.run_recorded(machine, settings(base, max_examples=100,
                                                                     phases=(Phase.explicit, Phase.generate)))
                assert failed is None, failed.error
    finally:
        vm.VllmHybridCacheManager.load = load
    return dict(counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1-3", help="FIRST-LAST Hypothesis seeds (default 1-3)")
    parser.add_argument("--layouts", nargs="+", default=["gemma3"], help="the hybrid peer's layouts to search")
    parser.add_argument("--json", help="where the counts go")
    args = parser.parse_args(argv)
    first, _, last = args.seeds.partition("-")
    counts = probe(list(range(int(first), int(last or first) + 1)), args.layouts)
    print(json.dumps(counts, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": args.seeds, "layouts": args.layouts, "counts": counts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
