"""Quantities written for people: one format for byte counts across the library, the trainer and the apps."""

from __future__ import annotations


def format_bytes(n: float | None) -> str:
    """A byte count in decimal units, with one decimal above bytes; "–" when unknown.

    >>> [format_bytes(n) for n in (512, 2048, 45.6e6, 999_960, None)]
    ['512 B', '2.0 kB', '45.6 MB', '1.0 MB', '–']
    """
    if n is None:
        return "–"
    if abs(n) < 999.5:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if abs(n) < 999.95:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def format_steps(steps: list[int]) -> str:
    """Sorted step numbers as ranges; "–" when none.

    >>> format_steps([1, 2, 3, 5, 7, 8])
    '1-3, 5, 7-8'
    """
    ranges: list[list[int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "–"
