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
