"""Operator commands: ``outbox status`` and ``outbox gc``.

``status`` answers "is the pipeline healthy?" from PostgreSQL alone: the outbox backlog per topic
and per lane, the oldest pending row, parked rows, idempotency keys by status, and the live
relays with the lanes they hold (read from their advisory locks, see :mod:`outbox.lanes`).

``gc`` deletes idempotency keys older than the retention, in short batches that skip rows another
transaction has locked, so it never blocks live units of work. It refuses a retention that would
let a duplicate run twice: one shorter than the Redis cache TTL, or shorter than the window in
which a broker can still redeliver a message (see :func:`check_retention`).

The duration parser, the retention check and the report builders are pure functions; the SQL
helpers take a SQLAlchemy ``Connection``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import IO, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from outbox import lanes as lanes_mod
from outbox.config import (
    DEFAULT_CACHE_TTL_SECONDS,
    ENV_DATABASE_URL,
    env,
    env_int,
    normalize_database_url,
    redact_url,
)
from outbox.errors import ConfigurationError, OutboxError, RetentionError

# The relay's variable: status must split the backlog into lanes the way the relays do.
from outbox.relay import ENV_LANES
from outbox.schema import (
    IDEMPOTENCY_KEYS,
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_STARTED,
    tables,
    validate_schema_name,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_RETENTION_REFUSED = 3

ENV_RETENTION = "OUTBOX_RETENTION"
ENV_CACHE_TTL = "OUTBOX_CACHE_TTL"
ENV_MIN_REDELIVERY_WINDOW = "OUTBOX_MIN_REDELIVERY_WINDOW"
ENV_GC_BATCH_SIZE = "OUTBOX_GC_BATCH_SIZE"

# Kafka's default log retention (log.retention.hours=168): a consumer group that lost its
# committed offsets and starts from the earliest record re-reads up to this far back.
DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS = 7 * 24 * 3600.0
DEFAULT_GC_BATCH_SIZE = 5000
MAX_GC_BATCH_SIZE = 100_000
JSON_FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------
# Pure helpers: durations and the retention rule
# --------------------------------------------------------------------------------------------

_UNITS = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?[wdhms])+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``7d``, ``36h``, ``90m``, ``1d12h`` or ``1.5h``.

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``m`` minutes, ``s`` seconds; parts add up.
    A bare number is seconds (what ``OutboxConfig.cache_ttl`` holds). The result must be
    positive. Raises :class:`ConfigurationError` with the accepted forms otherwise.
    """
    cleaned = text.strip().lower().replace(" ", "") if isinstance(text, str) else ""
    if _NUMBER.match(cleaned):
        seconds = float(cleaned)
    elif _DURATION.match(cleaned):
        seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(cleaned))
    else:
        raise ConfigurationError(
            f"invalid duration {text!r}: use a number with a unit, e.g. 7d, 36h, 90m, 45s or "
            "1d12h (w=weeks, d=days, h=hours, m=minutes, s=seconds)"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"invalid duration {text!r}: it must be longer than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """A compact, readable duration: ``7d``, ``1d12h``, ``90m`` -> ``1h30m``, ``2.5s``.

    Whole seconds are split into d/h/m/s parts; a fraction is kept on the seconds.
    """
    if seconds < 0:
        return "-" + format_duration(-seconds)
    whole = int(seconds)
    fraction = seconds - whole
    if whole < 60:
        value = seconds if fraction else whole
        return f"{value:.3g}s" if fraction else f"{value}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def check_retention(older_than: float, cache_ttl: float, min_redelivery_window: float) -> None:
    """Refuse a gc retention under which a duplicate could run its effects twice.

    * It must be **longer than the Redis cache TTL**: otherwise the cache would still answer
      for keys PostgreSQL has forgotten, and whether a duplicate replays or runs again would
      depend on which copy it meets (and, after the cache entry expires, it runs again).
      ``OutboxConfig.validate()`` holds ``retention`` to the same rule.
    * It must be **at least the minimum redelivery window**: a broker can redeliver a message
      that long after it was first handled (a consumer restarting from old offsets, a replay);
      if its key is already gone, the duplicate runs twice.
    """
    if older_than <= cache_ttl:
        raise RetentionError(
            f"refusing --older-than {format_duration(older_than)}: it must be longer than the "
            f"Redis cache TTL ({format_duration(cache_ttl)}, --cache-ttl / {ENV_CACHE_TTL}). "
            "Redis would still answer for keys PostgreSQL had forgotten, so a duplicate could "
            "run twice once the cache entry expires. Use a longer --older-than, or lower "
            "--cache-ttl if the application's OutboxConfig.cache_ttl really is shorter."
        )
    if older_than < min_redelivery_window:
        raise RetentionError(
            f"refusing --older-than {format_duration(older_than)}: it is shorter than the "
            f"minimum redelivery window ({format_duration(min_redelivery_window)}, "
            f"--min-redelivery-window / {ENV_MIN_REDELIVERY_WINDOW}). A message redelivered "
            "after its key was deleted would run twice. Use a longer --older-than, or lower "
            "--min-redelivery-window if no broker can redeliver that late (e.g. a shorter "
            "topic retention)."
        )


def format_ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7, 9, 10]`` -> ``0-3,7,9-10`` (``-`` when empty)."""
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


# --------------------------------------------------------------------------------------------
# outbox status
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
    relays: tuple[lanes_mod.RelayInfo, ...]
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
            raise ConfigurationError(f"{ENV_LANES}={env_value!r} is not an integer") from exc
        source = "env"
    else:
        counts = sorted(set(announced))
        if len(counts) == 1:
            return counts[0], "relays"
        return lanes_mod.DEFAULT_LANES, "default"
    if not 1 <= lanes <= lanes_mod.MAX_LANES:
        raise ConfigurationError(
            f"--lanes must be between 1 and {lanes_mod.MAX_LANES}, got {lanes}"
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
    from outbox import migrate

    schema = validate_schema_name(schema)
    revision = migrate.current_revision(connection, schema)
    if revision is None:
        raise OutboxError(
            f"no outbox tables in schema {schema or 'public'}: run `outbox migrate` first"
        )
    t = tables(schema)
    o, k = t.outbox, t.idempotency_keys
    pending = o.c.parked_at.is_(None)
    parked = o.c.parked_at.is_not(None)
    taken_at = connection.execute(sa.select(sa.func.now())).scalar_one()
    locks = lanes_mod.read_locks(connection, schema)
    announced = tuple(sorted(lanes_mod.configured_lane_counts(locks, schema)))
    lanes, source = choose_lanes(lanes_flag, lanes_env, announced)
    age = sa.extract("epoch", sa.func.now() - sa.func.min(o.c.created_at).filter(pending))

    topics = tuple(
        TopicBacklog(r.topic, int(r.pending), int(r.parked), _float(r.age))
        for r in connection.execute(
            sa.select(
                o.c.topic,
                sa.func.count().filter(pending).label("pending"),
                sa.func.count().filter(parked).label("parked"),
                age.label("age"),
            )
            .group_by(o.c.topic)
            .order_by(o.c.topic)
        )
    )
    per_row = sa.select(
        (o.c.key_hash % sa.literal(lanes, sa.Integer)).label("lane"),
        o.c.parked_at,
    ).subquery()
    lane_backlog = tuple(
        LaneBacklog(int(r.lane), int(r.pending), int(r.parked))
        for r in connection.execute(
            sa.select(
                per_row.c.lane,
                sa.func.count().filter(per_row.c.parked_at.is_(None)).label("pending"),
                sa.func.count().filter(per_row.c.parked_at.is_not(None)).label("parked"),
            )
            .group_by(per_row.c.lane)
            .order_by(per_row.c.lane)
        )
    )
    oldest = connection.execute(sa.select(age)).scalar_one()
    keys = tuple(
        ScopeKeys(r.scope, r.status, int(r.n))
        for r in connection.execute(
            sa.select(k.c.scope, k.c.status, sa.func.count().label("n"))
            .group_by(k.c.scope, k.c.status)
            .order_by(k.c.scope, k.c.status)
        )
    )
    # min(updated_at) is answered from ix_idempotency_keys_updated_at.
    oldest_key = connection.execute(
        sa.select(sa.extract("epoch", sa.func.now() - sa.func.min(k.c.updated_at)))
    ).scalar_one()
    relays = tuple(
        replace(r, client_addr=_host(r.client_addr))
        for r in lanes_mod.relay_ownership(connection, schema)
    )
    from outbox.migrate import head_revision

    status = Status(
        schema=schema,
        revision=revision,
        head_revision=head_revision(),
        lanes=lanes,
        lanes_source=source,
        relay_lane_counts=announced,
        topics=topics,
        lane_backlog=lane_backlog,
        oldest_pending_age=_float(oldest),
        keys=keys,
        oldest_key_age=_float(oldest_key),
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


def _float(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


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
# outbox gc
# --------------------------------------------------------------------------------------------

# Each batch locks at most `limit` old rows, skipping any row a live transaction holds, and
# deletes exactly those by ctid (a TID scan), in its own short transaction.
IDEMPOTENCY_KEYS_GC_BATCH = """
DELETE FROM {keys}
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {keys}
    WHERE updated_at < :cutoff {scope_filter}
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
))
AND updated_at < :cutoff
"""

IDEMPOTENCY_KEYS_GC_COUNT = "SELECT count(*) FROM {keys} WHERE updated_at < :cutoff {scope_filter}"

_SCOPE_FILTER = "AND scope = :scope"

# Wait at most this long for a table lock (e.g. behind a migration) instead of queueing and
# making every unit of work queue behind gc.
_GC_LOCK_TIMEOUT = "2s"


def _qualified_keys(schema: str | None) -> str:
    preparer = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
    schema = validate_schema_name(schema)
    name = str(preparer.quote(IDEMPOTENCY_KEYS))
    return name if schema is None else f"{preparer.quote_schema(schema)}.{name}"


def _gc_sql(template: str, schema: str | None, scope: str | None) -> sa.TextClause:
    return sa.text(
        template.format(keys=_qualified_keys(schema), scope_filter=_SCOPE_FILTER if scope else "")
    )


def gc_cutoff(connection: sa.Connection, older_than: float) -> datetime:
    """The database's ``now() - older_than`` (the database clock decides, like ``updated_at``)."""
    value = connection.execute(
        sa.text("SELECT now() - make_interval(secs => :s)"), {"s": older_than}
    ).scalar_one()
    assert isinstance(value, datetime)
    return value


def count_expired_keys(
    connection: sa.Connection, cutoff: datetime, schema: str | None = None, scope: str | None = None
) -> int:
    """Idempotency keys last updated before ``cutoff``."""
    params: dict[str, Any] = {"cutoff": cutoff, "scope": scope}
    sql = _gc_sql(IDEMPOTENCY_KEYS_GC_COUNT, schema, scope)
    return int(connection.execute(sql, params).scalar_one())


@dataclass(frozen=True)
class GcResult:
    cutoff: datetime
    candidates: int
    deleted: int
    batches: int
    seconds: float
    dry_run: bool


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
    if not 1 <= batch_size <= MAX_GC_BATCH_SIZE:
        raise ConfigurationError(
            f"--batch-size must be between 1 and {MAX_GC_BATCH_SIZE}, got {batch_size}"
        )
    sql = _gc_sql(IDEMPOTENCY_KEYS_GC_BATCH, schema, scope)
    params: dict[str, Any] = {"cutoff": cutoff, "limit": batch_size, "scope": scope}
    deleted = batches = 0
    while max_batches is None or batches < max_batches:
        with engine.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL lock_timeout = '{_GC_LOCK_TIMEOUT}'"))
            n = int(conn.execute(sql, params).rowcount)
        batches += 1
        deleted += n
        if progress is not None:
            progress(deleted, n)
        if n < batch_size:
            break
    return deleted, batches


class Progress:
    """A progress bar on a terminal, plain lines (at most one a second) otherwise."""

    def __init__(self, total: int, stream: IO[str], tty: bool | None = None, width: int = 30):
        self.total = total
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.width = width
        self.started = time.monotonic()
        self._last_line = 0.0

    def line(self, done: int) -> str:
        """The text shown for ``done`` of :attr:`total` (pure; tested)."""
        total = max(self.total, done)
        fraction = done / total if total else 1.0
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = done / elapsed
        if self.tty:
            filled = round(fraction * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            return f"[{bar}] {fraction:4.0%}  {done:,}/{total:,} keys  {rate:,.0f}/s"
        return f"gc: deleted {done:,} of {total:,} keys ({fraction:.0%}, {rate:,.0f}/s)"

    def update(self, done: int, _batch: int = 0) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done))
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last_line >= 1.0:
            self._last_line = now
            print(self.line(done), file=self.stream, flush=True)

    def finish(self, done: int) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done) + "\n")
        else:
            print(self.line(done), file=self.stream)
        self.stream.flush()


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
    progress_stream: IO[str] | None = None,
) -> GcResult:
    """Check the retention, count the expired keys, then (unless ``dry_run``) delete them."""
    check_retention(older_than, cache_ttl, min_redelivery_window)
    started = time.monotonic()
    with engine.connect() as conn:
        cutoff = gc_cutoff(conn, older_than)
        candidates = count_expired_keys(conn, cutoff, schema, scope)
    if dry_run or candidates == 0:
        return GcResult(cutoff, candidates, 0, 0, time.monotonic() - started, dry_run)
    bar = Progress(candidates, progress_stream) if progress_stream is not None else None
    deleted, batches = delete_expired_keys(
        engine,
        cutoff,
        schema=schema,
        scope=scope,
        batch_size=batch_size,
        progress=bar.update if bar is not None else None,
    )
    if bar is not None:
        bar.finish(deleted)
    return GcResult(cutoff, candidates, deleted, batches, time.monotonic() - started, dry_run)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _engine(args: argparse.Namespace) -> sa.Engine:
    from outbox.cli_old import require

    url = normalize_database_url(require(args.database_url, "--database-url", ENV_DATABASE_URL))
    return sa.create_engine(
        url,
        poolclass=sa.pool.NullPool,
        connect_args={"application_name": f"outbox {args.command}", "connect_timeout": 10},
    )


