"""Events relayed per minute over the last hour, drawn as an SVG bar chart on the server.

The console samples PostgreSQL's cumulative count of rows deleted from the outbox table
(``pg_stat_user_tables.n_tup_del``: a relay deletes each row Kafka confirmed; a discard of a
parked row counts too) every few seconds while it runs; the difference between samples, put in
minute buckets, is the chart. History starts when the console does and lives in its memory.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

WINDOW_MINUTES = 60


@dataclass(frozen=True)
class Sample:
    at: float  # seconds since the epoch
    deleted: int  # cumulative


class Samples:
    """The last hour of samples (and one before it, to difference against)."""

    def __init__(self, keep: int = 2000) -> None:
        self._samples: deque[Sample] = deque(maxlen=keep)

    def add(self, at: float, deleted: int) -> None:
        if self._samples and at <= self._samples[-1].at:
            return
        self._samples.append(Sample(at, deleted))

    def snapshot(self) -> list[Sample]:
        return list(self._samples)


def per_minute(samples: Sequence[Sample], now: float) -> list[int | None]:
    """Rows relayed in each of the last :data:`WINDOW_MINUTES` minutes, oldest first; ``None``
    for a minute with no sample behind it. A counter that went down (statistics reset) adds
    nothing."""
    buckets: list[int | None] = [None] * WINDOW_MINUTES
    start = (math.floor(now / 60) - WINDOW_MINUTES + 1) * 60
    for before, after in itertools.pairwise(samples):
        index = int((after.at - start) // 60)
        if not 0 <= index < WINDOW_MINUTES:
            continue
        buckets[index] = (buckets[index] or 0) + max(0, after.deleted - before.deleted)
    return buckets


def svg_bars(values: Iterable[int | None], width: int = 600, height: int = 120) -> str:
    """An SVG bar chart of ``values`` (numbers only: nothing from the outside reaches it)."""
    data = list(values)
    top = max((v for v in data if v is not None), default=0) or 1
    step = width / max(1, len(data))
    bars = []
    for i, value in enumerate(data):
        if value is None:
            continue
        h = round((height - 14) * value / top, 1)
        x = round(i * step + 1, 1)
        bars.append(
            f'<rect x="{x}" y="{round(height - h, 1)}" width="{round(step - 2, 1)}" '
            f'height="{h}"><title>{value} relayed, {len(data) - i - 1} min ago</title></rect>'
        )
    return (
        f'<svg id="relayed-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="events relayed per minute, last hour">'
        f'<text x="2" y="11" font-size="11">max {top}/min</text>{"".join(bars)}</svg>'
    )
