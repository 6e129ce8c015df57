"""Where ``block_pool-0037`` (``BlockPool.cache_partial_block`` recording a partial entry's ``num_hash_blocks`` as
its token count) changes what vLLM reports at a prefill's first output: ``KVCacheManager.estimate_cached_tokens``
(the ``num_cache_creation_tokens`` of a ``RequestOutput``), read right after the step computing each prompt's last
token, with the release and with the mutant on the same calls (random prompts sharing a prefix, random chunks,
a decode token or two, half the requests freed), per layout, hash block size and EAGLE on or off.

    PYTHONPATH=. python bench/cached_prompt_mutant_reach.py qwen3-next-fine mixed-block-sizes two-window-block-sizes

Prints each run whose reports differ (its first differing ``(request, prompt length, hit, reported)`` pairs) and
the count of such runs.
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import textwrap

from pagedkv.testing.managers.protocol import (ManagerConfig, layout_groups, layout_prefix_match_unit,
                                               layout_retention)
from pagedkv.tools.peers.vllm_hybrid_manager import cache_manager
from pagedkv.tools.peers.vllm_manager import _import_vllm

_import_vllm()
import vllm.v1.core.block_pool as bp  # noqa: E402  (after the peer's import of vLLM)

SOURCE = textwrap.dedent(inspect.getsource(bp.BlockPool.cache_partial_block))
assert SOURCE.count("num_tokens=num_hash_blocks * self.hash_block_size") == 1
_ns: dict = {}
exec(compile(SOURCE.replace("num_tokens=num_hash_blocks * self.hash_block_size", "num_tokens=num_hash_blocks"),
             bp.__file__, "exec"), bp.__dict__, _ns)
ORIGINAL, MUTANT = bp.BlockPool.cache_partial_block, _ns["cache_partial_block"]


def drive(name: str, bs: int, spec: int, seed: int, mutant: bool) -> list:
    """One run: ``(request, prompt length, hit, reported)`` per prompt computed (or why it stopped)."""
    bp.BlockPool.cache_partial_block = MUTANT if mutant else ORIGINAL
    rng = random.Random(seed)
    m = cache_manager(ManagerConfig(40, bs, None, 2, groups=layout_groups(name, bs, 2),
                                    prefix_match_unit=layout_prefix_match_unit(name, bs),
                                    retention_interval=layout_retention(name, bs, 2), num_speculative_tokens=spec))
    base, log = [rng.randint(0, 2) for _ in range(20)], []
    for rid in range(12):
        length = rng.randint(1, 20)
        prompt = base[:rng.randint(0, length)]
        prompt += [rng.randint(0, 2) for _ in range(length - len(prompt))]
        got = m.admit(rid, prompt)
        if got is None:
            log.append(("refused", rid))
            continue
        pos = got[1]
        while pos < len(prompt):
            slots = m.reserve(rid, prompt[pos:pos + rng.randint(1, 8)]) or m.reserve(rid, prompt[pos:])
            if slots is None:
                log.append(("out of blocks", rid))
                break
            pos += len(slots[0])
            m.commit(rid, pos)
        else:
            log.append((rid, len(prompt), got[1], m.cached_prompt_tokens(rid)))
            for _ in range(rng.randint(0, 2)):
                if m.reserve(rid, [1]) is None:
                    break
                pos += 1
                m.commit(rid, pos)
        if rng.random() < 0.5:
            m.free(rid)
    return log


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="+", help="layout names of pagedkv.testing.managers.protocol.HYBRID_LAYOUTS")
    differ = total = 0
    for name in parser.parse_args(argv).layouts:
        for bs in (2, 3):
            for spec in (0, 2):
                for seed in range(40):
                    a, b = drive(name, bs, spec, seed, False), drive(name, bs, spec, seed, True)
                    total += 1
                    if a != b:
                        differ += 1
                        print(name, f"hash block {bs}", f"drafts {spec}", f"seed {seed}",
                              [(x, y) for x, y in zip(a, b) if x != y][:3])
    print(f"runs whose reports differ: {differ} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