def _cmd_status(args: argparse.Namespace) -> int:
    if args.log_level != "DEBUG":  # alembic's version lookup logs at INFO; not news here
        logging.getLogger("alembic").setLevel(logging.WARNING)
    engine = _engine(args)
    try:
        # One snapshot, read-only: every number in the report is from the same moment.
        with engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn:
            status = read_status(conn, args.schema, lanes_flag=args.lanes, lanes_env=env(ENV_LANES))
            conn.rollback()
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(status_to_json(status, args.database_url), indent=2))
    else:
        print(render_status(status, args.database_url))
    return EXIT_OK


def _duration_arg(value: str | None, flag: str, env_name: str, default: float | None) -> float:
    if value is None:
        value = env(env_name)
    if value is None:
        if default is None:
            raise ConfigurationError(f"{flag} is required (or set {env_name}), e.g. {flag} 7d")
        return default
    try:
        return parse_duration(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{flag}: {exc}") from exc


def _cmd_gc(args: argparse.Namespace) -> int:
    older_than = _duration_arg(args.older_than, "--older-than", ENV_RETENTION, None)
    cache_ttl = _duration_arg(
        args.cache_ttl, "--cache-ttl", ENV_CACHE_TTL, DEFAULT_CACHE_TTL_SECONDS
    )
    window = _duration_arg(
        args.min_redelivery_window,
        "--min-redelivery-window",
        ENV_MIN_REDELIVERY_WINDOW,
        DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    )
    batch_size = args.batch_size
    if batch_size is None:
        batch_size = env_int(ENV_GC_BATCH_SIZE, DEFAULT_GC_BATCH_SIZE)
    if not 1 <= batch_size <= MAX_GC_BATCH_SIZE:
        raise ConfigurationError(
            f"--batch-size must be between 1 and {MAX_GC_BATCH_SIZE}, got {batch_size}"
        )
    try:
        check_retention(older_than, cache_ttl, window)
    except RetentionError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return EXIT_RETENTION_REFUSED
    engine = _engine(args)
    try:
        result = run_gc(
            engine,
            older_than,
            cache_ttl=cache_ttl,
            min_redelivery_window=window,
            schema=validate_schema_name(args.schema),
            scope=args.scope,
            batch_size=batch_size,
            dry_run=args.dry_run,
            progress_stream=None if args.json else sys.stderr,
        )
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(gc_to_json(result, older_than), indent=2))
    elif result.dry_run:
        print(
            f"dry run: {result.candidates:,} idempotency keys last updated before "
            f"{result.cutoff.isoformat(timespec='seconds')} would be deleted"
        )
    else:
        print(
            f"deleted {result.deleted:,} idempotency keys last updated before "
            f"{result.cutoff.isoformat(timespec='seconds')} in {result.batches} batches "
            f"({result.seconds:.1f}s)"
        )
    return EXIT_OK


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


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``outbox status`` and ``outbox gc``."""
    from outbox.cli_old import add_database_url, add_log_level

    p = subparsers.add_parser(
        "status",
        help="backlog per topic and lane, parked rows, keys by status, live relays",
        description="Read-only report of the outbox, idempotency keys and live relays. "
        "Exit codes: 0 report printed, 1 database error or tables missing, 2 bad usage.",
    )
    add_database_url(p)
    add_log_level(p)
    p.add_argument(
        "--lanes",
        type=int,
        default=None,
        help=f"lane count to split the backlog by (env {ENV_LANES}, the relay's; default: "
        f"what live relays use, else {lanes_mod.DEFAULT_LANES})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (format 1)")
    p.set_defaults(func=_cmd_status)

    p = subparsers.add_parser(
        "gc",
        help="delete idempotency keys older than the retention, in small batches",
        description="Delete idempotency keys whose updated_at is older than --older-than, "
        "in short batches that skip locked rows (live units of work never wait). Exit codes: "
        f"0 done, 1 database error, 2 bad usage, {EXIT_RETENTION_REFUSED} retention refused "
        "(shorter than the cache TTL or the minimum redelivery window).",
    )
    add_database_url(p)
    add_log_level(p)
    p.add_argument(
        "--older-than",
        metavar="DURATION",
        default=None,
        help=f"delete keys last updated longer ago than this, e.g. 7d, 36h, 90m (env "
        f"{ENV_RETENTION}; required)",
    )
    p.add_argument(
        "--cache-ttl",
        metavar="DURATION",
        default=None,
        help=f"the applications' Redis cache TTL (OutboxConfig.cache_ttl); --older-than must "
        f"be longer (env {ENV_CACHE_TTL}; default {format_duration(DEFAULT_CACHE_TTL_SECONDS)})",
    )
    p.add_argument(
        "--min-redelivery-window",
        metavar="DURATION",
        default=None,
        help=f"how late a broker may redeliver a message; --older-than must be at least this "
        f"(env {ENV_MIN_REDELIVERY_WINDOW}; default "
        f"{format_duration(DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS)}, Kafka's default retention)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"keys deleted per transaction (env {ENV_GC_BATCH_SIZE}; default "
        f"{DEFAULT_GC_BATCH_SIZE})",
    )
    p.add_argument("--scope", default=None, help="only keys of this scope (default: all)")
    p.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress)")
    p.set_defaults(func=_cmd_gc)
