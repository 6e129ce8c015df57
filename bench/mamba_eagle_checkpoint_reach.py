"""Where vLLM's Mamba EAGLE checkpoint shift can change a hit: the planted fault
``mamba-checkpoint-ignores-eagle`` (``drop_eagle_checkpoint_block`` left ``False`` under EAGLE) beside the
release, on vLLM 0.32's own full + Mamba ("align") manager, producer prefills chunked by the scheduler's own
``_mamba_block_aligned_split`` and a resend or extension looked up after it.

    python bench/mamba_eagle_checkpoint_reach.py --tests ../shared/vllm-0.32.0-tests-v1-core

Two configurations: the Mamba block equal to the hash block (every Mamba layout of the hybrid peer) and the hash
block half the Mamba block (fine-grained partial hits). Printed: configurations run and those whose hit differs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from types import SimpleNamespace


def hit(make_manager, make_request, split, bs: int, hbs: int, prompt: int, ext: int, chunk: int, spec: int,
        fault: bool) -> int | None:
    """The hit of ``prompt + ext`` tokens after a producer prefilled ``prompt`` in chunks of ``chunk`` (``None``:
    the scheduler would not schedule a chunk)."""
    from vllm.utils.hashing import sha256

    m = make_manager(dcp_world_size=1, hash_block_size=hbs, full_block_size=bs, mamba_block_size=bs,
                     num_blocks=64, use_eagle=True, num_speculative_blocks=spec)
    if fault:
        for manager in m.coordinator.single_type_managers:
            if hasattr(manager, "drop_eagle_checkpoint_block"):
                manager.drop_eagle_checkpoint_block = False
    sched = SimpleNamespace(block_size=bs, cache_config=SimpleNamespace(block_size=bs), hash_block_size=hbs,
                            max_num_scheduled_tokens=8192,
                            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
                            use_eagle_block_drop=True, mamba_partial_cache_hit=hbs < bs,
                            mamba_shared_prefix_checkpoint=False, mamba_has_prefill_checkpoint_blocks=False,
                            mamba_prefill_checkpoint_alignment=None)
    producer = make_request("p", list(range(prompt)), hbs, sha256)
    while producer.num_computed_tokens < prompt:
        n = split(sched, producer, min(chunk, prompt - producer.num_computed_tokens))
        if n == 0:
            return None
        m.new_step_starts()
        assert m.allocate_slots(producer, n, num_lookahead_tokens=spec) is not None
        producer.num_computed_tokens += n
    m.free(producer)
    m.new_step_starts()
    return m.get_computed_blocks(make_request("r", list(range(prompt + ext)), hbs, sha256))[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="the CPU-runnable copy of vLLM's tests (its root)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.tests)
    from tests.v1.core.prefix_cache.test_partial_prefix_cache_hits import make_full_mamba_manager
    from tests.v1.core.test_prefix_caching import make_request
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler

    init_none_hash(sha256)
    for label, sizes in (("Mamba block = hash block", ((1, 1), (2, 2), (4, 4))),
                         ("hash block = Mamba block / 2 (fine-grained)", ((2, 1), (4, 2)))):
        run = differ = 0
        for (bs, hbs), prompt, ext, chunk, spec in itertools.product(sizes, range(1, 20), (0, 1, 3, 8),
                                                                     (1, 3, 5, 64), (0, 2)):
            a, b = (hit(make_full_mamba_manager, make_request, Scheduler._mamba_block_aligned_split, bs, hbs,
                        prompt, ext, chunk, spec, fault) for fault in (False, True))
            if a is None:
                continue
            run += 1
            differ += a != b
        print(f"{label}: {run} configurations, the fault's hit differs in {differ}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
