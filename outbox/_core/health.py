"""Table health: what ``outbox status`` and ``/metrics`` say about the tables and the xmin horizon.

Invariant: only who holds the horizon back is reported -- process id, application name, state
and start time -- never the text of its query, which can hold secrets. (While the horizon stays
put, every row the relay deletes and every key ``outbox gc`` removes stays behind as a dead
tuple, and the tables grow until the holder lets go.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from outbox._core.durations import format_duration

# A horizon held longer than this gets a warning line (and is worth an alert).
DEFAULT_HORIZON_WARNING_SECONDS = 300.0
# A replication slot has no start time: its hold is judged by transaction ids instead.
DEFAULT_HORIZON_WARNING_XIDS = 1_000_000
# Dead tuples worth a warning: at least this many, and more than the live ones.
DEAD_TUPLES_WARNING = 100_000


@dataclass(frozen=True)
class TableHealth:
    """One table's tuples, size and last vacuum, from PostgreSQL's statistics (approximate)."""

    table: str
    live_tuples: int
    dead_tuples: int
    size_bytes: int
    last_vacuum: datetime | None  # the later of the last manual VACUUM and autovacuum
    last_autovacuum: datetime | None


@dataclass(frozen=True)
class HorizonHolder:
    """The oldest holder of the xmin horizon: a session (``kind`` ``transaction``), a prepared
    transaction or a replication slot; ``age_seconds`` is ``None`` for a slot."""

    kind: str
    xid_age: int
    age_seconds: float | None
    pid: int | None
    application_name: str | None
    state: str | None
    started: datetime | None
    name: str | None  # slot name or prepared transaction's gid

    def describe(self) -> str:
        """One line naming the holder (never its query)."""
        age = "" if self.age_seconds is None else f"for {format_duration(round(self.age_seconds))} "
        if self.kind == "replication slot":
            return f"replication slot {self.name!r} holds it back {self.xid_age:,} transactions"
        if self.kind == "prepared transaction":
            return f"prepared transaction {self.name!r} has held it {age}({self.xid_age:,} xids)"
        started = "" if self.started is None else f", started {self.started.isoformat()}"
        return (
            f"pid {self.pid} ({self.application_name or 'no application_name'}, "
            f"{self.state or 'state unknown'}{started}) has held it {age}"
            f"({self.xid_age:,} xids)"
        )


def oldest_holder(holders: Sequence[HorizonHolder]) -> HorizonHolder | None:
    """The holder that keeps the horizon furthest back (most transaction ids behind)."""
    return max(holders, key=lambda h: (h.xid_age, h.age_seconds or 0.0), default=None)


def health_warnings(
    tables: Sequence[TableHealth],
    holder: HorizonHolder | None,
    *,
    max_seconds: float = DEFAULT_HORIZON_WARNING_SECONDS,
    max_xids: int = DEFAULT_HORIZON_WARNING_XIDS,
) -> list[str]:
    """Warning lines, each saying what to do."""
    out: list[str] = []
    if holder is not None and (
        (holder.age_seconds is not None and holder.age_seconds >= max_seconds)
        or (holder.age_seconds is None and holder.xid_age >= max_xids)
    ):
        out.append(
            f"the xmin horizon is pinned: {holder.describe()}; VACUUM cannot remove rows "
            "deleted since, so the outbox tables grow: end that transaction (or drop the slot)"
        )
    for t in tables:
        if t.dead_tuples >= DEAD_TUPLES_WARNING and t.dead_tuples > t.live_tuples:
            out.append(
                f"table {t.table} has {t.dead_tuples:,} dead tuples for {t.live_tuples:,} live: "
                "VACUUM is held back or behind (see docs/operations.md, table health)"
            )
    return out
