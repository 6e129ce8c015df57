"""The plan of a conformance run on a GPU runner, made before it and without running a kernel.

:func:`make_plan` answers what the first GPU run of a candidate will cost: the properties and examples
per profile, the distinct kernel specialisations per op (drawn from the run's palette exactly as the
suite draws them: the strategies run, the kernels do not), the peak device memory of each test that
leases it and the lease schedule over the workers (:mod:`pagedkv.testing.device_lease`), and an
estimated wall time:

    wall = startup + the tests' makespan over the workers (each test: examples x seconds per example)
           + (specialisations x compile seconds) / min(workers, cores) + the leased tests' schedule

Seconds per example are measured (:data:`EXAMPLE_COSTS`: the host side of each property's examples,
drawing, building and the fp64 reference, timed with the ``indexed`` backend on a CPU; a GPU adds its
kernel launches, microseconds each); compile seconds per specialisation come from pagedkv's AOT
compile report (``bench/results/compile-report.json``) for its Triton kernels, or ``--compile-seconds``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

#: The committed per-example costs (``python -m pagedkv plan --measure-examples N --write-costs FILE``).
EXAMPLE_COSTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "example-costs.json"
COMPILE_REPORT = Path(__file__).resolve().parents[2] / "bench" / "results" / "compile-report.json"
#: Seconds per example when a property has no measured cost.
DEFAULT_EXAMPLE_S = 0.05
#: Seconds to start one xdist worker (import torch, triton, pagedkv; create a CUDA context), run in parallel.
WORKER_START_S = 20.0
#: Device bandwidth assumed to zero-fill a leased pool (bytes per second; an H200 writes ~4 TB/s).
FILL_BYTES_PER_S = 2e12
_ATTENTION = ("paged_attention", "paged_attention_csr")


@dataclasses.dataclass
class PropertyPlan:
    """One property under one profile: examples drawn, specialisations its cases need per op, seconds."""

    name: str
    ops: tuple
    examples: int
    skipped: str = ""
    leased_bytes: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class AttentionBudget:
    """The attention specialisations a run may compile, known before it: the palette's bound (shapes x
    feature sets), plus the explicit examples' own geometries (a fixed list, the same every run) and the
    fixed geometries of the limit properties, each counted where they lie outside the palette.

    Attributes:
        palette_bound: :attr:`~pagedkv.testing.strategies.palette.Palette.bound`.
        palette_drawn: distinct specialisations the generated cases drew inside the palette.
        explicit: the explicit examples' specialisations outside the palette (each a fixed geometry).
        fixed: the limit properties' specialisations outside the palette and the explicit examples'.
        outside: generated cases' specialisations outside the palette (a strategy leaking past the
            budget: a compile storm growing with the example count; must be empty).
    """

    palette_bound: int
    palette_drawn: int
    explicit: int
    fixed: int
    outside: list

    @property
    def limit(self) -> int:
        """The budget: the palette's bound plus the explicit examples' and the limit properties' own."""
        return self.palette_bound + self.explicit + self.fixed

    @property
    def total(self) -> int:
        return self.palette_drawn + self.explicit + self.fixed + len(self.outside)

    @property
    def within(self) -> bool:
        return not self.outside and self.total <= self.limit

    def describe(self) -> str:
        verdict = "within" if self.within else "OVER"
        line = (f"attention budget: {self.total} = {self.palette_drawn} of the palette's {self.palette_bound} + "
                f"{self.explicit} explicit examples' own + {self.fixed} fixed geometries + {len(self.outside)} drawn "
                f"outside the palette; {verdict} the budget of {self.limit}")
        return line + ("" if not self.outside else "; outside: " + "; ".join(map(str, self.outside[:3])))


@dataclasses.dataclass
class ProfilePlan:
    """One profile's plan (see :func:`make_plan`)."""

    profile: str
    properties: list
    specialisations: dict  # op -> count
    specialisations_drawn: bool  # counted from drawn cases (else the palette's bound)
    palette: str
    examples_s: float
    compile_s: float
    leases: list  # (test, bytes, start_s, end_s, worker)
    lease_s: float
    startup_s: float
    budget: AttentionBudget | None = None

    @property
    def wall_s(self) -> float:
        return self.startup_s + self.examples_s + self.compile_s + self.lease_s


