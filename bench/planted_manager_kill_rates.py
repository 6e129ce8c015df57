"""Kill rates of the planted faults of ``bench/planted_manager_faults.py`` over several searches of the one-group gate.

    python bench/planted_manager_kill_rates.py --only <ids> --seeds d 1 2 3 4 5 \
        --json bench/results/planted-vllm-manager-faults-<name>-rates.json

One child per fault (its mutant installed as ``planted_manager_faults.py`` installs it) runs the gate's search
once per seed (``d``: derandomized, else that Hypothesis seed), as that script's gate runs it under ``ci``
(the one-group layout's programs, ``programs.one_group_programs``), and prints each verdict; the release runs
first. Per fault: the searches that killed it, the first failing example of each, the seconds each took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planted_manager_faults import FAULTS, _child, _mutate  # noqa: E402

_GATE = r'''
import contextlib, json, sys, time
if sys.argv[1] != "-":
    install_mutant(sys.argv[1], sys.argv[2], sys.argv[3])
from hypothesis import Phase, settings
from pagedkv.testing.hypothesis_internals import forced_seed
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.settings import manager_settings, suite_settings
from pagedkv.tools.peers import vllm_hybrid_manager as vm
base = manager_settings(100, 30, base=suite_settings())
for arg in sys.argv[4:]:
    seed = None if arg == "d" else int(arg)
    machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, name="vllm_cache_manager_manager")
    s = settings(base, max_examples=programs.one_group_programs(base.max_examples),
                 phases=(Phase.explicit, Phase.generate), derandomize=seed is None)
    t0 = time.perf_counter()
    with contextlib.nullcontext() if seed is None else forced_seed(seed):
        steps = programs.run_recorded(machine, s)
    print("RESULT " + json.dumps({"seed": arg, "killed": steps is not None, "error": steps.error if steps else "",
          "first_failing_example": steps.first_failing_example if steps else None, "examples": machine.examples_run,
          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
'''


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="fault ids (default: all)")
    parser.add_argument("--seeds", nargs="+", default=["d", "1", "2", "3", "4", "5"],
                        help="'d' (derandomized) or Hypothesis seeds")
    parser.add_argument("--skip-release", action="store_true", help="the faults only (the release run elsewhere)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import vllm

    vllm_dir, repo = Path(vllm.__file__).parent, Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "PAGEDKV_PROFILE": "ci",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    rows = []
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        release = [] if args.skip_release else [("none",)]
        for fault in release + [f for f in FAULTS if not args.only or f[0] in args.only]:
            mod_args = ["-", "-", "-"] if fault[0] == "none" else [str(x) for x in _mutate(vllm_dir, fault, Path(tmp))]
            _, out, secs = _child(_GATE, [*mod_args, *args.seeds], repo, env, 3600)
            searches = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
            row = {"id": fault[0], "killed": sum(s["killed"] for s in searches), "searches": searches,
                   "wall_s": round(secs, 1)}
            if len(searches) < len(args.seeds):
                row["crashed"] = out[-300:]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("id", "killed")}), " ".join(
                f"{s['seed']}:{'K' + str(s['first_failing_example']) if s['killed'] else '-'}" for s in searches),
                flush=True)
    Path(args.json).write_text(json.dumps({"seeds": args.seeds, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
