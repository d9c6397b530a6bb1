"""The status of the pipeline (``outbox status``), read from PostgreSQL alone.

Invariant: reading the status takes no lock a live unit of work or relay waits for; the live
relays and their lanes come from the advisory locks they hold, not from what they last wrote.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox import migrate
from outbox._core import lanes as lanes_core
from outbox._core.durations import (
    format_duration,
    format_ranges,
)
from outbox._core.environment import ENV_RELAY_LANES
from outbox._core.health import (
    DEFAULT_HORIZON_WARNING_SECONDS,
    HorizonHolder,
    TableHealth,
    health_warnings,
)
from outbox._pg import health as health_pg, lanes as lanes_pg, operations as ops
from outbox._pg.window import LaneWindow, windows_status
from outbox.config import redact_url
from outbox.errors import ConfigurationError, OutboxError
from outbox.schema import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_STARTED,
    validate_schema_name,
)

JSON_FORMAT_VERSION = 1  # of the ``outbox status --json`` and ``outbox gc --json`` documents


@dataclass(frozen=True)
class TopicBacklog:
    topic: str
    pending: int
    parked: int
    oldest_pending_age: float | None


@dataclass(frozen=True)
class LaneBacklog:
    lane: int
    pending: int
    parked: int


@dataclass(frozen=True)
class PendingCount:
    """An exact count of the pending rows per topic and per lane, as of ``counted_at`` (the
    database's clock), and how long counting took: one scan of the outbox table."""

    lanes: int
    topics: tuple[tuple[str, int, float | None], ...]  # topic, pending, oldest pending's age
    by_lane: tuple[tuple[int, int], ...]  # lane, pending
    counted_at: datetime
    seconds: float


def count_pending(connection: sa.Connection, schema: str | None, lanes: int) -> PendingCount:
    """Count the pending rows of the outbox in ``schema`` split into ``lanes`` lanes (a full
    scan: its cost grows with the backlog)."""
    started = time.perf_counter()
    counted_at = ops.database_now(connection)
    topics, by_lane = ops.outbox_backlog(connection, validate_schema_name(schema), lanes)
    return PendingCount(
        lanes=lanes,
        topics=tuple((t, n, age) for t, n, _parked, age in topics if n),
        by_lane=tuple((lane, n) for lane, n, _parked in by_lane if n),
        counted_at=counted_at,
        seconds=time.perf_counter() - started,
    )


def _with_parked(
    counted: PendingCount, parked: Iterable[tuple[str, int, int]]
) -> tuple[list[tuple[str, int, int, float | None]], list[tuple[int, int, int]]]:
    """The backlog per topic and lane: pending rows as ``counted``, parked rows as ``parked``
    (``(topic, lane, parked)``)."""
    topics = {t: (n, 0, age) for t, n, age in counted.topics}
    by_lane = {lane: (n, 0) for lane, n in counted.by_lane}
    for topic, lane, n in parked:
        t_pending, t_parked, age = topics.get(topic, (0, 0, None))
        topics[topic] = (t_pending, t_parked + n, age)
        l_pending, l_parked = by_lane.get(lane, (0, 0))
        by_lane[lane] = (l_pending, l_parked + n)
    return (
        [(t, *topics[t]) for t in sorted(topics)],
        [(lane, *by_lane[lane]) for lane in sorted(by_lane)],
    )


@dataclass(frozen=True)
class ScopeKeys:
    scope: str
    status: str
    count: int


@dataclass(frozen=True)
class Status:
    """Everything ``outbox status`` reports, read in one repeatable-read snapshot."""

    schema: str | None
    revision: str | None
    head_revision: str
    lanes: int
    lanes_source: str
    relay_lane_counts: tuple[int, ...]
    topics: tuple[TopicBacklog, ...]
    lane_backlog: tuple[LaneBacklog, ...]
    oldest_pending_age: float | None
    keys: tuple[ScopeKeys, ...]
    oldest_key_age: float | None
    relays: tuple[lanes_core.RelayInfo, ...]
    taken_at: datetime
    warnings: tuple[str, ...] = field(default=())
    # Table health (outbox._core.health): the toolkit's tables and the horizon's holder.
    tables: tuple[TableHealth, ...] = field(default=())
    horizon: HorizonHolder | None = None
    horizon_warning_seconds: float = DEFAULT_HORIZON_WARNING_SECONDS
    # The outbox table this session reaches, schema-qualified (through the URL's search_path
    # when no schema is configured): the one a relay with the same URL serves.
    table: str | None = None
    table_schema: str | None = None
    # When the pending rows were counted, if not in this snapshot (read_status's ``pending``):
    # the parked numbers are this snapshot's all the same.
    pending_counted_at: datetime | None = None
    # The window engine's lanes (outbox_relay_windows), empty while no window relay has run.
    windows: tuple[LaneWindow, ...] = field(default=())

    @property
    def window_backlog(self) -> int:
        """Rows not yet past the window cursors (the table also holds delivered rows)."""
        return sum(w.backlog for w in self.windows)

    @property
    def window_held(self) -> int:
        return sum(w.held for w in self.windows)

    @property
    def window_relays(self) -> bool:
        """The window engine serves this outbox: a live window relay, or cursors and no live
        relay of the claim engine."""
        engines = {r.engine for r in self.relays}
        return "window" in engines or (bool(self.windows) and not engines)

    @property
    def schema_name(self) -> str:
        """The schema served: the resolved table's (else the configured one)."""
        return self.table_schema or self.schema or "public"

    @property
    def pending(self) -> int:
        return sum(t.pending for t in self.topics)

    @property
    def parked(self) -> int:
        return sum(t.parked for t in self.topics)

    def keys_by_status(self) -> dict[str, int]:
        counts = {STATUS_COMPLETED: 0, STATUS_FAILED: 0, STATUS_STARTED: 0}
        for k in self.keys:
            counts[k.status] = counts.get(k.status, 0) + k.count
        return counts

    def owner_of(self) -> dict[int, int]:
        """Lane -> pid of the relay holding it."""
        return {lane: r.pid for r in self.relays for lane in r.lanes}


def choose_lanes(
    flag: int | None, env_value: str | None, announced: Iterable[int]
) -> tuple[int, str]:
    """The lane count to split the backlog by, and where it came from.

    An explicit ``--lanes`` or ``OUTBOX_RELAY_LANES`` wins (the operator says how the relays
    are configured); otherwise the count live relays announce (when they agree); otherwise the
    relay's default.
    """
    if flag is not None:
        source, lanes = "flag", flag
    elif env_value is not None:
        try:
            lanes = int(env_value)
        except ValueError as exc:
            raise ConfigurationError(f"{ENV_RELAY_LANES}={env_value!r} is not an integer") from exc
        source = "env"
    else:
        counts = sorted(set(announced))
        if len(counts) == 1:
            return counts[0], "relays"
        return lanes_core.DEFAULT_LANES, "default"
    if not 1 <= lanes <= lanes_core.MAX_LANES:
        raise ConfigurationError(
            f"--lanes must be between 1 and {lanes_core.MAX_LANES}, got {lanes}"
        )
    return lanes, source


def status_warnings(status: Status) -> list[str]:
    """Conditions an operator should act on, each with what to do."""
    out: list[str] = []
    if status.revision != status.head_revision:
        out.append(
            f"schema at revision {status.revision or 'none'}, this package expects "
            f"{status.head_revision}: run `outbox migrate`"
        )
    counts = set(status.relay_lane_counts)
    if len(counts) > 1:
        out.append(
            f"live relays disagree on --lanes ({', '.join(map(str, sorted(counts)))}): give "
            "every relay the same value"
        )
    elif counts and status.lanes not in counts:
        out.append(
            f"live relays run with --lanes {next(iter(counts))}, this report splits by "
            f"{status.lanes}: per-lane numbers do not match their lanes"
        )
    if status.pending and not status.relays:
        out.append(f"{status.pending} rows pending and no relay is running: start outbox-relay")
    elif status.relays and (status.lanes_source == "relays" or status.lanes in counts):
        owners = status.owner_of()
        orphaned = [b.lane for b in status.lane_backlog if b.pending and b.lane not in owners]
        if orphaned:
            out.append(
                f"lanes {format_ranges(orphaned)} have pending rows but no relay holds them "
                "(normal for a second after a relay starts or stops)"
            )
    engines = sorted({r.engine for r in status.relays})
    if len(engines) > 1:
        out.append(
            f"relays of more than one engine are alive ({', '.join(engines)}): they send the "
            "same rows; stop every relay of one engine (docs/relay.md, 'Switching engines')"
        )
    stale = sorted({w.lanes for w in status.windows} - {status.lanes})
    if status.window_relays and stale:
        out.append(
            f"the window cursors were made for {stale[0]} lanes, this report splits by "
            f"{status.lanes}: window relays refuse to start with another --lanes"
        )
    if status.parked:
        rows = "1 parked row holds" if status.parked == 1 else f"{status.parked} parked rows hold"
        out.append(f"{rows} back later rows of their keys: see `outbox parked list`")
    out += health_warnings(
        status.tables, status.horizon, max_seconds=status.horizon_warning_seconds
    )
    return out


def read_status(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    lanes_flag: int | None = None,
    lanes_env: str | None = None,
    horizon_warning_seconds: float = DEFAULT_HORIZON_WARNING_SECONDS,
    pending: Callable[[sa.Connection, int], PendingCount] | None = None,
) -> Status:
    """Collect the status of the outbox in ``schema`` (read-only; one snapshot).

    A horizon held for ``horizon_warning_seconds`` or longer gets a warning. Every number is
    counted in the snapshot, unless ``pending`` is given: then it is asked for the pending
    rows' count by lane count (:func:`count_pending`, or an earlier one of its answers), and
    only the parked rows are counted here, through their partial index; the status says when
    the pending rows were counted (``pending_counted_at``).
    """
    schema = validate_schema_name(schema)
    revision = migrate.current_revision(connection, schema)
    resolved = ops.outbox_table_resolved(connection, schema)
    if revision is None:
        raise OutboxError(
            f"no outbox tables in schema {schema or 'public'}: run `outbox migrate` first"
        )
    taken_at = ops.database_now(connection)
    locks = lanes_pg.read_locks(connection, schema)
    announced = tuple(sorted(lanes_core.configured_lane_counts(locks, schema)))
    lanes, source = choose_lanes(lanes_flag, lanes_env, announced)
    windows = tuple(windows_status(connection, schema))
    made_for = {w.lanes for w in windows}
    if source == "default" and len(made_for) == 1:
        lanes, source = made_for.pop(), "windows"  # no relay alive: as the cursors were made
    relays = tuple(
        replace(r, client_addr=_host(r.client_addr))
        for r in lanes_pg.relay_ownership(connection, schema)
    )
    counted_at = None
    if pending is None:
        topics, by_lane = ops.outbox_backlog(connection, schema, lanes)
    else:
        counted = pending(connection, lanes)
        if counted.lanes != lanes:
            raise ValueError(f"pending rows counted in {counted.lanes} lanes, not {lanes}")
        topics, by_lane = _with_parked(
            counted, ops.outbox_parked_backlog(connection, schema, lanes)
        )
        counted_at = counted.counted_at
    ages = [age for *_, age in topics if age is not None]
    status = Status(
        schema=schema,
        revision=revision,
        head_revision=migrate.head_revision(),
        lanes=lanes,
        lanes_source=source,
        relay_lane_counts=announced,
        topics=tuple(TopicBacklog(*row) for row in topics),
        lane_backlog=tuple(LaneBacklog(*row) for row in by_lane),
        oldest_pending_age=max(ages) if ages else None,  # the oldest of all: the topics' oldest
        keys=tuple(ScopeKeys(*row) for row in ops.idempotency_keys_by_scope(connection, schema)),
        oldest_key_age=ops.idempotency_keys_oldest_update_age(connection, schema),
        relays=relays,
        taken_at=taken_at,
        tables=tuple(health_pg.table_health(connection, schema)),
        horizon=health_pg.horizon_holder(connection),
        horizon_warning_seconds=horizon_warning_seconds,
        table=None if resolved is None else resolved[1],
        table_schema=None if resolved is None else resolved[0],
        pending_counted_at=counted_at,
        windows=windows,
    )
    return _with_warnings(status)


def _host(addr: str | None) -> str | None:
    """``inet::text`` renders ``127.0.0.1/32``; show the bare address."""
    if addr is None:
        return None
    try:
        return str(ipaddress.ip_interface(addr).ip)
    except ValueError:
        return addr


def _with_warnings(status: Status) -> Status:
    return replace(status, warnings=tuple(status_warnings(status)))


def status_to_json(status: Status, database_url: str | None = None) -> dict[str, Any]:
    """The stable ``outbox status --json`` document (format version 1, see docs/operations.md).

    Ages are seconds (``null`` when there is nothing to age). New fields may be added in the
    same version; existing ones keep their name, type and meaning.
    """
    owners = status.owner_of()
    return {
        "version": JSON_FORMAT_VERSION,
        "taken_at": status.taken_at.isoformat(),
        "database": redact_url(database_url) if database_url else None,
        "schema": status.schema_name,
        "table": status.table,
        "migration": {
            "current": status.revision,
            "head": status.head_revision,
            "up_to_date": status.revision == status.head_revision,
        },
        "outbox": {
            "pending": status.pending,
            "parked": status.parked,
            "oldest_pending_age_seconds": status.oldest_pending_age,
            "topics": [
                {
                    "topic": t.topic,
                    "pending": t.pending,
                    "parked": t.parked,
                    "oldest_pending_age_seconds": t.oldest_pending_age,
                }
                for t in status.topics
            ],
        },
        "lanes": {
            "count": status.lanes,
            "source": status.lanes_source,
            "announced_by_relays": list(status.relay_lane_counts),
            "backlog": [
                {
                    "lane": b.lane,
                    "pending": b.pending,
                    "parked": b.parked,
                    "owner_pid": owners.get(b.lane),
                }
                for b in status.lane_backlog
            ],
        },
        "idempotency_keys": {
            "total": sum(k.count for k in status.keys),
            "by_status": status.keys_by_status(),
            "by_scope": [
                {"scope": k.scope, "status": k.status, "count": k.count} for k in status.keys
            ],
            "oldest_updated_age_seconds": status.oldest_key_age,
        },
        "relays": [
            {
                "pid": r.pid,
                "application_name": r.application_name,
                "client_addr": r.client_addr,
                "lanes": list(r.lanes),
                "engine": r.engine,
            }
            for r in status.relays
        ],
        "windows": _windows_json(status),
        "tables": [
            {
                "table": t.table,
                "live_tuples": t.live_tuples,
                "dead_tuples": t.dead_tuples,
                "size_bytes": t.size_bytes,
                "last_vacuum": _iso(t.last_vacuum),
                "last_autovacuum": _iso(t.last_autovacuum),
            }
            for t in status.tables
        ],
        "horizon": None if status.horizon is None else _horizon_json(status.horizon),
        "warnings": list(status.warnings),
    }


def _windows_json(status: Status) -> dict[str, Any] | None:
    """The window engine's lanes (``null`` while no window relay has run)."""
    if not status.windows:
        return None
    return {
        "lanes": status.windows[0].lanes,
        "backlog": status.window_backlog,
        "held": status.window_held,
        # Rows past their lanes' cursors still in the table, delivered (not given back yet) or
        # owed by a held key: counted in outbox.pending, which counts every row not parked.
        "past_cursors": _past_cursors(status),
        "by_lane": [
            {
                "lane": w.lane,
                "backlog": w.backlog,
                "oldest_pending_age_seconds": w.oldest_age,
                "held": w.held,
                "delivered": w.delivered,
                "xids_behind": w.xids_behind,
                "window_in_progress": w.in_progress,
                "window_done_id": w.done if w.in_progress else None,
                "window_high_id": w.high if w.in_progress else None,
                "written_age_seconds": round(w.written_age, 3),
            }
            for w in status.windows
        ],
    }


def _past_cursors(status: Status) -> int | None:
    if status.pending_counted_at not in (None, status.taken_at):
        return None  # pending counted at another moment than the windows
    return max(0, status.pending - status.window_backlog)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _horizon_json(h: HorizonHolder) -> dict[str, Any]:
    """The horizon's holder: who, never what it runs."""
    return {
        "kind": h.kind,
        "xid_age": h.xid_age,
        "age_seconds": None if h.age_seconds is None else round(h.age_seconds, 3),
        "pid": h.pid,
        "application_name": h.application_name,
        "state": h.state,
        "started": _iso(h.started),
        "name": h.name,
    }


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(round(seconds, 1))


def _table(
    header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  "
) -> list[str]:
    """Left-align the first column, right-align the others (numbers)."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric_first = bool(rows) and all(str(row[0]).isdigit() for row in rows)
    lines = []
    for row in cells:
        first = row[0].rjust(widths[0]) if numeric_first else row[0].ljust(widths[0])
        parts = [first]
        parts += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append(indent + "  ".join(parts).rstrip())
    return lines


def render_status(status: Status, database_url: str | None = None, max_lanes: int = 16) -> str:
    """The human form of ``outbox status``: short sections, only non-empty rows."""
    out: list[str] = []
    where = f"{redact_url(database_url)}  " if database_url else ""
    rev = status.revision or "none"
    rev_note = (
        "head" if status.revision == status.head_revision else f"head is {status.head_revision}"
    )
    out.append(f"outbox status  {where}table {status.table}  migration {rev} ({rev_note})")
    out.append("")
    out.append(
        f"OUTBOX  pending {status.pending:,}  parked {status.parked:,}  "
        f"oldest pending {_age(status.oldest_pending_age)}"
    )
    if status.topics:
        out += _table(
            ("TOPIC", "PENDING", "PARKED", "OLDEST"),
            [(t.topic, f"{t.pending:,}", f"{t.parked:,}", _age(t.oldest_pending_age))
             for t in status.topics],
        )  # fmt: skip
    out.append("")
    owners = status.owner_of()
    busy = [b for b in status.lane_backlog if b.pending or b.parked]
    out.append(
        f"LANES  {status.lanes} (from {status.lanes_source})  with rows {len(busy)}"
        + (f"  (busiest {max_lanes} shown)" if len(busy) > max_lanes else "")
    )
    if busy:
        shown = sorted(busy, key=lambda b: (-b.pending - b.parked, b.lane))[:max_lanes]
        out += _table(
            ("LANE", "PENDING", "PARKED", "RELAY"),
            [(b.lane, f"{b.pending:,}", f"{b.parked:,}", owners.get(b.lane, "-"))
             for b in sorted(shown, key=lambda b: b.lane)],
        )  # fmt: skip
    out.append("")
    by_status = status.keys_by_status()
    total = sum(by_status.values())
    out.append(
        f"IDEMPOTENCY KEYS  total {total:,}  completed {by_status[STATUS_COMPLETED]:,}  "
        f"failed {by_status[STATUS_FAILED]:,}  oldest update {_age(status.oldest_key_age)}"
    )
    scopes = sorted({k.scope for k in status.keys})
    if scopes:
        counts = {(k.scope, k.status): k.count for k in status.keys}
        out += _table(
            ("SCOPE", "COMPLETED", "FAILED"),
            [(s, f"{counts.get((s, STATUS_COMPLETED), 0):,}",
              f"{counts.get((s, STATUS_FAILED), 0):,}") for s in scopes],
        )  # fmt: skip
    out.append("")
    out += _render_health(status)
    out.append("")
    if status.windows:
        out += _render_windows(status, max_lanes)
        out.append("")
    out.append(f"RELAYS  alive {len(status.relays)}")
    if status.relays:
        out += _table(
            ("PID", "APPLICATION", "CLIENT", "ENGINE", "LANES"),
            [(r.pid, r.application_name or "-", r.client_addr or "local", r.engine,
              format_ranges(r.lanes))
             for r in status.relays],
        )  # fmt: skip
    if status.warnings:
        out.append("")
        out += [f"warning: {w}" for w in status.warnings]
    return "\n".join(out)


def _render_windows(status: Status, max_lanes: int) -> list[str]:
    """WINDOWS: the window engine's backlog and held rows, per lane with rows, a window in
    progress or a cursor that never delivered."""
    past = _past_cursors(status)
    out = [
        f"WINDOWS  lanes {status.windows[0].lanes}  backlog {status.window_backlog:,}  "
        f"held {status.window_held:,}"
        + ("" if past is None else f"  past the cursors {past:,} (delivered, or held keys' rows)")
    ]
    busy = [w for w in status.windows if w.backlog or w.held or w.in_progress or not w.delivered]
    if busy:
        shown = sorted(busy, key=lambda w: (-w.backlog - w.held, w.lane))[:max_lanes]
        out += _table(
            ("LANE", "BACKLOG", "OLDEST", "HELD", "XIDS BEHIND", "WINDOW", "WRITTEN"),
            [(w.lane, f"{w.backlog:,}", _age(w.oldest_age), f"{w.held:,}",
              "-" if w.xids_behind is None else f"{w.xids_behind:,}",
              f"open, sent to id {w.done}/{w.high}" if w.in_progress
              else ("-" if w.delivered else "first"),
              _age(w.written_age) + " ago")
             for w in sorted(shown, key=lambda w: w.lane)],
        )  # fmt: skip
        if len(busy) > max_lanes:
            out.append(f"  (busiest {max_lanes} of {len(busy)} lanes shown)")
    return out


def _render_health(status: Status) -> list[str]:
    """TABLES (tuples, size, last vacuum) and the horizon's oldest holder."""
    out = [f"TABLES  {len(status.tables)}"]
    if status.tables:
        out += _table(
            ("TABLE", "LIVE", "DEAD", "SIZE", "LAST VACUUM"),
            [(t.table, f"{t.live_tuples:,}", f"{t.dead_tuples:,}", _size(t.size_bytes),
              _age((status.taken_at - t.last_vacuum).total_seconds()) + " ago"
              if t.last_vacuum else "never")
             for t in status.tables],
        )  # fmt: skip
    holder = status.horizon
    out.append(
        "HORIZON  nothing holds it back"
        if holder is None
        else f"HORIZON  oldest holder: {holder.describe()}"
    )
    return out


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
