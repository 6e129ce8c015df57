"""``replay FILE --other BASELINE``: the drift half of a case file written by the baseline gate.

A case file from :mod:`pagedkv.tools.baseline.gate` records the candidate (``backend``) and the
baseline (``other``). Replay reruns the property's conformance check on the candidate as usual and
then, once it passes, runs the case on both (:func:`pagedkv.tools.baseline.drift.measure`) and prints both
outputs at the located position; ``--exact`` / ``--max-drift-ulp N`` apply the gate's verdict.

``other`` is the baseline when the property is not a pair property, or when it is a ``git:``,
``path:`` or ``wheel:`` spec (a pair property then runs against its usual partner, ``indexed``).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--exact`` and ``--max-drift-ulp`` (the baseline gate's options)."""
    parser.add_argument("--exact", action="store_true",
                        help="with a baseline (--other, or the recorded one): any attention drift fails")
    parser.add_argument("--max-drift-ulp", metavar="N", type=int, default=None,
                        help="with a baseline: attention drift past N ulp fails")


def split_other(record: dict) -> tuple[dict, str | None]:
    """``(record for the conformance check, baseline spec or None)`` (see the module docstring)."""
    from pagedkv.tools.baseline import is_baseline_spec
    from pagedkv.testing.registry import property_for_record

    other = record.get("other")
    if not other:
        return record, None
    try:
        pair = property_for_record(record["check"]).pair
    except KeyError:
        return record, None
    if is_baseline_spec(other) or not pair:
        return {**record, "other": None}, other
    return record, None


def _row(values: list) -> str:
    return "[" + ", ".join(f"{v:.9g}" for v in values) + "]"


def drift_against(backend: Any, spec: str, record: dict, baseline_spec: str, device: str, out: TextIO, *,
                  exact: bool = False, max_ulp: int | None = None) -> int:
    """Run the record's case on ``backend`` and on the baseline, print the drift and both outputs at the
    worst element; 1 when the gate (``exact``, ``max_ulp``; a data-movement divergence always) fails,
    2 when the baseline cannot be loaded, else 0."""
    from pagedkv.tools.baseline import load_baseline
    from pagedkv.testing.cases import Case
    from pagedkv.tools.baseline.drift import judge, measure
    from pagedkv.testing.registry import property_for_record

    case = record["case"]
    if not isinstance(case, Case):
        print(f"drift against {baseline_spec}: not compared (only Case records are; this is a {type(case).__name__})",
              file=out)
        return 0
    try:
        baseline = load_baseline(baseline_spec, spec)
    except Exception as exc:
        print(f"replay: cannot load baseline {baseline_spec!r}: {exc}", file=out)
        return 2
    ops = property_for_record(record["check"]).ops
    drift = measure(backend, baseline, case, device, ops)
    origin = getattr(baseline, "origin", None)
    print(f"drift against baseline {baseline_spec}" + (f" (loaded from {origin})" if origin else "") + ":", file=out)
    print(f"  compared: {', '.join(drift.compared) or 'nothing (no op in common)'}", file=out)
    for line in drift.diverged:
        print(f"  DIVERGES: {line}", file=out)
    w = drift.where
    if w and "candidate_row" in w:
        print(f"  attention: {drift.ulp} ulp, relative {drift.rel:.3g}; worst at sequence {w['seq']}, query position "
              f"{w['position']} (row {w['row']}), query head {w['query_head']}, dim {w['dim']}", file=out)
        print(f"    candidate  {spec}: {_row(w['candidate_row'])}", file=out)
        print(f"    baseline   {baseline_spec}: {_row(w['baseline_row'])}", file=out)
        print(f"    dim {w['dim']}: candidate {w['candidate']!r}, baseline {w['baseline']!r}", file=out)
    elif w:
        print(f"  attention: shapes differ: candidate {w['candidate']}, baseline {w['baseline']}", file=out)
    elif "paged_attention" in drift.compared:
        print("  attention: bit-identical", file=out)
    why = judge(drift, exact=exact, max_ulp=max_ulp)
    if why:
        print(f"DRIFT FAILS: {why}", file=out)
        return 1
    gate = "bit-exact" if exact else f"at most {max_ulp} ulp" if max_ulp is not None else "no gate: --exact or " \
        "--max-drift-ulp N"
    print(f"  drift within the gate ({gate})", file=out)
    return 0
