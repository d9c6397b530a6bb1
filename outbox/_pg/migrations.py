"""The SQL around ``outbox migrate``: a step's lock timeout, and who held the lock it waited for.

Invariant: values travel as bound parameters; the lock timeout is an integer of milliseconds
checked by the caller, so ``SET LOCAL`` (which takes no parameters) is given only digits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import psycopg
import sqlalchemy as sa

LOCK_NOT_AVAILABLE = "55P03"


def set_lock_timeout(connection: sa.Connection, milliseconds: int) -> None:
    """Every statement of the connection's current transaction waits at most ``milliseconds``
    for a lock."""
    if type(milliseconds) is not int or milliseconds <= 0:
        raise ValueError(f"lock timeout: a positive integer of milliseconds, got {milliseconds!r}")
    connection.execute(sa.text(f"SET LOCAL lock_timeout = {milliseconds}"))


def is_lock_timeout(exc: BaseException) -> bool:
    """True for a statement that gave up waiting for a lock (``lock_timeout``)."""
    origin = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    return isinstance(origin, psycopg.Error) and origin.sqlstate == LOCK_NOT_AVAILABLE


@dataclass(frozen=True)
class Blocker:
    """A session that held a lock on one of the toolkit's tables through a whole wait."""

    pid: int
    application_name: str
    state: str
    user: str
    transaction_seconds: float
    locks: str

    def describe(self) -> str:
        return (
            f"pid {self.pid} (application_name {self.application_name or '-'!r}, user "
            f"{self.user or '-'!r}, state {self.state or '-'!r}, transaction open "
            f"{self.transaction_seconds:.1f} s, holding {self.locks})"
        )


def lock_blockers(
    connection: sa.Connection, schema: str | None, tables: Iterable[str], held_seconds: float
) -> list[Blocker]:
    """Other sessions whose transaction has been open at least ``held_seconds`` and holds a
    granted lock on one of ``tables`` (in ``schema``, default the current one), oldest first.

    A session that kept a migration waiting through its whole lock timeout opened its
    transaction before the wait began: younger transactions (writers that came and went) are
    left out.
    """
    rows = connection.execute(
        sa.text(
            "SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.state, ''),"
            " coalesce(a.usename::text, ''),"
            " extract(epoch FROM clock_timestamp() - a.xact_start)::float8,"
            " string_agg(DISTINCT l.mode || ' on ' || c.relname, ', ')"
            " FROM pg_locks l"
            " JOIN pg_class c ON c.oid = l.relation"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.granted AND l.pid <> pg_backend_pid()"
            " AND n.nspname = coalesce(CAST(:schema AS text), current_schema())"
            " AND c.relname = ANY(CAST(:tables AS text[]))"
            " AND a.xact_start <= clock_timestamp() - make_interval(secs => :held)"
            " GROUP BY a.pid, a.application_name, a.state, a.usename, a.xact_start"
            " ORDER BY a.xact_start LIMIT 5"
        ),
        {"schema": schema, "tables": sorted(tables), "held": held_seconds},
    ).all()
    return [Blocker(int(r[0]), r[1], r[2], r[3], float(r[4] or 0.0), r[5]) for r in rows]
