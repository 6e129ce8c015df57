"""Kill rate of one vLLM cache-manager source mutant over many seeds, searching only some of the hybrid peer's
layouts: each layout's search is the one ``python -m pagedkv mutate`` runs there (its own Hypothesis search,
seeded with ``property_seed(seed, "cache_manager")`` hashed with the layout's name, ``manager_kill_rate_settings(100)``,
the mutant loaded by pagedkv's mutant finder), so a mutant whose changed code runs in a few layouts gets its rate
over seeds without the other layouts' searches first.

    python bench/vllm_mutant_layout_kill_rate.py single_type_kv_cache_manager-0213 --seeds 2-16 \
        --layouts gemma3-sparse gemma3-interval qwen3-next-sparse --json out.json

``MUTANT`` may also name a fault of ``bench/planted_hybrid_manager_faults.py`` (its id, e.g.
``eagle-reverify-skipped``) or be ``release`` (the installed vLLM unchanged: the same searches' false alarms).

One child per mutant (the installed file is never edited); each seed stops at its first failing layout.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

INSTALL = """
install_mutant({module!r}, {path!r}, {original!r})
"""
#: After the peer imported vLLM as it does (:func:`~pagedkv.tools.peers.vllm_manager._import_vllm`).
LOADED = """
vm._import_vllm()
import importlib
importlib.import_module({module!r})
assert sys.modules[{module!r}].__file__ == {path!r}, "the mutant did not load"
"""

CHILD = """
import json, sys, time
{install}
from hypothesis import settings
from pagedkv.testing.hypothesis_internals import forced_seed
from pagedkv.testing.managers import programs
from pagedkv.testing.managers.machine import machine_for
from pagedkv.testing.settings import manager_kill_rate_settings
from pagedkv.tools.mutants.kill_rates import MANAGER_MACHINE, property_seed
from pagedkv.tools.peers import vllm_hybrid_manager as vm
{loaded}
runs = []
for seed in {seeds!r}:
    start, cpu, examples, error = time.perf_counter(), time.process_time(), 0, ""
    for name in {layouts!r}:
        machine = machine_for(vm.cache_manager, windows=vm.cache_manager_windows, layouts=(name,), name=name)
        if seed == 0:  # the derandomized search (the per-push gate's kind of search)
            steps = programs.run_recorded(machine, settings(manager_kill_rate_settings({programs}, {steps}),
                                                            derandomize=True))
        else:
            with forced_seed(property_seed(seed, MANAGER_MACHINE)):
                steps = programs.run_recorded(machine, manager_kill_rate_settings({programs}, {steps}))
        examples += machine.examples_run
        if steps is not None:
            error = name + ": " + steps.error.splitlines()[0][:240]
            break
    runs.append(dict(seed=seed, killed=bool(error), programs=examples, seconds=round(time.perf_counter() - start, 1),
                     cpu_s=round(time.process_time() - cpu, 1), error=error))
    print(json.dumps(runs[-1]), flush=True)
json.dump(dict(id={mutant!r}, layouts={layouts!r}, programs_per_layout={programs}, steps={steps}, tree={tree!r},
               runs=runs), open({out!r}, "w"), indent=1)
"""


def seed_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> int:
    from pagedkv.tools.mutants.generate import BOOTSTRAP, generate, write_mutant

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planted_hybrid_manager_faults import FAULTS
    from planted_manager_faults import _mutate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutant", help="a mutant id of vLLM's v1/core files (python -m pagedkv mutate --list), "
                        "a planted hybrid fault's id, or release")
    parser.add_argument("--seeds", type=seed_range, default=seed_range("2-6"),
                        help="FIRST-LAST (default 2-6); seed 0 is the derandomized search")
    parser.add_argument("--layouts", nargs="+", required=True, help="the peer's layouts to search, in order")
    parser.add_argument("--programs", type=int, default=100, help="programs per layout (ci: 100)")
    parser.add_argument("--steps", type=int, default=30, help="rules per program (the vLLM peer's gate: 30)")
    parser.add_argument("--json", required=True, help="where the runs go")
    args = parser.parse_args()
    import vllm.v1.core as core  # the installed package's files, found without importing a module to mutate

    planted = {fault[0]: fault for fault in FAULTS}
    if args.mutant == "release":
        install = loaded = ""
    elif args.mutant in planted:
        module, path, original = _mutate(Path(core.__path__[0]).parent.parent, planted[args.mutant],
                                         Path(tempfile.mkdtemp()))
        install = INSTALL.format(module=module, path=str(path), original=str(original))
        loaded = LOADED.format(module=module, path=str(path))
    else:
        stem = args.mutant.rsplit("-", 1)[0]
        mutant = next((m for m in generate(Path(core.__path__[0]) / f"{stem}.py") if m.id == args.mutant), None)
        if mutant is None:
            parser.error(f"mutant {args.mutant!r}: no such id in vllm/v1/core/{stem}.py")
        path = write_mutant(mutant, tempfile.mkdtemp())
        install = INSTALL.format(module=mutant.module, path=str(path), original=mutant.file)
        loaded = LOADED.format(module=mutant.module, path=str(path))
    tree = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "describe", "--always", "--dirty"],
                          capture_output=True, text=True).stdout.strip() or None  # the pagedkv tree searched
    child = BOOTSTRAP + CHILD.format(install=install, loaded=loaded, seeds=args.seeds, layouts=args.layouts,
                                     programs=args.programs, steps=args.steps, mutant=args.mutant, out=args.json,
                                     tree=tree)
    return subprocess.call([sys.executable, "-c", child])


if __name__ == "__main__":
    sys.exit(main())
