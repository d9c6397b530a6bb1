"""Operations: the status of the pipeline and the clean-up of old idempotency keys.

:func:`read_status` answers "is the pipeline healthy?" from PostgreSQL alone: the outbox
backlog per topic and per lane, the oldest pending row, parked rows, idempotency keys by status,
and the live relays with the lanes they hold (read from their advisory locks, see
:mod:`outbox.lanes`).

:func:`run_gc` deletes idempotency keys older than the retention, in short batches that skip
rows another transaction has locked, so it never blocks live units of work. It refuses a
retention that would let a duplicate run twice (see
:func:`~outbox._core.durations.check_retention`).

A library: the ``outbox status`` and ``outbox gc`` commands (:mod:`outbox.cli.status`,
:mod:`outbox.cli.gc`) print what these functions return.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox import migrate
from outbox._core import lanes as lanes_core
from outbox._core.durations import (
    DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS as DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    check_retention,
    format_duration,
    format_ranges,
    parse_duration,
)
from outbox._core.environment import ENV_RELAY_LANES
from outbox._pg import lanes as lanes_pg, operations as ops
from outbox.config import DEFAULT_CACHE_TTL_SECONDS, redact_url
from outbox.errors import ConfigurationError, OutboxError, RetentionError
from outbox.schema import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_STARTED,
    validate_schema_name,
)

__all__ = [
    "GcResult",
    "RetentionError",
    "Status",
    "check_retention",
    "format_duration",
    "format_ranges",
    "parse_duration",
    "read_status",
    "render_status",
    "run_gc",
    "status_to_json",
]

# Kafka's default log retention (log.retention.hours=168): a consumer group that lost its
# committed offsets and starts from the earliest record re-reads up to this far back.
DEFAULT_GC_BATCH_SIZE = 5000
MAX_GC_BATCH_SIZE = 100_000
JSON_FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


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
    if status.parked:
        out.append(
            f"{status.parked} parked rows hold back later rows of their keys: see "
            "`outbox parked list`"
        )
    return out


def read_status(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    lanes_flag: int | None = None,
    lanes_env: str | None = None,
) -> Status:
    """Collect the status of the outbox in ``schema`` (read-only; one snapshot)."""
    schema = validate_schema_name(schema)
    revision = migrate.current_revision(connection, schema)
    if revision is None:
        raise OutboxError(
            f"no outbox tables in schema {schema or 'public'}: run `outbox migrate` first"
        )
    taken_at = ops.database_now(connection)
    locks = lanes_pg.read_locks(connection, schema)
    announced = tuple(sorted(lanes_core.configured_lane_counts(locks, schema)))
    lanes, source = choose_lanes(lanes_flag, lanes_env, announced)
    relays = tuple(
        replace(r, client_addr=_host(r.client_addr))
        for r in lanes_pg.relay_ownership(connection, schema)
    )
    status = Status(
        schema=schema,
        revision=revision,
        head_revision=migrate.head_revision(),
        lanes=lanes,
        lanes_source=source,
        relay_lane_counts=announced,
        topics=tuple(TopicBacklog(*row) for row in ops.outbox_backlog_by_topic(connection, schema)),
        lane_backlog=tuple(
            LaneBacklog(*row) for row in ops.outbox_backlog_by_lane(connection, schema, lanes)
        ),
        oldest_pending_age=ops.outbox_oldest_pending_age(connection, schema),
        keys=tuple(ScopeKeys(*row) for row in ops.idempotency_keys_by_scope(connection, schema)),
        oldest_key_age=ops.idempotency_keys_oldest_update_age(connection, schema),
        relays=relays,
        taken_at=taken_at,
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
        "schema": status.schema or "public",
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
            }
            for r in status.relays
        ],
        "warnings": list(status.warnings),
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
    out.append(
        f"outbox status  {where}schema {status.schema or 'public'}  migration {rev} ({rev_note})"
    )
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
    out.append(f"RELAYS  alive {len(status.relays)}")
    if status.relays:
        out += _table(
            ("PID", "APPLICATION", "CLIENT", "LANES"),
            [(r.pid, r.application_name or "-", r.client_addr or "local", format_ranges(r.lanes))
             for r in status.relays],
        )  # fmt: skip
    if status.warnings:
        out.append("")
        out += [f"warning: {w}" for w in status.warnings]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# gc
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GcResult:
    cutoff: datetime
    candidates: int
    deleted: int
    batches: int
    seconds: float
    dry_run: bool


def gc_cutoff(connection: sa.Connection, older_than: float) -> datetime:
    """The database's ``now() - older_than`` (the database clock decides, like ``updated_at``)."""
    return ops.idempotency_keys_gc_cutoff(connection, older_than)


