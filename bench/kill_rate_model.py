"""What a search of N programs a layout kills, from seeded kill-rate runs
(``bench/vllm_mutant_layout_kill_rate.py``'s JSON files).

Each seed of such a run searches until a program fails or the budget ends, so the seeds together are
``runs`` independent programs of which ``kills`` failed (the JSON's ``programs``: every program Hypothesis ran,
those it drew past its buffer included, about 1.45 for each of the ``max_examples`` it counts): the chance that
one program kills is estimated as ``kills / runs`` (the maximum-likelihood estimate of a geometric waiting time,
survivors counted in). A search of ``N`` programs a layout over ``L`` layouts runs ``r * N * L`` programs, ``r``
measured on the files' surviving seeds (1 where every seed killed: the rates below are then low), and kills with
chance ``1 - (1 - p) ** (r * N * L)``. The model takes every program of every layout searched as alike; where a
mutant is reached in one layout only, pass that layout alone to the kill-rate run.

    python bench/kill_rate_model.py /tmp/0056.json /tmp/mamba.json --per-layout 100 2000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def estimate(runs: list[dict]) -> tuple[int, int, float]:
    """``(kills, programs, p)``: the seeds that killed, the programs searched in all, one program's kill chance."""
    kills = sum(bool(r["killed"]) for r in runs)
    programs = sum(int(r["programs"]) for r in runs)
    return kills, programs, kills / programs if programs else 0.0


def rate(p: float, programs: int) -> float:
    """The chance that a search of ``programs`` programs kills, each killing with chance ``p``."""
    return 1.0 - (1.0 - p) ** programs


def programs_for(p: float, target: float = 0.99) -> float:
    """Programs a search needs to kill with chance ``target`` (infinite where ``p`` is 0)."""
    if p <= 0:
        return math.inf
    if p >= 1:
        return 1.0
    return math.log(1.0 - target) / math.log(1.0 - p)


def runs_per_program(files: list[dict]) -> float:
    """Programs run for each one a search counts (``max_examples``), over the surviving seeds of ``files``; 1 where
    none survived."""
    ratios = [r["programs"] / (d["programs_per_layout"] * len(d["layouts"]))
              for d in files for r in d["runs"] if not r["killed"]]
    return sum(ratios) / len(ratios) if ratios else 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="kill-rate JSON files")
    parser.add_argument("--per-layout", nargs="+", type=int, default=[100, 2000],
                        help="programs a layout to report the kill chance at (ci: 100, nightly: 2000)")
    parser.add_argument("--layouts", type=int, default=None,
                        help="layouts a search covers (default: the file's layouts)")
    args = parser.parse_args()
    files = [json.loads(path.read_text()) for path in args.runs]
    ratio = runs_per_program(files)
    print(f"{ratio:.2f} programs run for each one counted (the surviving seeds' mean)\n")
    head = ["mutant", "layouts", "programs a layout", "seeds killed", "programs run", "one program kills"]
    head += [f"kills at {n} a layout" for n in args.per_layout] + ["programs a layout for 99%"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for data in files:
        layouts = args.layouts or len(data["layouts"])
        kills, programs, p = estimate(data["runs"])
        row = [f"`{data['id']}`", str(layouts), str(data["programs_per_layout"]), f"{kills} of {len(data['runs'])}",
               f"{programs:,}", f"{p:.2%}"]
        row += [f"{rate(p, round(ratio * n * layouts)):.1%}" for n in args.per_layout]
        need = programs_for(p) / ratio / layouts
        row.append("not reached" if math.isinf(need) else f"{math.ceil(need):,}")
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
