"""The kind tag of a manager-program case file, readable without importing torch or Hypothesis (so
``python -m pagedkv replay`` can dispatch before loading anything)."""

from __future__ import annotations

KIND = "pagedkv-manager-program"


def is_program_file(path: str) -> bool:
    """Whether ``path`` is a manager-program case file (reads only its first 4 KiB)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return f'"kind": "{KIND}"'.encode() in head
