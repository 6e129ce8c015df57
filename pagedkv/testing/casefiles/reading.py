"""Case files: written when a property fails (or before the backend runs), read as untrusted input.

A case file is plain JSON (written by :func:`save_failure`, committed under
``pagedkv/testing/casefiles/regressions/``, downloaded from a CI artifact or an issue). Whoever hands you one
controls every byte of it, so :func:`load_case_file` reads it in this order and stops at the first
problem with a :class:`~pagedkv.errors.CaseFileError` whose ``field`` is the path of the offending
field (``case.seqs[0].seq_len``; ``file`` for the bytes themselves):

1. **bytes**: at most :data:`MAX_FILE_BYTES` (1 MiB), UTF-8, JSON, nested at most :data:`MAX_DEPTH`
   levels, no key twice in one object;
2. **schema** (:func:`.schema.validate_record`): known keys only, required keys present, every value of
   its type and range (integers are never bools or floats), dtype / pattern / poison / layout /
   table-dtype names from the known sets, text without control characters, scenario operations of
   the right arity, an :class:`~pagedkv.testing.cases.invalid_call.InvalidCall`'s op, fault and sequence, a format
   ``version`` this code reads (a file without one is version 1);
3. **consistency**: every block id inside the pool, each table long enough for its ``seq_len`` at
   the geometry's ``block_size``, ``q_len <= seq_len`` and ``start <= seq_len`` (the query layout
   ``query_start_loc`` is the running sum of the ``q_len``), ``pad_value`` inside the table dtype;
4. **memory budget** (:func:`.schema.estimate_bytes`): the pools the case needs, from the geometry
   (``num_blocks * block_size * num_kv_heads * head_dim * bytes per element * 2`` pools, one layer),
   times :data:`POOL_COPIES` working copies the checks hold at once, plus the per-token tensors
   (K/V rows, queries, attention scores); refused when over ``max_bytes``, by default
   :func:`pagedkv.testing.casefiles.schema.default_max_bytes`: a quarter of this machine's physical memory;
5. **backends** (:func:`require_trusted_backends`): the ``backend`` and ``other`` a file records are
   loaded only when :func:`trusted_backend_spec` accepts them (a built-in name, a shipped mutant or a
   shipped peer); anything else (a module path, a ``.py`` file) must be named by the caller
   (``replay --impl SPEC`` / ``--other SPEC``), never by the file.

Nothing here imports code a file names or builds a tensor; :func:`load_case_file` returns the record
with its ``case`` rebuilt as a :class:`~pagedkv.testing.cases.case.Case`,
:class:`~pagedkv.testing.cases.case.CacheScenario` or :class:`~pagedkv.testing.cases.invalid_call.InvalidCall`.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

from pagedkv.errors import CaseFileError
from pagedkv.testing.casefiles.schema import (BUILTIN_BACKENDS, FORMAT_VERSION, MAX_DEPTH, MAX_FILE_BYTES,  # noqa: F401
                                    MUTANTS_MODULE, PEERS_MODULE, _human, validate_record)

# -- which backends a file may name -------------------------------------------------------------------------
CHEATS_MODULE = "pagedkv.tools.mutants.cheats"  # the cheating candidates (pagedkv.tools.mutants.cheats:NAME)
SHIPPED_MODULES = (MUTANTS_MODULE, PEERS_MODULE, CHEATS_MODULE)


@functools.cache  # an installed distribution's entry points do not change within a process
def _shipped(module: str) -> frozenset[str]:
    """The backend names ``module`` (a shipped mutant or peer module) exports, as pagedkv's own
    distribution declares them (entry-point group ``pagedkv.shipped_backends``, each naming a
    ``{name: backend}`` mapping): the gate trusts them without importing a tool of its own accord, and
    no other installed distribution can add a name."""
    from importlib.metadata import entry_points

    names: set[str] = set()
    for entry in entry_points(group="pagedkv.shipped_backends"):
        if entry.module == module and entry.dist is not None and entry.dist.name == "pagedkv":
            names |= set(entry.load())
    return frozenset(names)


def canonical_backend_spec(spec: object) -> str | None:
    """The spec to load for a backend a case file records, or ``None`` when a file may not name it.

    Accepted: a built-in name (``loop``, ``indexed``, ``triton``); ``pagedkv.tools.mutants:NAME`` for a
    shipped mutant, ``pagedkv.tools.mutants.cheats:NAME`` for a shipped cheat and
    ``pagedkv.tools.peers:NAME`` for a shipped peer, also recorded bare as ``NAME`` (what ``backend_name``
    gives), which map to those specs. Anything else (another module, a ``.py`` path,
    an attribute of a shipped module that is not a mutant or peer) is ``None``.
    Nothing is imported but pagedkv's own mutant, cheat and peer modules (for their names).

    Args:
        spec: the recorded value (any JSON value).
    """
    if not isinstance(spec, str):
        return None
    if spec in BUILTIN_BACKENDS:
        return spec
    module, sep, name = spec.partition(":")
    if sep:
        return spec if module in SHIPPED_MODULES and name in _shipped(module) else None
    for module in SHIPPED_MODULES:
        if spec in _shipped(module):
            return f"{module}:{spec}"
    return None


def trusted_backend_spec(spec: object) -> bool:
    """Whether a case file may name ``spec`` as a backend to load (see :func:`canonical_backend_spec`):
    the one rule replay, the regression runner and the mutants runner apply to ``backend`` and ``other``."""
    return canonical_backend_spec(spec) is not None


def require_trusted_backends(record: dict, *, impl: str | None = None, other: str | None = None,
                             check_backend: bool = True) -> dict:
    """Apply :func:`trusted_backend_spec` to a validated record's ``backend`` and ``other``.

    A spec the caller names (``impl`` replaces ``backend``, ``other`` replaces ``other``) is the
    caller's choice and is not checked; a recorded one must be trusted and is replaced by its
    canonical spec. In the returned record every spec is one of the two (or ``None``).

    Args:
        record: a record :func:`validate_record` accepted.
        impl: backend spec the caller runs instead of the recorded ``backend``.
        other: second backend spec the caller runs instead of the recorded ``other``.
        check_backend: ``False`` for callers that run a backend object of their own (the regression
            and mutants runners): an untrusted recorded ``backend`` is then no error but is moved to
            ``recorded_backend`` and ``backend`` becomes ``None``, so nothing loads it. ``other`` is
            checked either way.

    Returns:
        A copy of ``record`` with ``backend`` and ``other`` the specs to load.

    Raises:
        CaseFileError: ``backend`` (or ``other``) names code a file may not name; the message shows
            the recorded spec and the ``--impl`` (``--other``) option that runs it on purpose.
    """
    out = dict(record)
    for key, given, option in (("backend", impl, "--impl"), ("other", other, "--other")):
        if given is not None:
            out[key] = given
            if key == "backend":  # replay tells the recorded backend from another one named with --impl
                out["recorded_backend"] = record.get("backend")
            continue
        recorded = record.get(key)
        if recorded is None:
            continue
        spec = canonical_backend_spec(recorded)
        if spec is None and key == "backend" and not check_backend:
            out["recorded_backend"], spec = recorded, None
        elif spec is None:
            raise CaseFileError(key, f"the case file names backend {recorded!r}, which is loaded only when you name "
                                     f"it yourself (a case file may name only {', '.join(BUILTIN_BACKENDS)}, "
                                     f"{MUTANTS_MODULE}:NAME or {PEERS_MODULE}:NAME); if you trust that code, "
                                     f"pass {option} {shlex.quote(recorded)} explicitly")
        out[key] = spec
    return out


# -- reading the bytes ------------------------------------------------------------------------------------
def _depth_check(text: str) -> None:
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise CaseFileError("file", f"JSON nested deeper than {MAX_DEPTH} levels (at character {i}); "
                                            f"a case file is at most 6 deep")
        elif ch in "]}":
            depth -= 1


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise CaseFileError("file", f"key {key!r} appears twice in one JSON object (which one counts is "
                                        f"ambiguous)")
        out[key] = value
    return out


def parse_case_bytes(data: bytes) -> Any:
    """The JSON value of a case file's bytes, after the size, encoding and nesting checks.

    Raises:
        CaseFileError (field ``file``): over :data:`MAX_FILE_BYTES`, not UTF-8, nested deeper than
            :data:`MAX_DEPTH`, a key twice in one object, or not JSON.
    """
    if len(data) > MAX_FILE_BYTES:
        raise CaseFileError("file", f"{_human(len(data))} is more than the {_human(MAX_FILE_BYTES)} a case file may "
                                    f"hold")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CaseFileError("file", f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    _depth_check(text)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except CaseFileError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, an integer of more than 4300 digits
        raise CaseFileError("file", f"not valid JSON: {str(exc)[:200]}") from None


def read_case_bytes(path: str | Path) -> bytes:
    """Read at most :data:`MAX_FILE_BYTES` + 1 bytes of ``path``.

    Raises:
        CaseFileError (field ``file``): the file cannot be read (missing, a directory, no permission).
    """
    try:
        with open(path, "rb") as fh:
            return fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CaseFileError("file", f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def build_case(record: dict) -> Any:
    """The dataclass a validated record's ``case`` describes (:class:`~pagedkv.testing.cases.case.Case`,
    :class:`~pagedkv.testing.cases.case.CacheScenario` or :class:`~pagedkv.testing.cases.invalid_call.InvalidCall`)."""
    from pagedkv.testing.cases.case import CacheScenario, Case

    if record["kind"] == "InvalidCall":
        from pagedkv.testing.cases.invalid_call import InvalidCall

        return InvalidCall.from_dict(record["case"])
    if record["kind"] == "LimitCase":
        from pagedkv.testing.cases.limit import LimitCase

        return LimitCase.from_dict(record["case"])
    return (CacheScenario if record["kind"] == "CacheScenario" else Case).from_dict(record["case"])


def load_case_file(path: str | Path, *, max_bytes: int | None = None, impl: str | None = None,
                   other: str | None = None, check_backend: bool = True) -> dict:
    """Read, check and rebuild a case file: the bytes (:func:`parse_case_bytes`), the schema,
    consistency and memory budget (:func:`validate_record`), the backends it names
    (:func:`require_trusted_backends`), in that order, before any tensor exists.

    Args:
        path: the case file.
        max_bytes: memory budget of the case (``None``: :func:`default_max_bytes`).
        impl: backend spec the caller will run instead of the recorded one (then the recorded one
            need not be trusted).
        other: second backend spec the caller will run instead of the recorded ``other``.
        check_backend: ``False`` when the caller runs a backend object of its own and never loads the
            recorded one (see :func:`require_trusted_backends`).

    Returns:
        The record (see :func:`validate_record`) with ``case`` rebuilt as a ``Case``,
        ``CacheScenario`` or ``InvalidCall`` and ``backend`` / ``other`` the specs to load.

    Raises:
        CaseFileError: the first problem; ``field`` names it (``file`` for the bytes).
    """
    record = validate_record(parse_case_bytes(read_case_bytes(path)), max_bytes=max_bytes)
    record = require_trusted_backends(record, impl=impl, other=other, check_backend=check_backend)
    record["case"] = build_case(record)
    if "history" in record:  # {"check", "kind", "case"} each, the case rebuilt
        record["history"] = [{**h, "case": build_case(h)} for h in record["history"]]
    return record


def shipped_regressions() -> list[Path]:
    """The regression case files shipped with pagedkv (``pagedkv/testing/casefiles/regressions/*.json``)."""
    return sorted((Path(__file__).resolve().parent / "regressions").glob("*.json"))
