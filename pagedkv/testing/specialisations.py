"""The kernel specialisations a run needed, per op: what a GPU run compiles.

Each example the suite runs is recorded under the ops its property calls, keyed by the declared
specialising parameters (``Capabilities.specialize_on``; all of them when none is declared):
``paged_attention`` by block_size, head_dim, GQA group, dtype and feature set (fp8 with its format);
the copies (``gather``, ``scatter``, ``write_kv``) by block_size, head_dim, dtype and fp8 format.
xdist workers each write what they saw to the run's shared directory at the end of their session;
the controller's terminal summary counts the union.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

_ATTENTION = ("paged_attention", "paged_attention_csr")
_SEEN: dict[str, set] = defaultdict(set)


def geometry_of(case: Any):
    """The :class:`~pagedkv.testing.cases.case.Geometry` of a case, an invalid call's case or a limit
    case; ``None`` for anything else (a scenario, a state machine)."""
    for candidate in (case, getattr(case, "case", None)):
        geometry = getattr(candidate, "geometry", None)
        if geometry is not None and hasattr(geometry, "block_size"):
            return geometry, candidate
    return None, None


def key_of(op: str, case: Any, names: frozenset) -> tuple | None:
    """The specialisation ``op`` needs for ``case`` under the declared ``names``, or ``None``."""
    geometry, holder = geometry_of(case)
    if geometry is None:
        return None
    fp8 = getattr(holder, "kv_cache_dtype", "auto")
    v_dim = getattr(geometry, "head_dim_v", None)
    if op == "merge_attn_states":  # the merge kernel specialises on V's width and the dtype only
        return tuple((n, v) for n, v in (("head_dim", geometry.v_dim), ("dtype", geometry.dtype)) if n in names)
    # V of its own width is another kernel variant: head_dim "576/512"
    widths = geometry.head_dim if v_dim is None or v_dim == geometry.head_dim else f"{geometry.head_dim}/{v_dim}"
    key = [("block_size", geometry.block_size), ("head_dim", widths)]
    if op in _ATTENTION:
        key.append(("gqa_group", geometry.num_queries_per_kv))
    key.append(("dtype", geometry.dtype))
    if "features" in names:
        features = sorted(getattr(holder, "features", ()) or ()) if op in _ATTENTION else []
        if op in _ATTENTION and getattr(holder, "cuts", ()):  # the partial-attention properties: the LSE variant
            features.append("lse")
        key.append(("features", "+".join(features + ([fp8] if fp8 != "auto" else [])) or "-"))
    return tuple((n, v) for n, v in key if n in names or n == "features")


def in_palette(key: tuple, palette: Any) -> bool:
    """Whether an attention specialisation ``key`` (:func:`key_of`) is one of ``palette``'s: its shape one of
    the palette's shapes (V's width with it) and its feature set one of the palette's (fp8 in either format)."""
    values = dict(key)
    features = frozenset(f for f in values.pop("features", "-").split("+") if f not in ("-", "fp8_e4m3", "fp8_e5m2"))
    if palette.feature_sets and features not in palette.feature_sets:
        return False
    for shape in palette.shapes:
        width = shape.get("head_dim")
        if shape.get("head_dim_v", width) != width:
            width = f"{width}/{shape['head_dim_v']}"
        wanted = {**{n: shape[n] for n in ("block_size", "gqa_group", "dtype") if n in shape},
                  **({"head_dim": width} if "head_dim" in shape else {})}
        if all(values.get(n) == v for n, v in wanted.items()):
            return True
    return not palette.shapes


def record(ops, case: Any, caps: Any) -> None:
    """Note the specialisations ``case`` needs of each op in ``ops`` (this process's tally)."""
    from pagedkv.backends.capabilities import SPECIALIZATION_NAMES

    names = getattr(caps, "specialize_on", None) or SPECIALIZATION_NAMES
    for op in ops:
        key = key_of(op, case, names)
        if key is not None:
            _SEEN[op].add(key)


def seen() -> dict[str, set]:
    """This process's tally: op -> set of specialisation keys."""
    return _SEEN


def write(directory: Path, worker: str) -> Path | None:
    """Write this process's tally to ``directory/<worker>.json`` (``None`` when it saw nothing)."""
    if not _SEEN:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{worker}.json"
    path.write_text(json.dumps({op: sorted(map(list, keys)) for op, keys in _SEEN.items()}))
    return path


def read_all(directory: Path) -> dict[str, set]:
    """The union of every tally written to ``directory`` (with this process's own)."""
    union: dict[str, set] = defaultdict(set)
    for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else ():
        for op, keys in json.loads(path.read_text()).items():
            union[op] |= {tuple(tuple(pair) for pair in key) for key in keys}
    for op, keys in _SEEN.items():
        union[op] |= keys
    return union


def summary_line(tally: dict[str, set]) -> str | None:
    """``pagedkv specialisations: paged_attention 104, gather 31, ...`` (``None`` when empty)."""
    if not tally:
        return None
    ops = sorted(tally, key=lambda op: (op not in _ATTENTION, op))
    seed = os.environ.get("PAGEDKV_PALETTE_SEED")
    return ("pagedkv specialisations the run needed: " + ", ".join(f"{op} {len(tally[op])}" for op in ops)
            + (f" (palette seed {seed})" if seed else ""))
