"""Faults planted by hand in vLLM's hybrid cache code, each run under vLLM's own tests and the hybrid gate.

    python bench/planted_hybrid_manager_faults.py --tests ../shared/vllm-0.32.0-tests-v1-core \
        --json bench/results/planted-vllm-hybrid-faults.json --md bench/results/planted-vllm-hybrid-faults.md

The one-group set (bench/planted_manager_faults.py) plants faults a single full-attention group reaches.
This set plants them where several KV-cache groups meet: the hybrid coordinator (agreed hit length,
per-group truncation, two-phase touch, spec groups, the EAGLE drop), the sliding-window, chunked-local and
Mamba managers, the block pool's per-group index, the connector and speculative handling of
``kv_cache_manager.py`` and the scheduler's deferred free. Most are reverted fixes from vLLM's history in
this area (#44409, #50457, #48375 / #53912, #48532, #42571, #51756) or the off-by-one and wrong-index
slips beside them. The file loading, the child processes and the table are the one-group script's.

vLLM's tests: the whole ``tests/v1/core`` directory of the CPU-runnable copy (where the hybrid, connector
and speculative tests live, test_scheduler.py above all) without the end-to-end files and with
``deselect_env.txt`` deselected (and one test that runs in a fresh interpreter, :data:`_THEIRS_ARGS`),
``-x``. Killed: the child fails.

The gate is derandomized as the ``ci`` profile is: one fixed search, the same verdict under any
PYTHONHASHSEED. ``--seed N`` runs it from Hypothesis seed N instead (another search, for kill rates over
seeds); ``--without-connector`` builds the peer without its KV connector.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (id, class, file under vllm/v1/core, old text, new text, what it breaks)
FAULTS = [
    # The hybrid coordinator.
    ("external-alloc-before-all-touched", "coordinator", "kv_cache_coordinator.py",
     "        if num_external_computed_tokens > 0:\n"
     "            for i, manager in enumerate(self.single_type_managers):\n"
     "                manager.allocate_external_computed_blocks(",
     "            if num_external_computed_tokens > 0:\n"
     "                manager.allocate_external_computed_blocks(",
     "the two-phase touch reverted (#44409 / #33775): a group allocates its connector blocks before a "
     "later group has touched its prefix hit, so the allocation can evict that hit; one block owned twice"),
    ("second-full-group-not-truncated", "coordinator", "kv_cache_coordinator.py",
     "            for group_id in group.group_ids:\n                if (blks := hit_blocks_by_group[group_id])",
     "            for group_id in group.group_ids[:1]:\n                if (blks := hit_blocks_by_group[group_id])",
     "only the first full-attention group of a spec group is truncated to the agreed hit (#50457): a second "
     "one keeps blocks past the hit length"),
    ("eagle-reverify-skipped", "coordinator", "kv_cache_coordinator.py",
     "eagle_verified.clear()", "pass",
     "an EAGLE group's last-block drop is not redone after another group shrinks the candidate hit: the "
     "agreed hit keeps the block whose hidden state must be recomputed"),
    ("mamba-checkpoint-ignores-eagle", "coordinator", "kv_cache_coordinator.py",
     "manager.drop_eagle_checkpoint_block = True", "manager.drop_eagle_checkpoint_block = False",
     "Mamba checkpoints not moved to EAGLE's replay boundary (#48375 / #53912 class): the state the "
     "attention groups drop back from is cached at a boundary they never resume at"),
    ("spec-groups-merged-across-specs", "coordinator", "kv_cache_coordinator.py",
     "                    group.spec == spec\n                    and group.manager_cls is manager_cls",
     "                    group.manager_cls is manager_cls",
     "groups looked up together by manager class alone (#51756 class): a second sliding-window group is "
     "matched with the first one's window and block size"),
    ("simple-hybrid-with-three-types", "coordinator", "kv_cache_coordinator.py",
     "is_simple_hybrid = len(self.attention_groups) == 2 and",
     "is_simple_hybrid = len(self.attention_groups) >= 2 and",
     "the one-pass shortcut taken with three attention types: a group whose hit was accepted before a later "
     "group shrank the length is not re-checked at the agreed length"),
    ("deferred-free-head-first-per-group", "coordinator", "kv_cache_coordinator.py",
     "blocks.extend(manager.pop_blocks_for_free(request_id))",
     "blocks.extend(reversed(manager.pop_blocks_for_free(request_id)))",
     "each group's popped blocks already reversed, so the caller's reverse frees them head first (#48532): "
     "a deferred free loses each group's tail-first eviction order"),
    # The single-type managers.
    ("swa-hit-window-one-block-short", "sliding window", "single_type_kv_cache_manager.py",
     "blocks = cdiv(window_size - 1, block_size)", "blocks = (window_size - 1) // block_size",
     "a sliding-window hit needs one contiguous block too few when the window is not block-aligned: a hit "
     "whose window reaches into an evicted block"),
    ("swa-hit-keeps-trailing-block", "sliding window", "single_type_kv_cache_manager.py",
     "del computed[i + num_contiguous_blocks :]", "del computed[i + num_contiguous_blocks + 1 :]",
     "the sliding-window hit keeps one block past its matched run: a null (or missed) block counted as hit"),
    ("swa-freed-block-left-in-table", "sliding window", "single_type_kv_cache_manager.py",
     "                break\n            freed.append(blocks[i])\n            blocks[i] = self._null_block\n",
     "                break\n            freed.append(blocks[i])\n",
     "a block released by the window stays in the request's table (#42571 class): freed again when the "
     "request ends, a double free; meanwhile handed to another request"),
    ("chunked-local-frees-current-chunk", "chunked local", "single_type_kv_cache_manager.py",
     "            num_computed_tokens // self.attention_chunk_size\n        ) * self.attention_chunk_size",
     "            (num_computed_tokens + 1) // self.attention_chunk_size\n        ) * self.attention_chunk_size",
     "the chunk of the next token taken as skipped one token early: the current chunk's blocks are freed "
     "while its last token still attends to them"),
    ("chunked-local-hit-past-max", "chunked local", "single_type_kv_cache_manager.py",
     "                max_length\n                // kv_cache_spec.attention_chunk_size",
     "                (max_length + 1)\n                // kv_cache_spec.attention_chunk_size",
     "the chunked-local hit pads nulls up to the next token's chunk: a hit longer than the lookup allows, "
     "its current chunk read from null blocks"),
    ("mamba-frees-current-state", "mamba", "single_type_kv_cache_manager.py",
     "        return num_computed_tokens - 1\n", "        return num_computed_tokens\n",
     "Mamba releases the block holding the state of its last computed token: the running state is handed "
     "out while the request still continues from it"),
    ("mamba-same-step-state-served", "mamba", "single_type_kv_cache_manager.py",
     "new_computed_blocks[-1].block_hash in self.cached_blocks_this_step",
     "new_computed_blocks[0].block_hash in self.cached_blocks_this_step",
     "the same-step check looks at the first (null) block: a Mamba state cached this step, not yet written "
     "by the forward, is served to another request"),
    # The block pool.
    ("cached-lookup-first-group-key", "block pool", "block_pool.py",
     "make_block_hash_with_group_id(\n                block_hash, group_id\n            )",
     "make_block_hash_with_group_id(\n                block_hash, kv_cache_group_ids[0]\n            )",
     "a spec group's lookup keys every member with the first group's id: two groups of one request get the "
     "same physical block"),
    # Connector and speculative handling of the manager, and the scheduler's deferred free.
    ("connector-divergence-not-flagged", "connector", "kv_cache_manager.py",
     "return blocks, num_local, 0, min(per_group_hits) < num_local",
     "return blocks, num_local, 0, False",
     "a full-attention hit deeper than the Mamba group's is reported as agreed: without external tokens the "
     "request resumes where no Mamba state was cached"),
    ("async-load-cached-before-arrival", "connector", "kv_cache_manager.py",
     "        if delay_cache_blocks:\n            return self.create_kv_cache_blocks(new_blocks)\n", "",
     "blocks of an asynchronous connector load are cached when reserved: another request hits them before "
     "the data arrives (or after the load fails)"),
    ("lookahead-slots-not-reserved", "speculative", "kv_cache_manager.py",
     "num_tokens_main_model + num_lookahead_tokens, self.max_model_len",
     "num_tokens_main_model, self.max_model_len",
     "no slots for the draft (lookahead) tokens: the proposer writes past the request's blocks"),
    ("deferred-drain-head-first", "deferred free", "sched/scheduler.py",
     "self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))",
     "self.kv_cache_manager.block_pool.free_blocks(blocks)",
     "the scheduler drains a deferred free head first (#48532): the prefix a finished request shares is "
     "evicted before its tail"),
]

#: The gate: the cache-manager machine on ``pagedkv.tools.peers:vllm_cache_manager`` in its hybrid layouts (every
#: layout it declares but the one group), as the suite runs it: one search per layout with its share of
#: ``EXAMPLES`` programs (the ``ci`` profile's 100 unless ``--examples``; ``programs.run_per_layout``) of 30
#: steps, derandomized as ``ci`` is (or from Hypothesis seed ``SEED``), no shrinking (which does not change a
#: verdict).
GATE = r'''
import contextlib, json, sys, time
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
from hypothesis import Phase, settings
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.managers.protocol import ONE_GROUP
from pagedkv.testing.settings import manager_settings
from pagedkv.tools.peers import vllm_hybrid_manager as vm
layouts = tuple(name for name in vm.cache_manager_layouts if name != ONE_GROUP)
factory = vm.cache_manager
if WITHOUT_CONNECTOR:  # the peer built without its connector: the machine then never draws one
    import dataclasses
    factory = lambda config: vm.cache_manager(dataclasses.replace(config, connector=False))  # noqa: E731
machine = machine_for(factory, windows=vm.cache_manager_windows, layouts=layouts,
                      name="vllm_cache_manager_hybrid_manager")
from pagedkv.testing.hypothesis_internals import forced_seed
s = settings(manager_settings(EXAMPLES, 30), phases=(Phase.explicit, Phase.generate),
             derandomize=SEED is None)
t0 = time.perf_counter()
with contextlib.nullcontext() if SEED is None else forced_seed(SEED):
    steps = programs.run_per_layout(machine, s)
print("RESULT " + json.dumps({"killed": steps is not None, "error": steps.error if steps else "",
      "first_failing_example": steps.first_failing_example if steps else None, "examples": machine.examples_run,
      "steps": machine.checks_run, "seconds": round(time.perf_counter() - t0, 1)}))
'''

#: test_is_kv_cache_spec_uniform runs its check in a fresh ``python -O`` that imports the installed release, never
#: the planted fault, under a 60 s timeout that a loaded 2-core machine exceeds: it cannot judge a fault.
_THEIRS_ARGS = ["tests/v1/core", "--ignore-glob=*_e2e.py",
                "--deselect=tests/v1/core/test_kv_cache_utils.py::test_is_kv_cache_spec_uniform"]


def their_args(tests: Path) -> list[str]:
    """pytest arguments for the whole ``tests/v1/core`` with the copy's ``deselect_env.txt`` deselected."""
    lines = (tests / "deselect_env.txt").read_text().splitlines()
    return _THEIRS_ARGS + [f"--deselect={ln.strip()}" for ln in lines if ln.strip() and not ln.startswith("#")]


def _options(parser) -> None:
    parser.add_argument("--without-connector", action="store_true",
                        help="the gate with the peer's KV connector off (every other feature, every layout)")
    parser.add_argument("--seed", type=int, help="the gate's programs from this Hypothesis seed instead of "
                        "derandomized (a derandomized verdict is the same under any PYTHONHASHSEED)")
    parser.add_argument("--examples", type=int, default=100,
                        help="programs of 30 steps per fault (default 100: the ci profile's; nightly's is 2000)")


if __name__ == "__main__":
    import planted_manager_faults as one_group

    sys.exit(one_group.main(sys.argv[1:], faults=FAULTS, their_args=their_args, doc=__doc__, options=_options,
                            gate=lambda args: f"WITHOUT_CONNECTOR = {args.without_connector}\n"
                                              f"SEED = {args.seed!r}\nEXAMPLES = {args.examples}\n" + GATE))
