"""Kubernetes resource quantities (``500m``, ``2Gi``, ``1.5e9``) parsed exactly, with :class:`Decimal`.

The grammar is Kubernetes' ``resource.Quantity``: a signed decimal number followed by an optional
binary suffix (``Ki Mi Gi Ti Pi Ei``, powers of 1024), decimal suffix (``n u m k M G T P E``) or a
decimal exponent (``e3``, ``E-2``).
"""

from __future__ import annotations

import re
from decimal import Decimal

#: The OpenAPI pattern Kubernetes' own CRDs give to quantity fields (int-or-string).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?"
                 r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str | int | float) -> Decimal:
    """The value of a Kubernetes quantity (``"2Gi"`` -> ``Decimal(2147483648)``; ``"250m"`` -> ``0.25``).

    Raises:
        ValueError: ``text`` is not a quantity.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a quantity: {text!r}")
    if isinstance(text, (int, float)):
        return Decimal(str(text))
    m = _RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r} (e.g. 500m, 2Gi, 4, 1.5e9)")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        return number * (1024 ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    if suffix:
        return number.scaleb(int(Decimal(suffix[1:])))
    return number


def quantity_bytes(text: str | int) -> int:
    """A memory quantity as a whole number of bytes (rounded up): ``"2Gi"`` -> ``2147483648``.

    Raises:
        ValueError: not a quantity, or negative.
    """
    value = parse_quantity(text)
    if value < 0:
        raise ValueError(f"a byte quantity must be >= 0, got {text!r}")
    return int(value.to_integral_value(rounding="ROUND_CEILING"))