def compile_seconds_from_report(path: Path = COMPILE_REPORT, arch: int = 90) -> dict[str, float]:
    """Mean compile seconds of one specialisation per op from the AOT compile report: for attention a
    decode and a prefill kernel (and the split-K partial and merge), for the copies one kernel each.

    Raises:
        FileNotFoundError: no report at ``path``.
    """
    rows = [r for r in json.loads(Path(path).read_text())["after"]["rows"] if r["arch"] == arch and not r["error"]]

    def mean(pred) -> float:
        picked = [r["seconds"] for r in rows if pred(r)]
        return sum(picked) / len(picked) if picked else 0.0

    attention = sum(mean(lambda r, m=m: r["case"].startswith(m) and r["kernel"] == "_paged_attention_kernel")
                    for m in ("decode", "prefill"))
    out = {op: attention for op in _ATTENTION}
    for op in ("gather", "scatter", "write_kv"):
        out[op] = mean(lambda r, op=op: r["case"].startswith(op))
    return out


def _example_costs(path: Path | None) -> dict[str, float]:
    path = path or EXAMPLE_COSTS
    return json.loads(Path(path).read_text())["seconds_per_example"] if Path(path).exists() else {}


def _caps_for(backend: Any, device: str):
    """The declared space (on a GPU, not the CPU interpreter's narrowing), its compile budget resolved."""
    from pagedkv.backends.capabilities import SPECIALIZATION_NAMES, capabilities_of
    from pagedkv.testing.space import capabilities_under_test, launches_triton

    if not str(device).startswith("cuda"):
        return capabilities_under_test(backend, for_drawing=True)
    caps = capabilities_of(backend)
    if caps.specialize_on is None and launches_triton(backend):
        caps = dataclasses.replace(caps, specialize_on=SPECIALIZATION_NAMES)
    return caps


def _leased_bytes(prop: Any, caps: Any) -> int:
    """Device bytes a property's check leases (:func:`pagedkv.testing.device_lease.leased`); 0 for the others."""
    bytes_of = getattr(prop.check, "leased_bytes", None)
    if bytes_of is None:
        return 0
    strategy = prop.strategy(caps)
    case = strategy.value if hasattr(strategy, "value") else strategy.example()  # st.just: one fixed case
    return 0 if case is None else int(bytes_of(case))


def _draw_keys(prop: Any, caps: Any, max_examples: int, derandomize: bool, seed: int,
               explicit: bool = False) -> dict[str, set]:
    """The specialisation keys of ``max_examples`` cases drawn as the suite draws them (no kernel runs);
    with ``explicit``, of the property's explicit examples instead."""
    import hypothesis
    from hypothesis import given

    from pagedkv.backends.capabilities import SPECIALIZATION_NAMES
    from pagedkv.testing.settings import drawing_settings
    from pagedkv.testing.specialisations import key_of

    names = caps.specialize_on or SPECIALIZATION_NAMES
    keys: dict[str, set] = {op: set() for op in prop.ops}

    def body(case):
        for op in prop.ops:
            key = key_of(op, case, names)
            if key is not None:
                keys[op].add(key)

    if explicit:
        for case in prop.examples_in(caps):
            body(case)
        return keys
    test = drawing_settings(max_examples, derandomize)(given(prop.strategy_in(caps))(body))
    if not derandomize:
        test = hypothesis.seed(seed)(test)
    test()
    return keys


def _makespan(seconds: list[float], workers: int) -> float:
    """The wall time of tests of these durations over ``workers`` (longest first, each to the least loaded
    worker: xdist hands out whole tests, so one long property bounds the run from below)."""
    load = [0.0] * workers
    for s in sorted(seconds, reverse=True):
        load[load.index(min(load))] += s
    return max(load, default=0.0)


def _schedule(leased: list[tuple[str, int, float]], budget: int, workers: int) -> tuple[list, float]:
    """Greedy list schedule of the leased tests (``(test, bytes, seconds)``, largest first) over ``workers``
    with at most ``budget`` bytes leased at once: ``[(test, bytes, start, end, worker)]`` and the makespan."""
    free_at = [0.0] * workers
    running: list[tuple[float, int]] = []  # (end, bytes)
    out = []
    for test, nbytes, seconds in sorted(leased, key=lambda t: -t[1]):
        if nbytes > budget:
            out.append((test, nbytes, None, None, None))
            continue
        w = min(range(workers), key=lambda i: free_at[i])
        start = free_at[w]
        while sum(b for end, b in running if end > start) + nbytes > budget:
            start = min(end for end, _ in running if end > start)
        end = start + seconds
        running.append((end, nbytes))
        free_at[w] = end
        out.append((test, nbytes, start, end, w))
    return out, max((e for _, _, _, e, _ in out if e is not None), default=0.0)


#: Specialisations of the fixed geometries (the large-pool and limit cases: head_dim 1, one kv head, block
#: sizes 1 / 16 / 64 / 256 in two 16-bit dtypes, and the declared-geometry limits) beside the palette's.
FIXED_GEOMETRIES = {"copy": 10}