def count_expired_keys(
    connection: sa.Connection, cutoff: datetime, schema: str | None = None, scope: str | None = None
) -> int:
    """Idempotency keys last updated before ``cutoff``."""
    return ops.idempotency_keys_count_expired(
        connection, cutoff, validate_schema_name(schema), scope
    )


def check_gc_batch_size(batch_size: int) -> int:
    if not 1 <= batch_size <= MAX_GC_BATCH_SIZE:
        raise ConfigurationError(
            f"--batch-size must be between 1 and {MAX_GC_BATCH_SIZE}, got {batch_size}"
        )
    return batch_size


def delete_expired_keys(
    engine: sa.Engine,
    cutoff: datetime,
    *,
    schema: str | None = None,
    scope: str | None = None,
    batch_size: int = DEFAULT_GC_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    max_batches: int | None = None,
) -> tuple[int, int]:
    """Delete keys last updated before ``cutoff``, ``batch_size`` rows per transaction.

    Stops when a batch deletes fewer than ``batch_size`` rows (rows locked by live transactions
    are skipped, not waited for; a later run gets them). ``progress(deleted_so_far, batch)`` is
    called after each committed batch. Returns ``(deleted, batches)``.
    """
    check_gc_batch_size(batch_size)
    schema = validate_schema_name(schema)
    deleted = batches = 0
    while max_batches is None or batches < max_batches:
        n = ops.idempotency_keys_delete_expired_batch(engine, cutoff, schema, scope, batch_size)
        batches += 1
        deleted += n
        if progress is not None:
            progress(deleted, n)
        if n < batch_size:
            break
    return deleted, batches


def run_gc(
    engine: sa.Engine,
    older_than: float,
    *,
    cache_ttl: float = DEFAULT_CACHE_TTL_SECONDS,
    min_redelivery_window: float = DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    schema: str | None = None,
    scope: str | None = None,
    batch_size: int = DEFAULT_GC_BATCH_SIZE,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> GcResult:
    """Check the retention, count the expired keys, then (unless ``dry_run``) delete them.

    ``progress(deleted_so_far, candidates)`` is called after each committed batch.
    """
    check_retention(older_than, cache_ttl, min_redelivery_window)
    started = time.monotonic()
    with engine.connect() as conn:
        cutoff = gc_cutoff(conn, older_than)
        candidates = count_expired_keys(conn, cutoff, schema, scope)
    if dry_run or candidates == 0:
        return GcResult(cutoff, candidates, 0, 0, time.monotonic() - started, dry_run)
    report = progress
    deleted, batches = delete_expired_keys(
        engine,
        cutoff,
        schema=schema,
        scope=scope,
        batch_size=batch_size,
        progress=(lambda done, _batch: report(done, candidates)) if report is not None else None,
    )
    return GcResult(cutoff, candidates, deleted, batches, time.monotonic() - started, dry_run)


def gc_to_json(result: GcResult, older_than: float) -> Mapping[str, Any]:
    """The ``outbox gc --json`` document (format version 1)."""
    return {
        "version": JSON_FORMAT_VERSION,
        "older_than_seconds": older_than,
        "cutoff": result.cutoff.isoformat(),
        "dry_run": result.dry_run,
        "candidates": result.candidates,
        "deleted": result.deleted,
        "batches": result.batches,
        "seconds": round(result.seconds, 3),
    }
