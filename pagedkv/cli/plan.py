"""``python -m pagedkv plan``: what a conformance run on a GPU runner will cost, planned without a kernel run."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedkv.cli.common import PROFILE_NAMES


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan``."""
    parser = subparsers.add_parser(
        "plan", help="plan a GPU run of the suite: examples, specialisations, device memory, wall time",
        description="Plan a run of the conformance suite on a GPU runner without running a kernel: properties and "
                    "examples per profile, the distinct kernel specialisations each op needs (the run's cases are "
                    "drawn, not run), peak device memory of each leased test and the lease schedule over the "
                    "workers, and an estimated wall time from measured per-example costs and per-specialisation "
                    "compile costs (pagedkv's from its AOT compile report; another candidate's from "
                    "--compile-seconds). See docs/gpu.md.")
    parser.add_argument("--impl", default="triton", metavar="SPEC",
                        help="the candidate, as for pytest --pagedkv-impl (default: triton)")
    parser.add_argument("--profile", default="ci", metavar="NAME[,NAME]",
                        help=f"profiles to plan, comma separated, of {', '.join(PROFILE_NAMES)} (default: ci)")
    parser.add_argument("--device", default="cuda", help="the runner's device: cuda (default) or cpu")
    parser.add_argument("--workers", type=int, default=16, help="xdist workers (default 16)")
    parser.add_argument("--cores", type=int, default=None, help="CPU cores compiling at once (default: --workers)")
    parser.add_argument("--device-memory", default="141GiB", metavar="SIZE",
                        help="the device's memory (default 141GiB, an H200); the lease budget is this less --headroom")
    parser.add_argument("--headroom", default="16GiB", metavar="SIZE",
                        help="device memory kept out of the lease budget (default 16GiB)")
    parser.add_argument("--compile-seconds", type=float, default=None, metavar="S",
                        help="compile seconds of one kernel specialisation (default: pagedkv's AOT compile report, "
                             "sm_90 rows, which is only pagedkv's own kernels' cost)")
    parser.add_argument("--example-costs", default=None, metavar="FILE",
                        help="measured seconds per example per property (default: bench/results/example-costs.json)")
    parser.add_argument("--measure-examples", type=int, default=0, metavar="N",
                        help="measure the per-example costs here first (N examples of every property on the indexed "
                             "backend, CPU) and use them")
    parser.add_argument("--write-costs", default=None, metavar="FILE", help="write the measured costs to FILE")
    parser.add_argument("--draw-limit", type=int, default=200, metavar="N",
                        help="draw the cases of profiles of at most N examples per property to count specialisations "
                             "exactly; larger ones report the palette's bound (default 200)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import platform

    import pagedkv
    from pagedkv.backends import backend_name
    from pagedkv.tools import plan as planning
    from pagedkv.testing.device_lease import parse_bytes
    from pagedkv.testing.space import capabilities_under_test, load_candidates

    try:
        total = parse_bytes(args.device_memory, "--device-memory")
        budget = total - parse_bytes(args.headroom, "--headroom")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profiles = [p.strip() for p in args.profile.split(",") if p.strip()]
    unknown = [p for p in profiles if p not in PROFILE_NAMES]
    if unknown or budget <= 0 or args.workers < 1:
        print(f"error: --profile {unknown} not among {list(PROFILE_NAMES)}" if unknown else
              "error: --workers must be >= 1 and --headroom below --device-memory", file=sys.stderr)
        return 2
    try:
        backend = load_candidates(args.impl)[0]
    except pagedkv.BackendError as exc:
        print(f"error: --impl: {exc}", file=sys.stderr)
        return 2
    if args.compile_seconds is not None:
        compile_s = {op: args.compile_seconds for op in ("paged_attention", "paged_attention_csr", "gather",
                                                         "scatter", "write_kv")}
        source = "--compile-seconds"
    else:
        compile_s = planning.compile_seconds_from_report()
        source = "pagedkv's AOT compile report, sm_90" + ("" if backend_name(backend) == "triton" else
                                                          ": pagedkv's kernels, not this candidate's; "
                                                          "give --compile-seconds")
    costs_path = args.example_costs
    if args.measure_examples:
        costs = planning.measure_example_costs(args.measure_examples)
        if args.write_costs:
            with open(args.write_costs, "w") as f:
                json.dump({"measured_on": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
                           "method": f"python -m pagedkv plan --measure-examples {args.measure_examples}: "
                                     "indexed backend, CPU, generated examples only",
                           "seconds_per_example": costs}, f, indent=1, sort_keys=True)
    else:
        costs = planning._example_costs(costs_path)
    plans = [planning.plan_profile(backend, p, device=args.device, workers=args.workers,
                                   cores=args.cores or args.workers, budget=budget, compile_s=compile_s,
                                   example_costs=costs, draw_limit=args.draw_limit) for p in profiles]
    print(planning.format_plan(args.impl, capabilities_under_test(backend).summary(), plans, device=args.device,
                               workers=args.workers, budget=budget, compile_source=source, compile_s=compile_s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"impl": args.impl, "device": args.device, "workers": args.workers, "budget_bytes": budget,
                       "compile_seconds": compile_s, "profiles": planning.plan_json(plans)}, f, indent=1)
    return 0
