"""Writing case files, and where they go: the one place that names the failure directory and files.

A case file is written *before* the backend is called (``"outcome": "running"``) and rewritten with
the outcome when it fails, so a crash, an out-of-memory kill or a device fault leaves it on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

#: The directory case files go to when ``$PAGEDKV_FAILURE_DIR`` is unset (relative to the working directory).
DEFAULT_FAILURE_DIR = ".pagedkv-failures"


def failure_dir() -> Path:
    """Where failing cases are written: ``$PAGEDKV_FAILURE_DIR``, else :data:`DEFAULT_FAILURE_DIR` in the cwd."""
    return Path(os.environ.get("PAGEDKV_FAILURE_DIR") or DEFAULT_FAILURE_DIR)


def safe_name(text: str, max_len: int = 150) -> str:
    """``text`` as a file name of at most ``max_len`` characters, one name per ``text``: runs of characters
    other than ``[A-Za-z0-9_.-]`` become ``_``; where that or the length cut loses anything, the name ends
    in ``-`` and 10 hex digits of the SHA-256 of the full ``text``, so two test ids that agree on their first
    ``max_len`` characters (or differ only in replaced characters) never share a file (a passing test would
    delete the other's case file)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")
    if name == text and len(name) <= max_len and name:
        return name
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{name[:max_len - 11]}-{digest}"


def case_file_path(test_id: str, suffix: str = "") -> Path:
    """The case file of one test id (``suffix`` tells apart several failures of one test)."""
    return failure_dir() / f"{safe_name(test_id)}{suffix}.json"


def crashed_case_files(folder: Path | None = None) -> list[Path]:
    """Case files left with ``"outcome": "running"``: a run died while the backend ran that case."""
    folder = folder or failure_dir()
    if not folder.is_dir():
        return []
    left = []
    for path in sorted(folder.glob("*.json")):
        try:
            if json.loads(path.read_text()).get("outcome") == "running":
                left.append(path)
        except (OSError, ValueError):
            continue
    return left


def save_failure(check: str, backend_spec: str, case: Any, *, other: str | None = None,
                 test_id: str | None = None, error: str = "", outcome: str = "failed",
                 path: Path | None = None, extra: dict | None = None) -> Path:
    """Write a case file as JSON (no tensors: geometry, tables, lengths, pattern, seed) and return its path.

    Args:
        check: the registered property's name (:mod:`pagedkv.testing.registry`).
        backend_spec: the implementation under test (a built-in name or the ``--pagedkv-impl`` spec).
        case: a :class:`~pagedkv.testing.cases.Case`, :class:`~pagedkv.testing.cases.CacheScenario` or
            :class:`~pagedkv.testing.cases.InvalidCall`.
        other: the second backend of a pair property (or the baseline of a drift record).
        test_id: names the file (see :func:`case_file_path`).
        error: the failure's message (its first line is kept, 500 characters at most).
        outcome: ``"running"`` (written before the backend is called), ``"failed"`` (an assertion),
            ``"raised"`` (the backend raised something else), ``"crashed"`` (the process running it died).
        path: write here instead of under :func:`failure_dir`.
        extra: further top-level fields the schema knows (``title``, ``id``).
    """
    if path is None:
        path = case_file_path(test_id or f"{check}-{backend_spec}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": 1, "check": check, "backend": backend_spec, "other": other,
              "kind": type(case).__name__, "case": case.to_dict(), "outcome": outcome,
              "error": error.splitlines()[0][:500] if error else "", **(extra or {})}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # a reader never sees half a file
    return path