def _bound(op: str, palette: Any) -> int:
    """The most specialisations of a copy ``op`` a run drawing from ``palette`` can need: one per shape and
    pool format (the dtype's, fp8 e4m3, fp8 e5m2), with the fixed geometries (attention's:
    :class:`AttentionBudget`)."""
    formats = 3 if any("fp8" in s for s in palette.feature_sets) else 1
    return len(palette.shapes) * formats + FIXED_GEOMETRIES["copy"]


def plan_profile(backend: Any, profile: str, *, device: str, workers: int, cores: int, budget: int,
                 compile_s: dict[str, float], example_costs: dict[str, float], draw_limit: int) -> ProfilePlan:
    """The plan of one profile (see the module docstring)."""
    from hypothesis import settings

    from pagedkv.testing.execute import _with_reference
    from pagedkv.testing.registry import properties
    from pagedkv.testing.space import example_cap
    from pagedkv.testing.strategies.geometry import run_palette
    from pagedkv.testing.strategies.palette import palette_seed
    from pagedkv.testing.settings import PROFILES, register_profiles

    register_profiles()
    settings.load_profile(f"pagedkv-{profile}")
    caps = _caps_for(backend, device)
    palette = run_palette(caps)
    count = PROFILES[profile]["max_examples"]
    derandomize = PROFILES[profile].get("derandomize", False)
    cap = None if str(device).startswith("cuda") else example_cap([backend], count)
    plans, drawn = [], True
    union: dict[str, set] = {}  # op -> keys, every draw
    by_source: dict[str, dict[str, set]] = {"generated": {}, "explicit": {}, "fixed": {}}  # attention keys
    for prop in properties().values():
        backends = _with_reference(prop, (backend,))
        reason = prop.cannot_run(backends, caps)
        n = min(x for x in (prop.max_examples, count, cap) if x is not None)
        plan = PropertyPlan(prop.name, prop.ops, 0 if reason else n, reason or "")
        if not reason:
            plan.leased_bytes = _leased_bytes(prop, caps)
            plan.seconds = n * example_costs.get(prop.name, DEFAULT_EXAMPLE_S)
            if prop.kind in ("case", "invalid", "scenario", "limit"):
                seed = palette_seed(profile)
                # the explicit examples are a fixed list: always counted; generated cases up to the draw limit
                for source, explicit in (("generated", False), ("explicit", True))[0 if n <= draw_limit else 1:]:
                    if prop.kind == "limit":  # one fixed geometry each, whatever the palette
                        source = "fixed"
                    for op, keys in _draw_keys(prop, caps, n, derandomize, seed, explicit).items():
                        union.setdefault(op, set()).update(keys)
                        by_source[source].setdefault(op, set()).update(keys)
                drawn &= n <= draw_limit
            elif prop.kind != "machine":
                drawn = False
        plans.append(plan)
    ops = sorted({op for p in plans if not p.skipped for op in p.ops} | set(union))
    attention = attention_budget(palette, by_source, drawn) if palette is not None else None
    if drawn or palette is None:
        counts = {op: len(union.get(op, ())) for op in ops}
    else:  # past the draw limit: the palette's bound (what a run of that many examples reaches)
        counts = {op: attention.total if op in _ATTENTION else max(len(union.get(op, ())), _bound(op, palette))
                  for op in ops}
    compile_total = sum(counts[op] * compile_s.get(op, 0.0) for op in counts)
    leased = [(f"test_{p.name}", p.leased_bytes, p.seconds + p.leased_bytes / FILL_BYTES_PER_S)
              for p in plans if p.leased_bytes and not p.skipped]
    schedule, makespan = _schedule(leased, budget, workers)
    examples_s = _makespan([p.seconds for p in plans if not p.leased_bytes and not p.skipped], workers)
    return ProfilePlan(profile, plans, counts, drawn, palette.describe() if palette else "no palette (draws freely)",
                       examples_s, compile_total / max(1, min(workers, cores)), schedule, makespan, WORKER_START_S,
                       attention)


