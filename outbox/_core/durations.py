"""Durations and ranges as operators read and write them in flags, logs and reports."""

from __future__ import annotations

from collections.abc import Iterable


def format_ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7, 9, 10]`` -> ``0-3,7,9-10`` (``-`` when empty); lane lists in logs and
    ``outbox status``."""
    items = sorted(set(values))
    if not items:
        return "-"
    parts: list[str] = []
    start = prev = items[0]
    for v in items[1:]:
        if v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
