"""``outbox status`` over many databases (a relay fleet's): each database's backlog, parked
rows, oldest pending event and the relay session serving it, the unhealthy databases first.

Each database is read on its own connection, in its own read-only snapshot
(:func:`outbox.admin._status.read_status`); one that cannot be read is reported as down or
unmigrated with the reason, and the others are read all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox._core.durations import format_duration
from outbox._core.fleet import parse_databases_file
from outbox._core.redact import one_line
from outbox._pg import fleet as pg_fleet
from outbox._pg.errors import is_database_error
from outbox.admin._status import read_status
from outbox.config import normalize_database_url
from outbox.errors import OutboxError

# Seconds a database may take to answer the connection before it counts as down.
CONNECT_TIMEOUT = 10


@dataclass(frozen=True)
class DatabaseStatus:
    """One database of a fleet, as ``outbox status`` shows it."""

    database: str  # host:port/name
    state: str  # ok | unserved | down | unmigrated
    pending: int = 0
    parked: int = 0
    oldest_pending_age: float | None = None
    owner: str | None = None  # the session holding the serving lock: "pid N (address)"
    relays: int = 0
    error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.state == "ok" and self.parked == 0


def identity_of(url: str) -> str:
    """``host:port/name`` of a database URL (as the fleet names it)."""
    parsed = sa.make_url(url)
    return f"{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database or ''}"


def fleet_urls(
    database_urls: Iterable[str],
    databases_file: str | None = None,
    discover_url: str | None = None,
    discover_pattern: str | None = None,
) -> list[str]:
    """The databases a fleet with these sources would serve (one URL per database)."""
    urls = [normalize_database_url(u) for u in database_urls]
    if databases_file is not None:
        try:
            text = Path(databases_file).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise OutboxError(f"cannot read --databases-file {databases_file!r}: {exc}") from exc
        urls += [normalize_database_url(u) for u in parse_databases_file(text)]
    if discover_url is not None and discover_pattern is not None:
        base = normalize_database_url(discover_url)
        engine = sa.create_engine(
            base, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": CONNECT_TIMEOUT}
        )
        try:
            with engine.connect() as conn:
                raw = conn.connection.driver_connection
                names = pg_fleet.discover_databases(raw, discover_pattern)
                conn.rollback()
        finally:
            engine.dispose()
        parsed = sa.make_url(base)
        urls += [parsed.set(database=name).render_as_string(hide_password=False) for name in names]
    seen: dict[str, str] = {}
    for url in urls:
        seen.setdefault(identity_of(url), url)
    return list(seen.values())


def read_database_status(url: str, schema: str | None = None) -> DatabaseStatus:
    """The status of one database (never raises for a database that is down or unmigrated)."""
    identity = identity_of(url)
    engine = sa.create_engine(
        url,
        poolclass=sa.pool.NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT, "application_name": "outbox status"},
    )
    try:
        with engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn:
            try:
                status = read_status(conn, schema)
            except OutboxError as exc:
                return DatabaseStatus(identity, "unmigrated", error=str(exc))
            owner_pid = pg_fleet.owner_pid(conn, schema)
            conn.rollback()
    except Exception as exc:
        if not (is_database_error(exc) or isinstance(exc, OSError)):
            raise
        return DatabaseStatus(identity, "down", error=one_line(exc, urls=[url], with_type=False))
    finally:
        with contextlib.suppress(Exception):
            engine.dispose()
    owner = None
    if owner_pid is not None:
        address = next((r.client_addr for r in status.relays if r.pid == owner_pid), None)
        owner = f"pid {owner_pid}" + (f" ({address})" if address else "")
    pending = sum(t.pending for t in status.topics)
    return DatabaseStatus(
        identity,
        "ok" if status.relays else "unserved",
        pending=pending,
        parked=sum(t.parked for t in status.topics),
        oldest_pending_age=status.oldest_pending_age,
        owner=owner,
        relays=len(status.relays),
    )


_STATE_ORDER = {"down": 0, "unmigrated": 1, "unserved": 2, "ok": 3}


def unhealthy_first(statuses: Iterable[DatabaseStatus]) -> list[DatabaseStatus]:
    """Down, unmigrated and unserved databases first, then those with parked rows, then the
    oldest pending events and the largest backlogs; by name within each."""
    return sorted(
        statuses,
        key=lambda s: (
            _STATE_ORDER.get(s.state, 0),
            s.parked == 0,
            -(s.oldest_pending_age or 0.0),
            -s.pending,
            s.database,
        ),
    )


def read_fleet_status(urls: Sequence[str], schema: str | None = None) -> list[DatabaseStatus]:
    """Every database's status, the unhealthy ones first."""
    return unhealthy_first(read_database_status(url, schema) for url in urls)


def render_fleet_status(statuses: Sequence[DatabaseStatus]) -> str:
    """The table ``outbox status`` prints for many databases."""
    bad = [s for s in statuses if not s.healthy]
    head = f"databases: {len(statuses)}, unhealthy: {len(bad)}"
    if bad:
        more = ", ..." if len(bad) > 5 else ""
        head += f" ({', '.join(s.database for s in bad[:5])}{more})"
    width = max([len("database"), *(len(s.database) for s in statuses)])
    lines = [
        head,
        "",
        f"{'database':<{width}} {'state':<10} {'pending':>8} {'parked':>7} {'oldest':>9}  owner",
    ]
    for s in statuses:
        oldest = "-" if s.oldest_pending_age is None else format_duration(s.oldest_pending_age)
        tail = s.owner or "-"
        if s.error:
            tail = s.error
        lines.append(
            f"{s.database:<{width}} {s.state:<10} {s.pending:>8} {s.parked:>7} {oldest:>9}  {tail}"
        )
    return "\n".join(lines)


def fleet_status_to_json(statuses: Sequence[DatabaseStatus]) -> dict[str, Any]:
    """The ``--json`` form (format 1) of a fleet's status."""
    return {
        "format": 1,
        "databases": [
            {
                "database": s.database,
                "state": s.state,
                "healthy": s.healthy,
                "pending": s.pending,
                "parked": s.parked,
                "oldest_pending_age_seconds": s.oldest_pending_age,
                "owner": s.owner,
                "relays": s.relays,
                "error": s.error,
            }
            for s in statuses
        ],
        "unhealthy": sum(1 for s in statuses if not s.healthy),
    }


__all__ = [
    "DatabaseStatus",
    "fleet_status_to_json",
    "fleet_urls",
    "identity_of",
    "read_database_status",
    "read_fleet_status",
    "render_fleet_status",
    "unhealthy_first",
]
