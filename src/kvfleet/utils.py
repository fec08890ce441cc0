"""Small helpers shared across layers (no torch here)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``1024`` into bytes.

    Raises:
        ValueError: the text is not a non-negative number with a known unit.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"memory size must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid memory size {text!r}: use e.g. 2GiB, 512MiB, 1GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)
