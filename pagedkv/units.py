"""Byte counts as people write them, one rule for every option, ini key and environment variable that takes one.

``"1073741824"`` (bytes), ``"8GiB"`` / ``"512MiB"`` and the bare letters ``"8G"`` / ``"512M"`` / ``"1.5K"``
(binary: powers of 1024, as ``free -h`` and ``ulimit`` mean them), ``"80GB"`` / ``"6.5 MB"`` (decimal: powers
of 1000, as device vendors quote memory). Case does not matter; a space may separate number and unit.
"""

from __future__ import annotations

import re

#: unit (lower case) -> bytes.
UNITS = {"": 1, "b": 1,
         "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``text`` in bytes (see the module docstring for the units).

    Args:
        text: the size, or an int (bytes, returned as it is).
        what: the option or setting it came from, for the message.

    Raises:
        ValueError: not a non-negative number with a known unit (the message names ``what``).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"{what}: {text!r} is not a size such as 1048576, 512M, 8GiB or 80GB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])
