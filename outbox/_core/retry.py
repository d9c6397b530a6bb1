"""Retry timing, written once: capped exponential backoff with equal jitter.

Invariant: attempt ``n`` (1-based) waits a delay drawn uniformly from ``[d/2, d]`` with
``d = min(maximum, initial * 2**(n-1))``: the jitter keeps processes that failed together (a
database blip) from retrying in lockstep, and a retry never comes sooner than half the nominal
backoff. Callers sleep with ``stop_event.wait(delay)`` so that a stop request cancels the sleep.
"""

from __future__ import annotations

import random
from collections.abc import Callable

_EXPONENT_CAP = 62


def backoff_delay(
    attempt: int,
    initial: float,
    maximum: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """Delay before retry number ``attempt`` (1-based; 0 counts as 1; any count, however large:
    an outage of days or a key held for hours keeps waiting ``maximum`` at most)."""
    # 2**62 outgrows any cap; a larger exponent would overflow the float.
    nominal = min(maximum, initial * 2.0 ** min(_EXPONENT_CAP, max(0, attempt - 1)))
    return float(nominal / 2 + rand() * nominal / 2)


class Backoff:
    """Consecutive failures of one activity and the delay the next retry waits.

    ``failed()`` counts a failure and returns the delay to wait; ``succeeded()`` starts over.
    """

    __slots__ = ("_rand", "failures", "initial", "maximum")

    def __init__(
        self, initial: float, maximum: float, rand: Callable[[], float] = random.random
    ) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"need 0 < initial <= maximum, got {initial!r}, {maximum!r}")
        self.initial = initial
        self.maximum = maximum
        self._rand = rand
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        return backoff_delay(self.failures, self.initial, self.maximum, self._rand)

    def succeeded(self) -> None:
        self.failures = 0
