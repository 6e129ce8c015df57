"""The case-file schema: types, ranges, consistency and the memory budget of a record, checked before
anything is imported or allocated (see :mod:`pagedkv.testing.casefiles.reading` for the order of the checks).

Every problem is a :class:`~pagedkv.errors.CaseFileError` whose ``field`` is the path of the offending
field (``case.seqs[0].seq_len``).
"""

from __future__ import annotations

import json
import math
import os
import re
import unicodedata
from typing import Any

from pagedkv.backends import BUILTIN
from pagedkv.backends.capabilities import DTYPE_NAMES
from pagedkv.cache.config import dtype_from_name
from pagedkv.errors import CaseFileError
from pagedkv.testing.cases.case import KV_CACHE_DTYPES as _KV_CACHE_DTYPES, ALL_LAYOUTS, POISONS, VALUE_PATTERNS
from pagedkv.testing.cases.invalid_call import OPS as _INVALID_OPS

#: The format version :func:`pagedkv.testing.casefiles.reading.save_failure` writes; files without one are version 1.
FORMAT_VERSION = 1
#: Largest case file read (bytes); a real one is a few KiB, the largest committed one about 30 KiB.
MAX_FILE_BYTES = 1 << 20
#: Deepest JSON nesting accepted (a record is at most 6 levels deep).
MAX_DEPTH = 16
#: The default budget is physical memory divided by this.
BUDGET_DIVISOR = 4
#: Copies of the two pools a check holds at once (the case's pools, an expected copy, a transformed
#: or second backend's copy): the budget counts the pools this many times.
POOL_COPIES = 4
#: Bytes counted per element of the per-token tensors (float64 references and their copies).
TOKEN_BYTES = 32
#: Most positions (sum of ``seq_len``) a case may hold: the reference reads them one by one.
MAX_POSITIONS = 1 << 20

# The names a record may use come from where they are defined (one source each); the schema only reads them.
DTYPE_BYTES = {name: dtype_from_name(name).itemsize for name in sorted(DTYPE_NAMES)}
KINDS = ("Case", "CacheScenario", "InvalidCall", "LimitCase")
TABLE_DTYPES = {"int32": 2**31, "int64": 2**63}  # name -> bound of |pad_value|
INVALID_OPS = _INVALID_OPS
KV_CACHE_DTYPES = tuple(_KV_CACHE_DTYPES)
SCENARIO_OPS = {"add": (3, 4), "append": (3, 3), "reserve": (3, 4), "write": (2, 3), "fork": (3, 3), "free": (2, 2)}
BUILTIN_BACKENDS = BUILTIN
MUTANTS_MODULE = "pagedkv.tools.mutants"  # any shipped mutant: pagedkv.tools.mutants:NAME
PEERS_MODULE = "pagedkv.tools.peers"

_MAX_ID = 2**31  # sequence ids and token ids in scenarios
_MAX_SIZE = 2**40  # any size or length before the budget has its say
_MAX_SEED = 2**44  # seed * 1_000_003 + stream must fit torch's 64-bit seed
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")

_RECORD_KEYS = {"version": False, "id": False, "title": False, "check": True, "backend": False, "other": False,
                "kind": False, "case": True, "outcome": False, "error": False, "history": False,
                "calls_before": False, "history_calls": False}
#: Most earlier cases a record's ``history`` may hold (the suite writes at most 16).
MAX_HISTORY = 64
OUTCOMES = ("running", "failed", "raised", "crashed")  # save_failure's outcome: written before the call, after it
_GEOMETRY_KEYS = ("num_blocks", "block_size", "num_kv_heads", "head_dim", "num_queries_per_kv", "dtype", "head_dim_v")
_SEQ_KEYS = ("block_table", "seq_len", "q_len", "start")
_CASE_KEYS = ("geometry", "seqs", "values", "poison", "pad_value", "pad_columns", "table_dtype", "layout", "scale",
              "seed", "window_left", "softcap", "alibi", "sinks", "kv_cache_dtype", "k_scale", "v_scale",
              "num_splits", "cuts")
