"""Manager-program case files as untrusted input: the kind tag (readable without importing torch or
Hypothesis, so ``python -m pagedkv replay`` can dispatch before loading anything) and the defences a
kernel case file has (:mod:`pagedkv.testing.casefiles.reading`), in the same order, before anything is
imported or allocated:

1. the bytes: at most :data:`~pagedkv.testing.casefiles.schema.MAX_FILE_BYTES`, UTF-8, nested at most
   :data:`~pagedkv.testing.casefiles.schema.MAX_DEPTH` deep, no key twice in one object, JSON;
2. the schema (:func:`validate_program`): the fields, their types and ranges, at most
   :data:`MAX_STEPS` steps of ``[rule name, arguments]``;
3. the memory budget: the pools the program's ``start`` steps ask for and the tokens it writes, within
   ``max_bytes`` (default a quarter of physical memory, as for kernel cases);
4. the trust rule: the manager a file names is loaded on its word only when a kernel case file could
   name it (a built-in backend, a shipped mutant, cheat or peer:
   :func:`~pagedkv.testing.casefiles.reading.canonical_backend_spec`) or it is one of pagedkv's own
   managers (:data:`SHIPPED_MANAGERS`, the planted faults of :data:`PLANTED_MANAGERS`); any other
   spec runs only when named with ``--impl``.

Each refusal is a :class:`~pagedkv.errors.CaseFileError` naming the field.
"""

from __future__ import annotations

import re
from typing import Any

KIND = "pagedkv-manager-program"
#: Most steps a program file may hold.
MAX_STEPS = 10_000
#: pagedkv's own cache managers a program file may name (the manager mutants of
#: :mod:`pagedkv.tools.mutants.managers` and the library's own cache), besides what a kernel case file may.
SHIPPED_MANAGERS = ("pagedkv.testing.managers.own",
                    "pagedkv.tools.mutants.managers:frees_shared_blocks",
                    "pagedkv.tools.mutants.managers:frees_shared_blocks_unchecked")
#: Host bytes one slot of a manager's pools costs the machine and its oracle (a block id, hash and
#: reference count per block, a token record per slot): generous, so the budget refuses early.
SLOT_BYTES = 256
#: Host bytes per integer a program writes (token ids, sizes).
ITEM_BYTES = 64
_KEYS = {"kind": True, "version": True, "manager": True, "block_sizes": True, "windows": True, "steps": True,
         "error": False, "test_id": False, "examples": False, "first_failing_example": False, "layouts": False}
_RULE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_ARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_INT = 2**31
_MAX_TEXT = 200


def is_program_file(path: str) -> bool:
    """Whether ``path`` is a manager-program case file (reads only its first 4 KiB)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return f'"kind": "{KIND}"'.encode() in head


def _error(field: str, reason: str) -> Exception:
    from pagedkv.errors import CaseFileError

    return CaseFileError(field, reason)


def _value(value: Any, path: str, counted: list) -> None:
    """An argument value: an int within +-2**31, a bool, None, a short string, or a list of those."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if not -_MAX_INT <= value <= _MAX_INT:
            raise _error(path, f"{value} is outside [-2**31, 2**31]")
        counted[0] += 1
        return
    if isinstance(value, str):
        if len(value) > _MAX_TEXT:
            raise _error(path, f"a string of {len(value)} characters (at most {_MAX_TEXT})")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _value(item, f"{path}[{i}]", counted)
        counted[0] += 1
        return
    raise _error(path, f"{type(value).__name__} is not an argument value (int, bool, null, string or list)")


def _int_list(value: Any, path: str, lo: int, hi: int, *, nullable: bool = False) -> list:
    if not isinstance(value, list) or not 1 <= len(value) <= 16:
        raise _error(path, "a list of 1 to 16 entries")
    for i, item in enumerate(value):
        if item is None and nullable:
            continue
        if isinstance(item, bool) or not isinstance(item, int) or not lo <= item <= hi:
            raise _error(f"{path}[{i}]", f"an int in [{lo}, {hi}]" + (" or null" if nullable else "")
                         + f", got {item!r}")
    return value


