"""Byte sizes as people write them on the command line: 500MB, 4GiB, 1.5G, 65536."""

from __future__ import annotations

import re

from ember.models.support.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in `text`; decimal units (MB = 10^6) and binary ones (MiB = 2^20)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"{what} {text!r} is not a size; write e.g. 500MB, 4GiB or 1.5G")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"
