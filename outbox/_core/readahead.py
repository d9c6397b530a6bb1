"""Whether a unit of work asks Redis before it claims its key: only while duplicates are about.

Redis holds a completed key's outcome only once PostgreSQL has answered a duplicate of it (the
claim's replay fills the cache), or after a joined unit of work's commit or a permanent failure.
A first attempt -- nearly all of a service's traffic -- finds nothing there, and its read
costs a round trip and the client's CPU for nothing; a duplicate that misses goes on to the
claim, which answers it anyway. So the read is worth its cost only while duplicates arrive:
:class:`ReadAhead` keeps reading while a duplicate was seen (answered by Redis or by the claim)
within the last :data:`WINDOW` reads that missed, and stops after that many misses in a row.
The next duplicate is then answered by PostgreSQL, which caches it and turns the reads on again,
so the key's further duplicates -- the only ones Redis could have answered -- come from Redis.

A decision, not a guarantee: a stale count costs one round trip more or less, never an
outcome (Redis is a cache, docs/concepts.md I5). Threads share one count without a lock.
"""

from __future__ import annotations

from typing import Final

# Reads that found nothing, in a row, after which a unit of work goes straight to its claim.
WINDOW: Final = 64


class ReadAhead:
    """The count of reads left before the cache stops being asked ahead of a claim."""

    __slots__ = ("_left", "_window")

    def __init__(self, window: int = WINDOW) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self._window = window
        self._left = window  # a process starts reading: it may start amid a burst of retries

    def wanted(self) -> bool:
        """True when the next unit of work should ask the cache before its claim."""
        return self._left > 0

    def missed(self) -> None:
        """The cache was asked and had nothing (or could not answer)."""
        left = self._left
        if left > 0:
            self._left = left - 1

    def seen(self) -> None:
        """A duplicate arrived (the cache or the claim answered it): read ahead again."""
        self._left = self._window
