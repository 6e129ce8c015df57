"""How often the gate's search draws two classes of programs, over the same searches the kill-rate scripts run.

    python bench/reach_draws.py --seeds d 1 2 --layouts one-group --json X.json
    python bench/reach_draws.py --seeds d 1 --layouts gemma3 llama4 --json X.json

``mm-tail``: a block completed by decode whose prompt part holds two multimodal inputs or more (a prompt ending
in a partial block with several inputs in it, then output filling it: vLLM's incremental block hashing resumes
there, ``kv_cache_utils.get_request_block_hasher``). ``mm-tail-rehit``: such a block later sought by a lookup of
another request or a resume (a prompt spelling its tokens or a preempted request's own hashes).

``load-reaches-hit``: a connector load after a local hit in a hybrid layout where the blocks an earlier group
allocates for the external tokens (``SingleTypeKVCacheManager.allocate_external_computed_blocks``: the free
queue's head) would reach a later group's hit block had that group not touched it yet (vLLM's two-phase touch,
``KVCacheCoordinator.allocate_new_computed_blocks``, is what keeps the two apart). Read off vLLM's free queue
before the load, so this needs the vLLM peer.

Each search is the release (vLLM unmodified) under ``ci``'s programs for the layout (one-group: 400; a hybrid
layout: 100) and 30 steps, derandomized (``d``) or from the seed; per search: programs drawing each class, and
whether the search passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path


def _tail_blocks(req, bs: int) -> set[int]:
    """The prompt's partial last block, where decode has completed it and two inputs or more overlap its prompt
    part (its start position), as a set of zero or one start."""
    n = req.num_prompt
    if bs < 2 or n % bs == 0 or req.committed < (n // bs + 1) * bs:
        return set()
    start = n // bs * bs
    inputs = {p - key[2] for p, key in req.extras.items()
              if isinstance(key, tuple) and len(key) == 3 and key[0] == "mm" and start <= p < n}
    return {start} if len(inputs) >= 2 else set()


def instrumented(machine_class):
    """``machine_class`` counting, per program, the classes above (``programs``: one dict per program)."""
    from pagedkv.testing.managers.machine import ManagerMachine

    class Counted(machine_class):
        programs: list[dict] = []

        def __init__(self):
            super().__init__()
            self.drawn = {"mm-tail": 0, "mm-tail-rehit": 0, "load-reaches-hit": 0}
            self.tails: set[int] = set()  # identities of the last token of such blocks
            type(self).programs.append(self.drawn)

        def check(self):
            ManagerMachine.check(self)
            for req in self.live.values() if hasattr(self, "m") else ():
                self.seen(req)

        def release(self, rid):
            self.seen(self.live[rid])  # a request finished within a step (``serve``)
            return super().release(rid)

        def seen(self, req):
            for start in _tail_blocks(req, self.bs):
                ident = req.identities[start + self.bs - 1]
                if ident not in self.tails:
                    self.tails.add(ident)
                    self.drawn["mm-tail"] += 1

        def admit(self, rid, tokens, namespace, extras, chunk, write_now, stored=0, store_ahead=False,
                  resumed=None):
            if self.tails:
                req_ids = None
                try:
                    from pagedkv.testing.managers.machine import Request

                    probe = Request(namespace if self.caps.namespaces else None, [], dict(extras), [], len(tokens))
                    probe.extend(tokens)
                    req_ids = set(probe.identities[self.bs - 1::self.bs])
                except Exception:  # noqa: BLE001 - a probe only
                    pass
                if req_ids and req_ids & self.tails:
                    self.drawn["mm-tail-rehit"] += 1
            return super().admit(rid, tokens, namespace, extras, chunk, write_now, stored, store_ahead, resumed)

        def start_load(self, rid, req, cached, external, stored, hits):
            reaches = bool(cached) and self.grouped and _load_reaches_hit(self, rid, cached, external)
            loaded = super().start_load(rid, req, cached, external, stored, hits)
            if reaches and loaded:  # admitted: its blocks were allocated
                self.drawn["load-reaches-hit"] += 1
            return loaded

    Counted.__name__ = machine_class.__name__
    return Counted


def _load_reaches_hit(machine, rid: int, cached: int, external: int) -> bool:
    """Whether, touching each group's hit and then allocating its external blocks group by group (the order
    the fault restores), an earlier group's allocation would take a later group's hit block off the free
    queue's head."""
    manager = getattr(machine.m, "manager", None)
    pending = getattr(machine.m, "pending", {}).get(rid)
    if manager is None or pending is None:
        return False
    blocks, num_local = pending
    blocks = getattr(blocks, "blocks", blocks)
    queue = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    total = num_local + external
    singles = manager.coordinator.single_type_managers
    # the hit blocks each group touches: a window's skipped ones (before what the load's end reads) it never holds
    hit_ids = [[b.block_id for b in group[single.get_num_skipped_tokens(total) // single.block_size:]
                if not b.is_null] for group, single in zip(blocks, singles)]
    taken: set[int] = set()
    for g, group in enumerate(machine.groups):
        taken |= set(hit_ids[g])  # this group's hit touched
        if group.kind == "mamba":
            continue
        need = max(0, math.ceil(total / machine.gbs[g]) - len(blocks[g]))
        head = [b for b in queue if b not in taken][:need]
        if any(b in head for h in range(g + 1, len(machine.groups)) for b in hit_ids[h]):
            return True
        taken |= set(head)
    return False


def search(layout: str, seed: str) -> dict:
    from hypothesis import Phase, settings

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.managers.protocol import ONE_GROUP
    from pagedkv.testing.settings import manager_settings, suite_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm

    machine = instrumented(machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=(layout,),
                                       name="vllm_cache_manager_manager"))
    machine.programs = []
    base = manager_settings(100, 30, base=suite_settings())
    examples = programs.one_group_programs(base.max_examples) if layout == ONE_GROUP else base.max_examples
    s = settings(base, max_examples=examples, phases=(Phase.explicit, Phase.generate), derandomize=seed == "d")
    t0 = time.perf_counter()
    with contextlib.nullcontext() if seed == "d" else forced_seed(int(seed)):
        steps = programs.run_recorded(machine, s)
    counts = {k: sum(1 for p in machine.programs if p[k]) for k in ("mm-tail", "mm-tail-rehit", "load-reaches-hit")}
    return {"layout": layout, "seed": seed, "programs": len(machine.programs), **counts,
            "passed": steps is None, "error": steps.error if steps else "",
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", default=["d"])
    parser.add_argument("--layouts", nargs="+", default=["one-group"])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for layout in args.layouts:
        for seed in args.seeds:
            rows.append(search(layout, seed))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
