"""How often the one-group gate's programs reach the states the new planted faults need (on the release).

    PYTHONPATH=. python bench/planted_manager_survivors.py [--seed N]

Runs the gate's search as ``bench/planted_manager_faults.py`` does (the ``ci`` programs, derandomized or
from Hypothesis seed N) on vLLM as installed, with read-only wrappers on vLLM's manager and the peer that
count, per fault, the state where the fault's code and the release's part ways:

- ``mm-hash-resumes-at-last-item``: a block hashed after appended tokens that an earlier multimodal item
  than the request's last overlaps (requests with two or more items counted too);
- ``prompt-embeds-not-in-key``: a request with prompt embeddings;
- ``resumed-hit-capped-at-prompt``: a prefix lookup of a request with tokens past its prompt
  (``num_tokens > num_prompt_tokens``), the preemptions of a request that had decoded, the resumes (the same
  request looked up again) with output, and those whose hit reaches past the prompt (the mutant stops short);
- ``window-released-head-first``: a window releasing two or more blocks at once, and an allocation that
  takes some but not all of such a run (the mutant takes others);
- ``index-drops-last-duplicate``: two blocks filed under one hash, one of them evicted while the other stays
  cached, and a later lookup of that hash (the mutant misses it).

Prints one JSON line of totals and of the examples (1-based) where each state occurs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, help="the gate's programs from this Hypothesis seed (default derandomized)")
    args = parser.parse_args(argv)

    from hypothesis import Phase, settings

    from pagedkv.testing.hypothesis_internals import forced_seed
    from pagedkv.testing.managers import programs
    from pagedkv.testing.managers.machine import machine_for
    from pagedkv.testing.managers.protocol import multimodal_spans
    from pagedkv.testing.settings import manager_settings, suite_settings
    from pagedkv.tools.peers import vllm_hybrid_manager as vm
    from pagedkv.tools.peers import vllm_manager
    from vllm.multimodal.utils import get_mm_features_in_window
    from vllm.v1.core import block_pool, kv_cache_manager, kv_cache_utils, single_type_kv_cache_manager

    counts: dict[str, int] = collections.Counter()
    where: dict[str, set] = collections.defaultdict(set)
    example, window = [0], [None]  # the example (peers built) and its window_left

    def seen(name: str, n: int = 1) -> None:
        counts[name] += n
        where[name].add(example[0])

    # one example: one peer built
    peer_init = vllm_manager.VllmCacheManager.__init__

    def counting_init(self, config):
        example[0] += 1
        window[0] = config.window_left
        seen(f"examples window_left={config.window_left}")
        peer_init(self, config)
    vllm_manager.VllmCacheManager.__init__ = counting_init

    peer_request = vllm_manager.VllmCacheManager._request

    def counting_request(self, request_id, token_ids, namespace, extra_keys):
        spans = multimodal_spans(extra_keys)
        if spans:
            seen("requests with a multimodal item")
        if len(spans) >= 2:
            seen("requests with two or more multimodal items")
        request = peer_request(self, request_id, token_ids, namespace, extra_keys)
        if request.prompt_embeds is not None:
            seen("prompt-embeds: requests with prompt embeddings")
        return request
    vllm_manager.VllmCacheManager._request = counting_request

    # mm-hash-resumes-at-last-item: the incremental hasher's first new block, overlapped by an item before the last
    make_hasher = kv_cache_utils.get_request_block_hasher

    def counting_hasher(hash_block_size, fn):
        hasher = make_hasher(hash_block_size, fn)

        def request_block_hasher(request):
            start = len(request.block_hashes) * hash_block_size
            features = request.mm_features
            if start > 0 and features and start + hash_block_size <= request.num_tokens:
                last = features[-1].mm_position
                if last.offset + last.length > start:
                    first, _ = get_mm_features_in_window(features, start, start + hash_block_size)
                    if any(f.mm_position.offset < start + hash_block_size for f in features[first:-1]):
                        seen("mm-hash: an appended block an earlier item overlaps")
            return hasher(request)
        return request_block_hasher
    kv_cache_utils.get_request_block_hasher = counting_hasher

    # resumed-hit-capped-at-prompt: a lookup where num_tokens - 1 and num_prompt_tokens - 1 differ
    lookup = kv_cache_manager.KVCacheManager.get_computed_blocks

    def counting_lookup(self, request):
        if request.num_tokens > request.num_prompt_tokens:
            seen("resumed-hit: a lookup past the prompt")
        return lookup(self, request)
    kv_cache_manager.KVCacheManager.get_computed_blocks = counting_lookup

    peer_resume = vllm_manager.VllmCacheManager.resume

    def counting_resume(self, request_id):
        request = self.requests[request_id]
        seen("resumed-hit: resume calls")
        if request.num_tokens > request.num_prompt_tokens:
            seen("resumed-hit: resumes of a request with output")
        if (request.num_tokens - 1) // self.block_size > (request.num_prompt_tokens - 1) // self.block_size:
            seen("resumed-hit: resumes whose output completes a block past the prompt's hit limit")
        got = peer_resume(self, request_id)
        if got[1] > request.num_prompt_tokens - 1:
            seen(f"resumed-hit: resumed hits past the prompt (the mutant stops short; window_left={window[0]})")
        return got
    vllm_manager.VllmCacheManager.resume = counting_resume

    # window-released-head-first: runs of two or more blocks a window releases at once, then a partial take
    runs: list[list] = []
    remove_range = single_type_kv_cache_manager.SingleTypeKVCacheManager._remove_blocks_in_range

    def counting_remove(self, request_id, first_block, last_block):
        blocks = self.req_to_blocks.get(request_id, [])
        freed = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i] == self._null_block:
                break
            freed.append(blocks[i])
        remove_range(self, request_id, first_block, last_block)
        run = [b for b in freed if b.ref_cnt == 0]
        seen(f"window: release calls (window_left={window[0]})")
        if freed:
            seen(f"window: releases of a block or more (window_left={window[0]})")
        if len(run) >= 2:
            seen(f"window: two or more blocks released at once (window_left={window[0]})")
            runs.append(run)
    single_type_kv_cache_manager.SingleTypeKVCacheManager._remove_blocks_in_range = counting_remove

    get_new = block_pool.BlockPool.get_new_blocks

    def counting_get_new(self, num_blocks):
        taken = set()
        for block in self.free_block_queue.iter_blocks_after(None):
            if len(taken) == num_blocks:
                break
            taken.add(block.block_id)
        for run in list(runs):
            ids = {b.block_id for b in run if b.ref_cnt == 0}
            if len(ids) >= 2 and ids & taken and not ids <= taken:
                seen(f"window: an allocation takes part of such a run (window_left={window[0]})")
            if ids & taken or len(ids) < 2:
                runs.remove(run)
        return get_new(self, num_blocks)
    block_pool.BlockPool.get_new_blocks = counting_get_new

    # index-drops-last-duplicate: a hash with two blocks, one popped, the survivor looked up later
    orphaned: dict = {}  # hash -> the surviving block the mutant drops from the index
    insert = block_pool.BlockHashToBlockMap.insert

    def counting_insert(self, key, block):
        if isinstance(self._cache.get(key), kv_cache_utils.KVCacheBlock):
            seen("index: two blocks under one hash")
        orphaned.pop(key, None)
        insert(self, key, block)
    block_pool.BlockHashToBlockMap.insert = counting_insert

    pop = block_pool.BlockHashToBlockMap.pop

    def counting_pop(self, key, block_id):
        before = self._cache.get(key)
        got = pop(self, key, block_id)
        if isinstance(before, dict) and got is not None and len(before) == 1:
            seen("index: one of the two evicted, the other still cached")
            orphaned[key] = next(iter(before.values()))
        return got
    block_pool.BlockHashToBlockMap.pop = counting_pop

    get_one = block_pool.BlockHashToBlockMap.get_one_block

    def counting_get_one(self, key):
        block = get_one(self, key)
        if block is not None and orphaned.get(key) is block:
            seen("index: a lookup the survivor serves (the mutant misses)")
        return block
    block_pool.BlockHashToBlockMap.get_one_block = counting_get_one

    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, name="vllm_cache_manager_manager")
    preempted = collections.Counter()
    log = machine.log

    def counting_log(self, name, **kwargs):
        if name == "preempt":
            req = self.live[kwargs["rid"]]
            preempted["preemptions"] += 1
            where["preemptions"].add(example[0])
            if req.written > req.num_prompt:
                preempted["preemptions of a request that had decoded"] += 1
                where["preemptions of a request that had decoded"].add(example[0])
        log(self, name, **kwargs)
    machine.log = counting_log

    s = settings(manager_settings(100, 30, base=suite_settings()), phases=(Phase.explicit, Phase.generate),
                 derandomize=args.seed is None)
    t0 = time.perf_counter()
    with contextlib.nullcontext() if args.seed is None else forced_seed(args.seed):
        failed = programs.run_recorded(machine, s)
    counts.update(preempted)
    print(json.dumps({"seed": args.seed, "failed": failed is not None, "examples": machine.examples_run,
                      "seconds": round(time.perf_counter() - t0, 1),
                      "counts": {k: [counts[k], len(where[k]), sorted(where[k])[:12]] for k in sorted(counts)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
