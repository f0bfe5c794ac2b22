"""How byte counts are written for people: one convention everywhere.

Every user-facing figure (explain, the command line, the demo, runtime statistics,
plot labels, benchmark tables) goes through `format_bytes`: powers of 1024 with
their IEC names (KiB, MiB, GiB, TiB), so a number printed by `explain` and the
same number on `memory.png` read alike. Options still accept "512MB" (10^6) and
"512MiB" (2^20) as written (`slcompile.config.parse_bytes`).
"""

from __future__ import annotations

__all__ = ["format_bytes", "bytes_unit", "UNITS"]

UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def bytes_unit(largest: float) -> tuple[str, int]:
    """The unit to draw values up to `largest` bytes in (one unit per axis or table).

    Returns:
        (name, bytes per unit), e.g. ("MiB", 1048576); ("B", 1) below one KiB.
    """
    for name, size in UNITS:
        if abs(largest) >= size:
            return name, size
    return "B", 1


def format_bytes(nbytes: float, digits: int = 2) -> str:
    """`nbytes` in the largest 1024-based unit it reaches: "812 B", "781.25 KiB",
    "5.69 MiB", "2.00 GiB".

    Args:
        nbytes: a byte count (int or float; sympy integers are accepted).
        digits: digits after the decimal point (none for plain bytes).
    """
    value = float(nbytes)
    name, size = bytes_unit(value)
    if size == 1:
        return f"{int(round(value))} B"
    return f"{value / size:.{digits}f} {name}"
