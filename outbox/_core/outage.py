"""What the logs say while a dependency is down: one line when its state changes, a summary
while the outage lasts, never a line per retry.

A client library reports every failed connection attempt (librdkafka once per reconnect, a
driver once per query); an operator needs to know that the broker or the database went away,
that it is still away (and how often the client tried), and when it came back. :class:`Outage`
turns the stream of failures into those lines; the caller logs what it returns. Pure: the
caller passes the clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# How often a lasting outage is summarized.
SUMMARY_EVERY = 60.0


@dataclass
class Outage:
    """The up/down state of one dependency (``what``: "Kafka", "PostgreSQL") for the logs."""

    what: str
    summary_every: float = SUMMARY_EVERY
    down_since: float | None = None
    errors: Counter[str] = field(default_factory=Counter)
    last_line: float = 0.0
    last_reason: str = ""

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, kind: str, reason: str, now: float) -> str | None:
        """A failure of kind ``kind`` (an error code or class name): the line to log when it
        starts an outage or a summary is due, else ``None``."""
        self.errors[kind] += 1
        self.last_reason = reason
        if self.down_since is None:
            self.down_since = self.last_line = now
            return (
                f"{self.what} unreachable: {reason} (retrying; a summary every "
                f"{self.summary_every:g}s while it lasts)"
            )
        return self.summary(now)

    def summary(self, now: float) -> str | None:
        """The summary of a lasting outage when one is due (also without a new failure)."""
        if self.down_since is None or now - self.last_line < self.summary_every:
            return None
        self.last_line = now
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.errors.most_common())
        return (
            f"{self.what} still unreachable after {now - self.down_since:.0f}s: "
            f"{sum(self.errors.values())} failures ({kinds}); last: {self.last_reason}"
        )

    def recovered(self, now: float) -> str | None:
        """The dependency answered: the line that ends an outage, or ``None`` if there was none."""
        if self.down_since is None:
            return None
        line = (
            f"{self.what} reachable again after {now - self.down_since:.0f}s "
            f"({sum(self.errors.values())} failures meanwhile)"
        )
        self.down_since = None
        self.errors.clear()
        return line
