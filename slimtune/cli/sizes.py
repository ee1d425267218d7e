"""Memory sizes given on the command line (`init --gpu-memory`, `plan --gpu-memory/--host-memory`).

One rule: a number with an optional unit, case-insensitive: GiB or GB, MiB or MB, TiB or TB (binary
units are powers of 1024, decimal ones of 1000). A bare number is GiB: `--gpu-memory 16` means a
16 GiB card; read as 16 bytes it could only ever give a plan in which nothing fits.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1024**3,
    "gib": 1024**3,
    "gb": 10**9,
    "mib": 1024**2,
    "mb": 10**6,
    "tib": 1024**4,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """'16GiB', '24GB', '512MiB', '80' (GiB) -> bytes.

    Raises:
        ValueError: not a positive size with a known unit; the message shows accepted forms.
    """
    match = _SIZE.fullmatch(text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS or float(match[1]) <= 0:
        raise ValueError(f"{text!r} is not a size; give e.g. 16GiB, 24GB, 512MiB or 80 (a bare number is GiB)")
    return int(float(match[1]) * _UNITS[unit])