_CASE_REQUIRED = _CASE_KEYS[:10]  # the feature fields are optional (off in files written before them)
_SCENARIO_KEYS = ("geometry", "ops", "enable_prefix_caching", "constant_hash", "seed", "num_layers")
_INVALID_KEYS = ("op", "fault", "case", "seq", "amount")


# -- the memory budget ----------------------------------------------------------------------------------
def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``os.sysconf``), or ``None`` where it cannot be read."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def default_max_bytes() -> int:
    """The default memory budget of a case: physical memory / :data:`BUDGET_DIVISOR` (4 GiB where the
    physical memory cannot be read)."""
    total = physical_memory_bytes()
    return total // BUDGET_DIVISOR if total else 4 << 30


def parse_bytes(text: str) -> int:
    """A positive byte count from the command line (``--max-bytes``): :func:`pagedkv.units.parse_bytes`'s rule
    (``512M`` and ``8GiB`` binary, ``80GB`` decimal).

    Raises:
        ValueError: not a positive size.
    """
    from pagedkv.units import parse_bytes as parse

    value = parse(text, "byte count")
    if value < 1:
        raise ValueError(f"a byte count must be positive, got {text!r}")
    return value


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def estimate_bytes(record: dict) -> tuple[int, int]:
    """``(pool_bytes, total_bytes)`` a validated record's case needs on the host.

    ``pool_bytes`` is the two pools of the geometry (``num_blocks * block_size * num_kv_heads *
    head_dim * bytes * 2``, one layer); ``total_bytes`` counts them :data:`POOL_COPIES` times and adds
    :data:`TOKEN_BYTES` per element of the per-token tensors (K/V rows of every position, queries,
    attention scores; for a scenario, the K/V rows of every token it writes).

    Args:
        record: a record :func:`validate_record` accepted (``case`` still plain data).
    """
    case = record["case"]["case"] if record["kind"] == "InvalidCall" else record["case"]
    g = case["geometry"]
    if record["kind"] == "LimitCase":  # lazily backed pools (cases/limit.py): a few pages, whatever their size
        return 0, TOKEN_BYTES * 64 * g["num_kv_heads"] * g["num_queries_per_kv"] * g["head_dim"]
    item = DTYPE_BYTES[g["dtype"]]
    row = g["num_kv_heads"] * g["head_dim"]
    q_heads = g["num_kv_heads"] * g["num_queries_per_kv"]
    pools = 2 * g["num_blocks"] * g["block_size"] * row * item
    if record["kind"] == "CacheScenario":
        layers = case.get("num_layers", 1)
        pools *= layers
        tokens = sum(len(op[2]) for op in case["ops"] if op[0] in ("add", "append", "reserve"))
        elements = 2 * tokens * row * layers + len(case["ops"]) * q_heads * g["head_dim"]
    else:
        seqs = case["seqs"]
        positions = sum(s["seq_len"] for s in seqs)
        queries = sum(s["q_len"] for s in seqs)
        scores = sum(s["q_len"] * s["seq_len"] for s in seqs) * q_heads
        elements = 2 * positions * row + queries * q_heads * g["head_dim"] + scores
    return pools, POOL_COPIES * pools + TOKEN_BYTES * elements


# -- the schema -------------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return f"{json.dumps(value)} ({'boolean' if isinstance(value, bool) else 'null'})"
    if isinstance(value, int):
        return f"{value}" if abs(value) < 10**15 else f"an integer of {value.bit_length()} bits"
    kind = {str: "string", float: "number", list: "array", dict: "object"}.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, (list, dict)) else ""
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})".lstrip()