def attention_budget(palette: Any, by_source: dict[str, dict[str, set]], drawn: bool = True) -> AttentionBudget:
    """The :class:`AttentionBudget` of a run drawing from ``palette``, from the attention keys drawn per
    source (``generated``, ``explicit``, ``fixed``: op -> keys, as :func:`_draw_keys` returns them); without
    ``drawn`` (more examples than the plan draws) the palette is counted whole, at its bound."""
    from pagedkv.testing.specialisations import in_palette

    def attention(source: str) -> set:
        return {key for op in _ATTENTION for key in by_source.get(source, {}).get(op, ())}

    generated, explicit, fixed = attention("generated"), attention("explicit"), attention("fixed")
    inside = {key for key in generated if in_palette(key, palette)}
    own_explicit = {key for key in explicit if not in_palette(key, palette)} - generated
    own_fixed = {key for key in fixed if not in_palette(key, palette)} - generated - own_explicit
    return AttentionBudget(palette.bound, len(inside) if drawn else palette.bound, len(own_explicit), len(own_fixed),
                           sorted(generated - inside))


def measure_example_costs(examples: int = 3, device: str = "cpu") -> dict:
    """Seconds per example of every property, timed on the ``indexed`` backend (``examples`` each)."""
    import pagedkv
    from pagedkv.testing import execute
    from pagedkv.testing.registry import properties
    from pagedkv.testing.settings import timing_settings

    backend = pagedkv.get_backend("indexed")
    costs = {}
    for prop in properties().values():
        start = time.perf_counter()
        outcome = execute.run(prop, (backend,), device, timing_settings(examples), explicit=False)
        if outcome.examples:
            costs[prop.name] = round((time.perf_counter() - start) / outcome.examples, 4)
    return costs


def format_plan(spec: str, backend_caps: str, plans: list[ProfilePlan], *, device: str, workers: int,
                budget: int, compile_source: str, compile_s: dict[str, float]) -> str:
    """The plan as text (what ``python -m pagedkv plan`` prints)."""
    from pagedkv.testing.device_lease import format_bytes

    lines = [f"plan: {spec} on {device}, {workers} workers, device-memory budget {format_bytes(budget)}",
             f"declared space: {backend_caps}",
             "compile seconds per specialisation (" + compile_source + "): "
             + ", ".join(f"{op} {s:.2f}" for op, s in compile_s.items() if s)]
    for p in plans:
        run = [q for q in p.properties if not q.skipped]
        lines += ["", f"== profile {p.profile}: {len(run)} properties run ({len(p.properties) - len(run)} skipped), "
                  f"{sum(q.examples for q in run)} examples", f"  {p.palette}",
                  "  distinct specialisations per op" + ("" if p.specialisations_drawn else
                                                        " (palette bound: more examples than were drawn)") + ": "
                  + ", ".join(f"{op} {n}" for op, n in sorted(p.specialisations.items(),
                                                               key=lambda kv: (kv[0] not in _ATTENTION, kv[0])))]
        if p.budget is not None:
            lines.append("  " + p.budget.describe())
        lines.append("  examples per property: " + ", ".join(f"{q.name} {q.examples}" for q in run))
        skipped = [q for q in p.properties if q.skipped]
        if skipped:
            lines.append("  skipped: " + "; ".join(f"{q.name} ({q.skipped[:60]})" for q in skipped))
        lines.append("  peak device memory per leased test and the lease schedule:")
        for test, nbytes, start, end, worker in p.leases:
            when = "NEVER (larger than the budget)" if start is None else \
                f"worker {worker} {start:7.1f} s -> {end:7.1f} s"
            lines.append(f"    {test:70} {format_bytes(nbytes):>12}  {when}")
        peak = max((b for _, b, s, _, _ in p.leases if s is not None), default=0)
        lines += [f"  peak leased at once <= {format_bytes(min(budget, sum(b for _, b, *_ in p.leases)))}; "
                  f"largest lease {format_bytes(peak)}",
                  f"  estimated wall time: {p.wall_s:.0f} s = start {p.startup_s:.0f} + examples {p.examples_s:.0f} "
                  f"+ compiles {p.compile_s:.0f} + leased tests {p.lease_s:.0f}"]
    return "\n".join(lines)


def plan_json(plans: list[ProfilePlan]) -> dict:
    """The plans as JSON-ready data (``--json``)."""
    return {p.profile: {"wall_s": round(p.wall_s, 1), "startup_s": p.startup_s, "examples_s": round(p.examples_s, 1),
                        "compile_s": round(p.compile_s, 1), "lease_s": round(p.lease_s, 1),
                        "specialisations": p.specialisations, "specialisations_drawn": p.specialisations_drawn,
                        "attention_budget": None if p.budget is None else {
                            **dataclasses.asdict(p.budget), "outside": [list(k) for k in p.budget.outside],
                            "limit": p.budget.limit, "total": p.budget.total, "within": p.budget.within},
                        "palette": p.palette,
                        "properties": [dataclasses.asdict(q) for q in p.properties],
                        "leases": [list(x) for x in p.leases]} for p in plans}
