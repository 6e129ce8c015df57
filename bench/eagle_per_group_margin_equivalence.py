"""Evidence that mutant ``kv_cache_coordinator-0123`` is equivalent under every caller of the engine: the EAGLE
margin of ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` never bounds its lookup.

    python bench/eagle_per_group_margin_equivalence.py --seeds 1-2 --layouts jamba qwen3-next-fine \
        --json bench/results/eagle-per-group-margin.json

The mutant replaces the lookup length of an EAGLE attention group,
``min(max_cache_hit_length + eagle_margin, len(block_hashes) * hash_block_size)``, by its second term. vLLM 0.32
calls the method from one place, ``KVCacheManager.get_computed_blocks_for_connector``, with
``max_cache_hit_length = request.num_tokens - 1``; ``request.block_hashes`` hash whole blocks of the request's
tokens (draft tokens are never hashed), so ``len(block_hashes) * hash_block_size <= num_tokens``, and
``eagle_proof_margin`` (``kv_cache_utils.py``) returns a block or hash block size, at least 1: the first term is
at least ``num_tokens``, never the smaller. This script checks the claim where the branch runs: the vLLM peer's
searches (each ``property_seed(seed, "cache_manager")``, 100 programs, as ``python -m pagedkv mutate`` runs them)
in layouts with a Mamba group, whose connector claims ``supports_divergent_local_hybrid_hits`` (so admission takes
the per-group lookup) and where EAGLE runs beside the Mamba group; each call evaluates both lengths for every
EAGLE attention group and counts where they differ.

Needs vLLM 0.32 (the peer's engine); prints one line per search and writes the counts as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1-2", help="FIRST-LAST (default 1-2)")
    parser.add_argument("--layouts", nargs="+", default=["jamba", "qwen3-next-fine"])
    parser.add_argument("--programs", type=int, default=100, help="programs per search (ci: 100)")
    parser.add_argument("--json", required=True, help="where the counts go")
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    seeds = list(range(int(first), int(last or first) + 1))

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.settings import manager_kill_rate_settings
    from pagedkv.tools.mutants.kill_rates import MANAGER_MACHINE, property_seed
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    vm._import_vllm()
    from vllm.v1.core import kv_cache_coordinator as coordinator
    from vllm.v1.core.kv_cache_utils import eagle_proof_margin
    from vllm.v1.kv_cache_interface import MambaSpec

    original = coordinator.HybridKVCacheCoordinator.find_longest_cache_hit_per_group
    counts: collections.Counter = collections.Counter()

    def observed(self, block_hashes, max_cache_hit_length):
        counts["calls"] += 1
        for spec, group_ids, manager_cls, use_eagle in self.attention_groups:
            if use_eagle and not isinstance(spec, MambaSpec):  # the branch the mutant changes (L951-960)
                manager = self.single_type_managers[group_ids[0]]
                margin = eagle_proof_margin(manager.block_size, self.hash_block_size,
                                            self.enable_partial_hash_hits
                                            and manager_cls.supports_fine_grained_hash_lookup)
                release = min(max_cache_hit_length + margin, len(block_hashes) * self.hash_block_size)
                mutant = len(block_hashes) * self.hash_block_size
                counts["eagle_branch"] += 1
                counts["differ" if release != mutant else "same"] += 1
        return original(self, block_hashes, max_cache_hit_length)

    coordinator.HybridKVCacheCoordinator.find_longest_cache_hit_per_group = observed
    runs = []
    for name in args.layouts:
        for seed in seeds:
            counts.clear()
            start = time.perf_counter()
            machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=(name,), name=name)
            with forced_seed(property_seed(seed, MANAGER_MACHINE)):
                failed = programs.run_recorded(machine, manager_kill_rate_settings(args.programs)) is not None
            runs.append(dict(layout=name, seed=seed, programs=machine.examples_run, release_failed=failed,
                             seconds=round(time.perf_counter() - start, 1), **counts))
            print(json.dumps(runs[-1]), flush=True)
    with open(args.json, "w") as out:
        json.dump(dict(mutant="kv_cache_coordinator-0123", runs=runs), out, indent=1)
    return 1 if any(run.get("differ") for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
