"""Kill rate of a float16 softmax denominator under the ``ci`` profile, over independent seeds.

Runs ``paged_attention_matches_fp64_dense_reference`` on ``tests/kernels/narrow_denominator.py`` with
the ``ci`` profile's example count, one Hypothesis seed per run (``derandomize`` off so the seed
decides), stopping at the first failing example (no shrinking). ``--no-long`` draws no long contexts:
the same search without them, to show what they add. Prints one line per seed and the total::

    PYTHONPATH=. python bench/long_context_kill_rate.py --seeds 100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="independent runs (seeds 0 .. N-1)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-long", action="store_true", help="draw no long contexts (the short cases only)")
    args = parser.parse_args(argv)

    from hypothesis import Phase, settings

    import pagedkv.testing.strategies.batches as batches
    from pagedkv.testing import execute
    from pagedkv.testing.registry import properties
    from pagedkv.testing.settings import register_profiles
    from tests.kernels import narrow_denominator as kernel

    if args.no_long:
        batches.LONG_ONE_IN = 10**9  # the long switch never fires
    register_profiles()
    chosen = settings(settings.get_profile("pagedkv-ci"), derandomize=False, phases=[Phase.explicit, Phase.generate])
    prop = properties()["paged_attention_matches_fp64_dense_reference"]
    killed, start = 0, time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        outcome = execute.run(prop, (kernel,), "cpu", execute.suite_settings(chosen), seed=seed)
        killed += outcome.failed
        where = outcome.first_line.split(": got")[0] if outcome.failed else "survived"
        print(f"seed {seed}: {outcome.status} after {outcome.examples} examples; {where}", flush=True)
    print(f"killed in {killed} of {args.seeds} seeds ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
