"""The GPU session's compile-count check: the specialisations the suite needed (its summary line)
against the plan made before it (``plan.json``) and the compile budget (under ``ci`` the plan's attention
budget, the palette's bound plus the explicit examples' own geometries, and at most 150). Exit status 1
when a count is over.

    python bench/compile_count_check.py SUITE_LOG PLAN_JSON
"""

from __future__ import annotations

import json
import re
import sys

CI_ATTENTION_BUDGET = 150


def main(suite_log: str, plan_json: str) -> int:
    plan = json.load(open(plan_json))["profiles"]
    planned = {profile: data["specialisations"] for profile, data in plan.items()}
    print("planned specialisations: " + "; ".join(f"{p} {c}" for p, c in planned.items()))
    over = planned.get("ci", {}).get("paged_attention", 0) > CI_ATTENTION_BUDGET
    if over:
        print(f"compile-count check: ci plans more than {CI_ATTENTION_BUDGET} attention specialisations: OVER")
    budget = plan.get("ci", {}).get("attention_budget")
    if budget and not budget["within"]:  # a generated case outside the palette, or more than it declares
        over = True
        print(f"compile-count check: ci plans {budget['total']} attention specialisations, {len(budget['outside'])} "
              f"drawn outside the palette, against its budget of {budget['limit']}: OVER")
    try:
        suite = open(suite_log).read()
    except OSError:
        suite = ""
    needed = re.search(r"pagedkv specialisations the run needed: ([^(\n]*)", suite)
    if not needed:
        print("compile-count check: the suite printed no specialisation line (a dry run, or the suite did not finish)")
        return int(over)
    for op, n in re.findall(r"(\w+) (\d+)", needed.group(1)):
        bound = planned.get("gpu", {}).get(op)
        ok = bound is None or int(n) <= bound
        over |= not ok
        print(f"compile-count check: {op} needed {n}, planned at most {bound}: {'ok' if ok else 'OVER'}")
    return int(over)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
