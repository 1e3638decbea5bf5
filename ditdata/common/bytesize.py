"""Sizes written by people: "2GiB", "512MiB", "1.5G", "20GB", "123456" -> bytes.

One reading for every size flag (dittrain run --loader-memory, --cache-limit): GiB/MiB and a
bare G/M are binary (as memory is sold), GB/MB decimal (as disks count), a plain number is
bytes.
"""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(value, what: str = "size") -> int:
    """Bytes (> 0) of `value` (a str as above, or an int/float of bytes); ValueError naming
    `what` and the value otherwise."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        n = float(value)
    else:
        m = _SIZE.match(str(value))
        if m is None:
            raise ValueError(f"{what} {value!r}: not a size; write bytes or a number with a unit, "
                             "e.g. 2GiB, 512MiB or 20GB")
        num, prefix, binary, byte = m.groups()
        base = 1000 if (byte and not binary and prefix) else 1024  # "2GB" decimal; "2GiB", "2G" binary
        n = float(num) * base ** " kmgt".index(prefix.lower() or " ")
    if not math.isfinite(n) or n <= 0:
        raise ValueError(f"{what} {value!r}: must be a positive size")
    return int(n)


def format_size(n: float, *, decimal: bool = False, smallest: str = "B") -> str:
    """Bytes as a person reads them: "512 B", "1.5 KiB", "37.2 MiB", "1.07 GiB" (binary), or
    "1.5 kB", "37.2 MB" with decimal=True (file sizes compared with other tools'). `smallest`
    names the smallest unit used ("MiB": memory figures read "0.0 MiB", never KiB)."""
    base, units = (1000, ("B", "kB", "MB", "GB", "TB")) if decimal else (1024, ("B", "KiB", "MiB", "GiB", "TiB"))
    first = units.index(smallest)
    n = float(n) / base**first
    for i, unit in enumerate(units[first:], first):
        if abs(n) < base or i == len(units) - 1:
            if i == 0:
                return f"{int(n)} B"
            return f"{n:.2f} {unit}" if i >= 3 else f"{n:.1f} {unit}"
        n /= base
    return ""
