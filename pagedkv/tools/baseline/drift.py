"""Drift: how far the candidate's outputs moved from the baseline's (the code the refactor replaces).

Data movement (``gather`` rows, the pools after ``scatter`` and ``write_kv``) has no rounding, so any
difference is a *divergence*: compared bit for bit (:func:`pagedkv.testing.compare.first_difference`).
Attention is compared element by element in its output dtype:

- **ulp**: the distance between the two values on the dtype's number line (how many representable
  values apart: :func:`ulp_distance`; ``+0`` and ``-0`` are 0 apart, NaN against NaN is 0, NaN against a
  number is :data:`NAN_ULP`);
- **relative difference**: ``|c - b| / max(|c|, |b|)`` in float64 (0 when both are 0; at most 2).

The worst element is located: sequence, query position, query head, dim, both values. This is the
comparison FlashInfer and vLLM make against a reference implementation, applied to the previous
version of the same code.

:class:`DriftLog` keeps, per property, the examples compared and the worst case (largest ulp, then
largest relative difference) with its case, and merges across processes (pytest-xdist workers).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedkv.testing.compare import bits, first_difference

#: The ulp distance reported for NaN against a number (or a shape / dtype difference).
NAN_ULP = 2**62
DATA_OPS = ("gather", "scatter", "write_kv")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance of ``a`` and ``b`` in units in the last place of their (common) dtype.

    Args:
        a, b: floating tensors of equal shape and dtype (float32, float16, bfloat16, float64; any device).

    Returns:
        ``int64`` tensor of ``a``'s shape on the CPU: the number of representable values between them
        (``+0`` / ``-0``: 0; NaN vs NaN: 0; NaN vs anything else: :data:`NAN_ULP`).

    Raises:
        ValueError: shapes or dtypes differ, or the dtype is not floating.
    """
    if a.shape != b.shape or a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise ValueError(f"ulp_distance needs two floating tensors of one shape and dtype, got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)} {b.dtype}")
    a, b = a.detach().cpu(), b.detach().cpu()
    sign_bit = 8 * a.element_size() - 1

    def ordered(x: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits -> a monotone integer line
        i = bits(x).to(torch.int64)
        magnitude = i & ((1 << sign_bit) - 1)
        return torch.where(i < 0, -magnitude, magnitude)
    dist = (ordered(a) - ordered(b)).abs()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    dist = torch.where(nan_a & nan_b, torch.zeros_like(dist), dist)
    return torch.where(nan_a ^ nan_b, torch.full_like(dist, NAN_ULP), dist)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b| / max(|a|, |b|)`` in float64 on the CPU (0 where both are 0 or both NaN, inf where one is NaN)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    rel = (a - b).abs() / torch.maximum(a.abs(), b.abs())
    rel = torch.where((a == b) | (torch.isnan(a) & torch.isnan(b)), torch.zeros_like(rel), rel)
    return torch.nan_to_num(rel, nan=float("inf"))


@dataclass
class Drift:
    """One example compared on the candidate and the baseline.

    Attributes:
        compared: the outputs compared (``"gather"``, ``"scatter"``, ``"write_kv"``, ``"paged_attention"``).
        diverged: one line per data-movement output that differs bit for bit (located).
        ulp: largest attention ulp distance (0 when attention was equal or not compared).
        rel: largest attention relative difference.
        where: the element of largest ulp: ``{"seq", "position", "row", "query_head", "dim", "candidate",
            "baseline", "candidate_row", "baseline_row"}`` (the rows are the head vectors, 8 values at most).
    """

    compared: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    ulp: int = 0
    rel: float = 0.0
    where: dict | None = None

    def describe(self) -> str:
        """One line: the divergences, else the attention drift and where it is worst."""
        if self.diverged:
            return "; ".join(self.diverged)
        if "paged_attention" not in self.compared:
            return "data movement bit-identical"
        if not self.where:
            return "attention bit-identical"
        w = self.where
        return (f"attention {_ulp(self.ulp)} ulp, relative {self.rel:.3g}, worst at sequence {w['seq']}, query "
                f"position {w['position']}, query head {w['query_head']}, dim {w['dim']}: candidate "
                f"{w['candidate']!r}, baseline {w['baseline']!r}")


def _ulp(n: int) -> str:
    return "NaN-vs-number" if n >= NAN_ULP else str(n)


def locate(case: Any, row: int, head: int, dim: int) -> dict:
    """``{"seq", "position", "row", "query_head", "dim"}`` of attention output element ``[row, head, dim]``."""
    seq, position = case.row_position(row)
    return {"seq": seq, "position": position, "row": row, "query_head": head, "dim": dim}


def attention_drift(case: Any, candidate: torch.Tensor, baseline: torch.Tensor) -> tuple[int, float, dict | None]:
    """``(max ulp, max relative difference, where)`` of two ``[total_q, num_q_heads, head_dim]`` outputs;
    ``where`` is ``None`` when they are bit-identical (see :class:`Drift`)."""
    if candidate.shape != baseline.shape or candidate.dtype != baseline.dtype:
        return NAN_ULP, float("inf"), {"seq": 0, "position": 0, "row": 0, "query_head": 0, "dim": 0,
                                       "candidate": f"{tuple(candidate.shape)} {candidate.dtype}",
                                       "baseline": f"{tuple(baseline.shape)} {baseline.dtype}"}
    if candidate.numel() == 0 or torch.equal(bits(candidate.cpu()), bits(baseline.cpu())):
        return 0, 0.0, None
    ulp = ulp_distance(candidate, baseline)
    rel = relative_difference(candidate, baseline)
    row, head, dim = (int(x) for x in torch.nonzero(ulp == ulp.max())[0])
    c, b = candidate.cpu(), baseline.cpu()
    where = {**locate(case, row, head, dim), "candidate": float(c[row, head, dim]),
             "baseline": float(b[row, head, dim]), "candidate_row": c[row, head, :8].tolist(),
             "baseline_row": b[row, head, :8].tolist()}
    return int(ulp.max()), float(rel.max()), where


def run_outputs(backend: Any, case: Any, device: str, ops: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """What ``backend`` computes on fresh tensors of ``case`` for each of ``ops``, as CPU tensors:
    ``gather[i]`` (sequence ``i``), ``scatter.k_cache``, ``write_kv.k_cache`` / ``write_kv.v_cache`` (the pools
    after the write, as :func:`~pagedkv.testing.properties.definitions.backends_agree` does) and ``paged_attention``."""
    from pagedkv.testing.cases.case import writable, write_slot_mapping
    from pagedkv.testing.properties.definitions import run_attention

    out: dict[str, torch.Tensor] = {}
    if "gather" in ops:
        k_cache, _ = case.caches(device)
        tables = case.block_tables(device)
        for i, s in enumerate(case.seqs):
            out[f"gather[{i}]"] = backend.gather(k_cache, tables[i], s.seq_len).cpu()
    if "scatter" in ops:
        k_cache, _ = case.caches(device)
        tables, new = case.block_tables(device), case.stored_kv(1)
        for i in writable(case):
            start = case.seqs[i].start
            backend.scatter(k_cache, tables[i], new[i][0][start:].to(device), start)
        out["scatter.k_cache"] = k_cache.cpu()
    if "write_kv" in ops:
        k_cache, v_cache = case.caches(device)
        slots, _ = write_slot_mapping(case)
        g = case.geometry
        key = torch.randn((len(slots), g.num_kv_heads, g.head_dim), generator=case._generator(3)).to(g.torch_dtype)
        backend.write_kv(k_cache, v_cache, key.to(device), (-key).to(device),
                         torch.tensor(slots, dtype=torch.int64, device=device), **case.kv_scales(device))
        out["write_kv.k_cache"], out["write_kv.v_cache"] = k_cache.cpu(), v_cache.cpu()
    if "paged_attention" in ops:
        out["paged_attention"] = run_attention(backend, case, device).cpu()
    return out


def measure(candidate: Any, baseline: Any, case: Any, device: str = "cpu", ops: tuple[str, ...] = ()) -> Drift:
    """Run ``case`` on both backends (fresh copies of the same inputs each) and compare every output of
    ``ops`` (default: all four) that both provide.

    Raises:
        whatever either backend raises (the caller reports it: a baseline that raises where the
        candidate returned is a divergence).
    """
    ops = tuple(op for op in (ops or ("gather", "scatter", "write_kv", "paged_attention"))
                if callable(getattr(candidate, op, None)) and callable(getattr(baseline, op, None)))
    c, b = run_outputs(candidate, case, device, ops), run_outputs(baseline, case, device, ops)
    drift = Drift(compared=list(ops))
    for key in c:
        if key == "paged_attention":
            drift.ulp, drift.rel, drift.where = attention_drift(case, c[key], b[key])
            continue
        if c[key].shape != b[key].shape or c[key].dtype != b[key].dtype:
            drift.diverged.append(f"{key}: candidate {tuple(c[key].shape)} {c[key].dtype}, baseline "
                                  f"{tuple(b[key].shape)} {b[key].dtype}")
            continue
        index = first_difference(c[key], b[key], row_dims=1 if key.startswith("gather") else 2)
        if index is not None:
            place = f"position {index[0]}" if key.startswith("gather") else f"block {index[0]}, offset {index[1]}"
            cand, base = (x[key][index].flatten()[:4].tolist() for x in (c, b))
            drift.diverged.append(f"{key} differs bit for bit at {place}: candidate {cand}, baseline {base}")
    return drift


def judge(drift: Drift, *, exact: bool = False, max_ulp: int | None = None) -> str | None:
    """Why ``drift`` fails the gate, or ``None``: any data-movement divergence; with ``exact`` any attention
    drift; with ``max_ulp`` attention drift past that many ulp (NaN against a number always)."""
    if drift.diverged:
        return "data movement differs from the baseline: " + "; ".join(drift.diverged)
    if exact and drift.ulp > 0:
        return f"declared bit-exact with the baseline, but {drift.describe()}"
    if drift.ulp >= NAN_ULP or (max_ulp is not None and drift.ulp > max_ulp):
        return f"drift past {max_ulp} ulp: {drift.describe()}"
    return None


@dataclass
class PropertyDrift:
    """Per property (and candidate): examples compared, examples skipped (outside the baseline's declared space), the
    worst drift and its case (``Case.to_dict()``)."""

    check: str = ""
    backend: str = ""
    examples: int = 0
    skipped: int = 0
    ulp: int = 0
    rel: float = 0.0
    attention: bool = False
    worst: dict | None = None  # asdict(Drift)
    case: dict | None = None

    def worse_than(self, other: PropertyDrift) -> bool:
        return (self.ulp, self.rel) > (other.ulp, other.rel)


class DriftLog:
    """The worst drift per property across the examples of a run (and across processes: :meth:`merge`)."""

    def __init__(self) -> None:
        self.props: dict[str, PropertyDrift] = {}

    def add(self, prop: str, drift: Drift, case: Any, *, check: str = "", backend: str = "") -> None:
        """Count one compared example under the key ``prop``; keep it when it is the worst so far (``check``:
        the property's name, ``backend``: the candidate's spec, for the case file)."""
        p = self.props.setdefault(prop, PropertyDrift(check=check or prop, backend=backend))
        p.examples += 1
        p.attention = p.attention or "paged_attention" in drift.compared
        if p.case is None or (drift.ulp, drift.rel) > (p.ulp, p.rel) or (drift.diverged and not p.worst["diverged"]):
            p.ulp, p.rel, p.worst, p.case = drift.ulp, drift.rel, asdict(drift), case.to_dict()

    def skip(self, prop: str) -> None:
        """Count one example of ``prop`` the baseline could not be compared on."""
        self.props.setdefault(prop, PropertyDrift()).skipped += 1

    def merge(self, other: DriftLog) -> None:
        for name, q in other.props.items():
            p = self.props.setdefault(name, PropertyDrift(check=q.check, backend=q.backend))
            keep = q if p.case is None or (q.case is not None and q.worse_than(p)) else p
            p.ulp, p.rel, p.worst, p.case = keep.ulp, keep.rel, keep.worst, keep.case
            p.examples += q.examples
            p.skipped += q.skipped
            p.attention = p.attention or q.attention

    def to_json(self) -> str:
        return json.dumps({name: asdict(p) for name, p in self.props.items()})

    @classmethod
    def from_json(cls, text: str) -> DriftLog:
        log = cls()
        log.props = {name: PropertyDrift(**p) for name, p in json.loads(text).items()}
        return log

    def table(self) -> list[str]:
        """The drift table: one row per property (max ulp, max relative difference, examples)."""
        rows = [("property", "max ulp", "max rel diff", "examples", "worst at")]
        for name, p in sorted(self.props.items()):
            worst = Drift(**p.worst) if p.worst else Drift()
            at = "diverged" if worst.diverged else (
                f"seq {worst.where['seq']} pos {worst.where['position']} head {worst.where['query_head']}"
                if worst.where else "-")
            rows.append((name, _ulp(p.ulp) if p.attention else "exact" if not worst.diverged else "diverged",
                         f"{p.rel:.3g}" if p.attention else "-",
                         f"{p.examples}" + (f" (+{p.skipped} skipped)" if p.skipped else ""), at))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) if i < 4 else cell
                          for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
