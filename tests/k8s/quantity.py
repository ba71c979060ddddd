"""Kubernetes resource quantities (``500m``, ``4Gi``, ``2``) as ResourceQuota admission
adds and prints them: exact decimal values, and ``Quantity.String()``'s canonical form
in the format of the first term (binary when it had a binary suffix, else decimal)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_FORM = re.compile(r"^([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


class QuantityError(ValueError):
    pass


@dataclass(frozen=True)
class Quantity:
    value: Decimal
    binary: bool = False

    def __add__(self, other: Quantity) -> Quantity:
        return Quantity(self.value + other.value, self.binary)

    def __str__(self) -> str:
        v = self.value
        if v == 0:
            return "0"
        if self.binary and v == v.to_integral_value() and v % 1024 == 0:
            n = int(v)
            power = 0
            while n % 1024 == 0 and power < 6:
                n //= 1024
                power += 1
            suffix = next(k for k, p in _BINARY.items() if p == power)
            return f"{n}{suffix}"
        # DecimalSI: the largest power of 1000 that leaves an integer (millis at least:
        # a Quantity rounds up below a milli)
        for exp in (18, 15, 12, 9, 6, 3, 0, -3):
            scaled = v / (Decimal(10) ** exp)
            if scaled == scaled.to_integral_value():
                suffix = next(k for k, e in _DECIMAL.items() if e == exp)
                return f"{int(scaled)}{suffix}"
        milli = (v * 1000).to_integral_value(rounding="ROUND_CEILING")
        return f"{int(milli)}m"


def parse(text: object) -> Quantity:
    """A quantity as the API reads it (an int or a string)."""
    raw = str(text).strip()
    hit = _FORM.match(raw)
    if hit is None:
        raise QuantityError(f"quantities must match the regular expression: {raw!r}")
    number, suffix = Decimal(hit[1]), hit[2] or ""
    if suffix in _BINARY:
        return Quantity(number * (Decimal(1024) ** _BINARY[suffix]), True)
    if suffix[:1] in ("e", "E"):
        return Quantity(number * (Decimal(10) ** int(suffix[1:])))
    return Quantity(number * (Decimal(10) ** _DECIMAL[suffix]))