def validate_program(data: Any, *, max_bytes: int | None = None) -> dict:
    """Check a parsed program file: its fields, types and ranges, and its memory budget.

    Raises:
        CaseFileError: the field that is wrong and why; ``budget`` when the program needs more than
            ``max_bytes`` (default :func:`pagedkv.testing.casefiles.schema.default_max_bytes`).
    """
    if not isinstance(data, dict):
        raise _error("file", "a manager program is a JSON object")
    unknown = sorted(set(data) - set(_KEYS))
    missing = sorted(k for k, required in _KEYS.items() if required and k not in data)
    if unknown or missing:
        raise _error("file", f"unknown fields {unknown}" if unknown else f"missing fields {missing}")
    if data["kind"] != KIND or data["version"] != 1:
        raise _error("kind", f"must be {KIND!r} version 1")
    if not isinstance(data["manager"], str) or not 0 < len(data["manager"]) <= _MAX_TEXT:
        raise _error("manager", f"a spec of 1 to {_MAX_TEXT} characters")
    for key in ("error", "test_id"):
        if not isinstance(data.get(key, ""), str) or len(data.get(key, "")) > 4096:
            raise _error(key, "a string of at most 4096 characters")
    layouts = data.get("layouts", [])
    if not isinstance(layouts, list) or len(layouts) > 16 or not all(
            isinstance(x, str) and _ARG.fullmatch(x.replace("-", "_")) for x in layouts):
        raise _error("layouts", "a list of at most 16 layout names")
    block_sizes = _int_list(data["block_sizes"], "block_sizes", 1, 1 << 12)
    _int_list(data["windows"], "windows", 0, 1 << 20, nullable=True)
    steps = data["steps"]
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise _error("steps", f"a list of at most {MAX_STEPS} steps")
    counted, slots = [0], 0
    for i, step in enumerate(steps):
        where = f"steps[{i}]"
        if not (isinstance(step, list) and len(step) == 2 and isinstance(step[0], str)
                and _RULE.fullmatch(step[0]) and isinstance(step[1], dict)):
            raise _error(where, "a [rule name, {argument: value}] pair")
        for name, value in step[1].items():
            if not _ARG.fullmatch(name):
                raise _error(where, f"argument name {name[:64]!r} is not an identifier")
            _value(value, f"{where}.{name}", counted)
        if step[0] == "start":  # the pools: blocks of the largest block size, per layer
            args = step[1]
            blocks, layers = args.get("num_blocks", 0), args.get("num_layers", 1)
            if isinstance(blocks, int) and isinstance(layers, int):
                slots += max(blocks, 0) * max(block_sizes) * max(layers, 1)
    from pagedkv.testing.casefiles.schema import _human, default_max_bytes

    need, budget = SLOT_BYTES * slots + ITEM_BYTES * counted[0], max_bytes or default_max_bytes()
    if need > budget:
        raise _error("budget", f"the program needs about {_human(need)} on the host, more than the budget "
                               f"{_human(budget)} (--max-bytes raises it)")
    return data


#: pagedkv's module of planted hybrid-manager faults and the mapping of the names it ships.
HYBRID_MUTANTS = ("pagedkv.tools.mutants.hybrid_managers", "HYBRID_MANAGER_MUTANTS")
#: Every module of planted manager faults a program file may name (``module:name``), with its mapping:
#: the hybrid managers', pagedkv's faulty hybrid caches gated as managers, faulty KV-event adapters.
PLANTED_MANAGERS = (HYBRID_MUTANTS, ("pagedkv.tools.mutants.caches", "HYBRID_CACHE_MUTANTS"),
                    ("pagedkv.tools.mutants.event_adapters", "EVENT_ADAPTER_MUTANTS"))


def trusted_manager_spec(spec: object) -> bool:
    """Whether a program file may name ``spec`` as the manager to load (module docstring, point 4)."""
    import importlib

    from pagedkv.testing.casefiles.reading import canonical_backend_spec

    if spec in SHIPPED_MANAGERS or canonical_backend_spec(spec) is not None:
        return True
    module, _, name = str(spec).partition(":")
    mapping = dict(PLANTED_MANAGERS).get(module)
    if mapping is None:
        return False
    try:  # a fixed module of pagedkv's own, where this version has it
        return name in getattr(importlib.import_module(module), mapping, {})
    except ImportError:
        return False


def load_program_file(path: str, *, max_bytes: int | None = None, impl: str | None = None) -> dict:
    """Read, check and return a program file (module docstring: bytes, schema, budget, trust), with
    ``manager`` the spec to load (``impl`` when given: the caller's choice, not checked).

    Raises:
        CaseFileError: the first defence the file fails, naming the field.
    """
    from pagedkv.testing.casefiles.reading import parse_case_bytes, read_case_bytes

    data = validate_program(parse_case_bytes(read_case_bytes(path)), max_bytes=max_bytes)
    if impl is not None:
        return {**data, "manager": impl, "recorded_manager": data["manager"]}
    if not trusted_manager_spec(data["manager"]):
        raise _error("manager", f"{data['manager']!r} is not a manager a case file may name (a built-in backend, "
                                f"a shipped mutant or peer, or pagedkv's own cache); to run it, name it yourself: "
                                f"--impl {data['manager']}")
    return data