def _join(path: str, key: str) -> str:
    name = key if _IDENT.fullmatch(key) else repr(key)
    return f"{path}.{name}" if path else name


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CaseFileError(path, f"expected an integer, got {_show(value)}")
    if value < lo:
        raise CaseFileError(path, f"must be >= {lo}, got {_show(value)}")
    if value >= hi:
        raise CaseFileError(path, f"must be < {hi if hi < 10**6 else f'2**{hi.bit_length() - 1}'}, got {_show(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise CaseFileError(path, f"expected true or false, got {_show(value)}")
    return value


def _text(value: Any, path: str, max_len: int, *, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise CaseFileError(path, f"expected a string{' or null' if nullable else ''}, got {_show(value)}")
    if len(value) > max_len:
        raise CaseFileError(path, f"{len(value)} characters, more than {max_len}")
    for ch in value:
        if ch != "\t" and unicodedata.category(ch) in ("Cc", "Cf", "Cs"):
            raise CaseFileError(path, f"contains the control character U+{ord(ch):04X} (terminal escapes and "
                                      f"invisible characters are refused)")
    return value


def _choice(value: Any, path: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise CaseFileError(path, f"must be one of {', '.join(map(str, choices))}; got {_show(value)}")
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise CaseFileError(path, f"expected an array, got {_show(value)}")
    return value


def _object(value: Any, path: str, keys, required=None) -> dict:
    """``value`` as a dict with no keys outside ``keys`` and every key of ``required`` (default: all)."""
    if not isinstance(value, dict):
        raise CaseFileError(path or "(record)", f"expected an object, got {_show(value)}")
    for key in value:
        if key not in keys:
            raise CaseFileError(_join(path, key), f"unknown field (known: {', '.join(keys)})")
    for key in (keys if required is None else required):
        if key not in value:
            raise CaseFileError(_join(path, key), "required field missing")
    return value


def _geometry(value: Any, path: str) -> dict:
    g = _object(value, path, _GEOMETRY_KEYS, _GEOMETRY_KEYS[:6])
    if g.get("head_dim_v") is not None:
        _int(g["head_dim_v"], f"{path}.head_dim_v", 1, _MAX_SIZE)
    for key in _GEOMETRY_KEYS[:5]:
        _int(g[key], f"{path}.{key}", 1, _MAX_SIZE)
    _choice(g["dtype"], f"{path}.dtype", tuple(DTYPE_BYTES))
    return g


def _number(value: Any, path: str, lo: float, *, above: bool = False) -> float:
    """A finite JSON number ``>= lo`` (``> lo`` with ``above``), at most 1e30 in size."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or abs(value) > 1e30:
        raise CaseFileError(path, f"expected a finite number, got {_show(value)}")
    if value < lo or above and value == lo:
        raise CaseFileError(path, f"must be {'>' if above else '>='} {lo}, got {_show(value)}")
    return value


def _features(c: dict, path: str, num_kv_heads: int) -> None:
    """The optional attention features of a case (absent: off)."""
    if "window_left" in c:
        _int(c["window_left"], f"{path}.window_left", -1, _MAX_SIZE)
    if "softcap" in c:
        _number(c["softcap"], f"{path}.softcap", 0.0)
    for key in ("alibi", "sinks"):
        if key in c:
            _bool(c[key], f"{path}.{key}")
    if "kv_cache_dtype" in c:
        _choice(c["kv_cache_dtype"], f"{path}.kv_cache_dtype", KV_CACHE_DTYPES)
    if c.get("num_splits") is not None:
        _int(c["num_splits"], f"{path}.num_splits", 1, 65536)
    per_head = [len(c[key]) for key in ("k_scale", "v_scale") if isinstance(c.get(key), list)]
    if len(per_head) == 2 and per_head[0] == per_head[1] != num_kv_heads:  # two witnesses against the geometry
        raise CaseFileError(f"{path}.geometry.num_kv_heads", f"{num_kv_heads}, but k_scale and v_scale both hold "
                                                             f"{per_head[0]} per-head scales")
    for key in ("k_scale", "v_scale"):
        if key not in c:
            continue
        if not isinstance(c[key], list):
            _number(c[key], f"{path}.{key}", 0.0, above=True)
            continue
        if len(c[key]) != num_kv_heads:
            raise CaseFileError(f"{path}.{key}", f"{len(c[key])} scales, but num_kv_heads is {num_kv_heads} (one "
                                                 f"per kv head; a per-tensor scale is a number)")
        for j, x in enumerate(c[key]):
            _number(x, f"{path}.{key}[{j}]", 0.0, above=True)


def _case(value: Any, path: str) -> dict:
    c = _object(value, path, _CASE_KEYS, _CASE_REQUIRED)
    g = _geometry(c["geometry"], f"{path}.geometry")
    _choice(c["values"], f"{path}.values", VALUE_PATTERNS)
    _choice(c["poison"], f"{path}.poison", POISONS)
    table_dtype = _choice(c["table_dtype"], f"{path}.table_dtype", tuple(TABLE_DTYPES))
    bound = TABLE_DTYPES[table_dtype]
    _int(c["pad_value"], f"{path}.pad_value", -bound, bound)
    _int(c["pad_columns"], f"{path}.pad_columns", 0, 65)
    _choice(c["layout"], f"{path}.layout", ALL_LAYOUTS)
    for j, cuts in enumerate(_list(c.get("cuts", []), f"{path}.cuts")):
        for k, x in enumerate(_list(cuts, f"{path}.cuts[{j}]")):
            _int(x, f"{path}.cuts[{j}][{k}]", 0, _MAX_SIZE)
    scale = c["scale"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or abs(scale) > 1e30):
        raise CaseFileError(f"{path}.scale", f"expected null or a finite number, got {_show(scale)}")
    _int(c["seed"], f"{path}.seed", 0, _MAX_SEED)
    _features(c, path, g["num_kv_heads"])
    bs, positions = g["block_size"], 0
    for i, s in enumerate(_list(c["seqs"], f"{path}.seqs")):
        p = f"{path}.seqs[{i}]"
        _object(s, p, _SEQ_KEYS)
        seq_len = _int(s["seq_len"], f"{p}.seq_len", 0, _MAX_SIZE)
        q_len = _int(s["q_len"], f"{p}.q_len", 0, _MAX_SIZE)
        start = _int(s["start"], f"{p}.start", 0, _MAX_SIZE)
        table = _list(s["block_table"], f"{p}.block_table")
        for j, b in enumerate(table):
            _int(b, f"{p}.block_table[{j}]", 0, g["num_blocks"])
        need = -(-seq_len // bs)
        if len(table) < need:
            raise CaseFileError(f"{p}.block_table", f"{len(table)} entries, but seq_len {seq_len} ({p}.seq_len) "
                                                    f"needs {need} blocks of block_size {bs}")
        if q_len > seq_len:
            raise CaseFileError(f"{p}.q_len", f"{q_len} query tokens, more than seq_len {seq_len} (the queries are "
                                              f"the last q_len positions)")
        if start > seq_len:
            raise CaseFileError(f"{p}.start", f"scatter start {start} lies past seq_len {seq_len}")
        positions += seq_len
    if positions > MAX_POSITIONS:
        raise CaseFileError(f"{path}.seqs", f"{positions} positions in all, more than the {MAX_POSITIONS} a case "
                                            f"file may hold (the reference reads them one by one)")
    return c


def _cache_key(value: Any, path: str) -> None:
    if value is None or isinstance(value, str) and _text(value, path, 100):
        return
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return
    raise CaseFileError(path, f"a cache_key is null, an integer or a short string; got {_show(value)}")


def _tokens(value: Any, path: str) -> int:
    for j, t in enumerate(_list(value, path)):
        _int(t, f"{path}[{j}]", 0, _MAX_ID)
    return len(value)


def _scenario_op(op: Any, p: str) -> int:
    """Check one scenario operation; returns the number of tokens it brings."""
    _list(op, p)
    if not op:
        raise CaseFileError(p, "an empty operation (expected [kind, seq_id, ...])")
    kind = _choice(op[0], f"{p}[0]", tuple(SCENARIO_OPS))
    lo, hi = SCENARIO_OPS[kind]
    if not lo <= len(op) <= hi:
        raise CaseFileError(p, f"a {kind!r} operation has {lo if lo == hi else f'{lo} to {hi}'} items, got {len(op)}")
    _int(op[1], f"{p}[1]", 0, _MAX_ID)
    if kind == "fork":
        _int(op[2], f"{p}[2]", 0, _MAX_ID)
    elif kind == "write" and len(op) > 2 and op[2] is not None:
        _int(op[2], f"{p}[2]", 0, _MAX_SIZE)
    elif kind in ("add", "append", "reserve"):
        if len(op) > 3:
            _cache_key(op[3], f"{p}[3]")
        return _tokens(op[2], f"{p}[2]")
    return 0


def _scenario(value: Any, path: str) -> dict:
    c = _object(value, path, _SCENARIO_KEYS, _SCENARIO_KEYS[:-1])  # num_layers: 1 in files written before it
    _geometry(c["geometry"], f"{path}.geometry")
    _bool(c["enable_prefix_caching"], f"{path}.enable_prefix_caching")
    _bool(c["constant_hash"], f"{path}.constant_hash")
    _int(c["seed"], f"{path}.seed", 0, _MAX_SEED)
    if "num_layers" in c:
        _int(c["num_layers"], f"{path}.num_layers", 1, 1025)
    tokens = sum(_scenario_op(op, f"{path}.ops[{i}]") for i, op in enumerate(_list(c["ops"], f"{path}.ops")))
    if tokens > MAX_POSITIONS:
        raise CaseFileError(f"{path}.ops", f"{tokens} tokens in all, more than the {MAX_POSITIONS} a case file may "
                                           f"hold")
    return c


def _limit_case(value: Any, path: str) -> dict:
    from pagedkv.testing.cases.limit import ALIASED_LIMIT, LIMITS

    c = _object(value, path, ("limit", "geometry", "latent"), ("limit", "geometry"))
    _choice(c["limit"], f"{path}.limit", (*LIMITS, ALIASED_LIMIT))
    if not isinstance(c.get("latent", False), bool):
        raise CaseFileError(f"{path}.latent", f"expected true or false, got {_show(c['latent'])}")
    c["geometry"] = _geometry(c["geometry"], f"{path}.geometry")
    return c


def _invalid_call(value: Any, path: str) -> dict:
    c = _object(value, path, _INVALID_KEYS)
    op = _choice(c["op"], f"{path}.op", INVALID_OPS)
    from pagedkv.testing.cases.invalid_call import FAULTS  # pagedkv's own table of fault names

    _choice(c["fault"], f"{path}.fault", sorted(name for o, name in FAULTS if o == op))
    case = _case(c["case"], f"{path}.case")
    n = len(case["seqs"])
    if n == 0:
        raise CaseFileError(f"{path}.case.seqs", "an invalid call needs at least one sequence to plant its fault in")
    _int(c["seq"], f"{path}.seq", 0, n)
    _int(c["amount"], f"{path}.amount", 0, _MAX_SIZE)
    return c


def _earlier(h: object, where: str, check: str, kind: str) -> dict:
    """One ``history`` entry as ``{"check", "kind", "case"}``: written so (any property's case), or a bare case
    of the record's own property (files written before entries named theirs)."""
    checkers = {"Case": _case, "CacheScenario": _scenario, "InvalidCall": _invalid_call, "LimitCase": _limit_case}
    if isinstance(h, dict) and "check" in h:
        e = _object(h, where, ("check", "kind", "case"), ["check", "kind", "case"])
        name = _text(e["check"], f"{where}.check", 200)
        if not _IDENT.fullmatch(name):
            raise CaseFileError(f"{where}.check", f"not a property name: {name!r}")
        own = _choice(e["kind"], f"{where}.kind", KINDS)
        return {"check": name, "kind": own, "case": checkers[own](e["case"], f"{where}.case")}
    return {"check": check, "kind": kind, "case": checkers[kind](h, where)}


def validate_record(data: object, *, max_bytes: int | None = None) -> dict:
    """Check a parsed case file against the schema, the consistency rules and the memory budget.

    Nothing is imported (but pagedkv's own table of invalid-call faults) and nothing is allocated.
    Backend specs are checked for form only; whether a file may name them is
    :func:`require_trusted_backends`.

    Args:
        data: the JSON value of the file.
        max_bytes: the memory budget of the case (see :func:`estimate_bytes`); ``None``:
            :func:`default_max_bytes`.

    Returns:
        A normalized copy of the record, ``case`` still plain data: ``version`` (1 when absent),
        ``kind`` (``"Case"`` when absent), ``backend`` (``"indexed"`` when absent or null),
        ``other`` (``None`` when absent), ``error`` (``""`` when absent), ``id``,
        ``title``, ``outcome`` and ``history`` (the cases run before the failing one, oldest first) when
        present.

    Raises:
        CaseFileError: the first problem found; ``field`` is its path (``case.seqs[0].seq_len``) and
            the message says what was expected.
    """
    r = _object(data, "", tuple(_RECORD_KEYS), [k for k, required in _RECORD_KEYS.items() if required])
    out: dict[str, Any] = {"version": FORMAT_VERSION}
    if "version" in r:
        version = _int(r["version"], "version", 1, 2**31)
        if version > FORMAT_VERSION:
            raise CaseFileError("version", f"format version {version} is newer than this pagedkv reads "
                                           f"({FORMAT_VERSION}); upgrade pagedkv")
    for key, max_len in (("id", 100), ("title", 1000)):
        if key in r:
            out[key] = _text(r[key], key, max_len)
    if "outcome" in r:
        out["outcome"] = _choice(r["outcome"], "outcome", OUTCOMES)
    out["error"] = _text(r.get("error", ""), "error", 10_000, nullable=True) or ""
    check = _text(r["check"], "check", 200)
    if not _IDENT.fullmatch(check):
        raise CaseFileError("check", f"not a property name: {check!r}")
    out["check"] = check
    kind = _choice(r.get("kind", "Case"), "kind", KINDS)
    out["kind"] = kind
    out["backend"] = _text(r.get("backend"), "backend", 500, nullable=True) or "indexed"
    out["other"] = _text(r.get("other"), "other", 500, nullable=True)
    out["case"] = {"Case": _case, "CacheScenario": _scenario, "InvalidCall": _invalid_call,
                   "LimitCase": _limit_case}[kind](r["case"], "case")
    budget = default_max_bytes() if max_bytes is None else max_bytes
    if "history" in r:  # the cases run before the failing one, oldest first (each within the budget too)
        history = _list(r["history"], "history")
        if len(history) > MAX_HISTORY:
            raise CaseFileError("history", f"{len(history)} earlier cases, more than {MAX_HISTORY}")
        out["history"] = [_earlier(h, f"history[{i}]", check, kind) for i, h in enumerate(history)]
        for i, h in enumerate(out["history"]):
            if estimate_bytes(h)[1] > budget:
                raise CaseFileError(f"history[{i}]", f"the case needs more than the memory budget of {_human(budget)}")
    for key in ("calls_before", "history_calls"):  # the process's op calls before the failing case
        if key in r:
            out[key] = _int(r[key], key, 0, 2**62)
    pools, total = estimate_bytes(out)
    if total > budget:
        geometry = "case.case.geometry" if kind == "InvalidCall" else "case.geometry"
        g = out["case"]["case"]["geometry"] if kind == "InvalidCall" else out["case"]["geometry"]
        layers = f" x {out['case']['num_layers']} layers" if "num_layers" in out["case"] else ""
        where = geometry if POOL_COPIES * pools > budget else "case.ops" if kind == "CacheScenario" else \
            geometry.replace("geometry", "seqs")
        raise CaseFileError(where, f"the case needs about {_human(total)} ({POOL_COPIES} copies of pools of "
                                   f"{g['num_blocks']} blocks x {g['block_size']} slots x {g['num_kv_heads']} kv heads"
                                   f" x "
                                   f"{g['head_dim']} head_dim x {DTYPE_BYTES[g['dtype']]} bytes x 2 pools"
                                   f"{layers} = {_human(pools)}, "
                                   f"plus per-token tensors), over the memory budget of {_human(budget)}"
                                   + (" (a quarter of this machine's memory)" if max_bytes is None else "")
                                   + "; refused before allocating anything (raise the budget with --max-bytes N)")
    return out

