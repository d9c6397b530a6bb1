"""The advisory locks behind lanes: register a relay, take and give back lanes, read who holds what.

Invariant: every lock here is session-level and lives on the relay's own session connection: it
survives transaction ends and vanishes with the session, so a relay that dies frees its lanes
at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from outbox._core.lanes import (
    KIND_IDLE,
    KIND_LANE,
    KIND_LANES,
    KIND_MEMBER,
    LockRow,
    RelayInfo,
    namespace,
    ownership_from_locks,
)


def idle_probe_sql(schema: str | None) -> str:
    """SQL answering "is some relay of ``schema`` waiting for work?" without waiting itself.

    It tries the ``idle`` lock in exclusive mode for the length of its own transaction: that
    fails exactly while some relay holds it in shared mode (or, for microseconds, while another
    probe holds it: then the answer is a harmless yes).
    """
    return f"SELECT NOT pg_try_advisory_xact_lock({namespace(schema, KIND_IDLE)}, 0)"


RELAY_LOCKS_READ = sa.text(
    """
    SELECT l.pid, l.classid::bigint AS classid, l.objid::bigint AS objid
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint = ANY(:namespaces)
    """
)
RELAY_SESSIONS_READ = sa.text(
    "SELECT pid, application_name, client_addr::text AS client_addr "
    "FROM pg_stat_activity WHERE pid = ANY(:pids)"
)
RELAY_BACKEND_PID = sa.text("SELECT pg_backend_pid()")
RELAY_MEMBER_LOCK = sa.text("SELECT pg_advisory_lock(:ns, :pid)")
RELAY_LANE_COUNT_LOCK = sa.text("SELECT pg_advisory_lock_shared(:ns, :lanes)")
LANE_TRY_LOCK = sa.text(
    "SELECT lane FROM unnest(CAST(:lanes AS integer[])) AS lane "
    "WHERE pg_try_advisory_lock(:ns, lane)"
)
RELAY_IDLE_LOCK = sa.text("SELECT pg_advisory_lock_shared(:ns, 0)")
RELAY_IDLE_UNLOCK = sa.text("SELECT pg_advisory_unlock_shared(:ns, 0)")
LANE_UNLOCK = sa.text(
    "SELECT pg_advisory_unlock(:ns, lane) FROM unnest(CAST(:lanes AS integer[])) AS lane"
)


def read_locks(connection: sa.Connection, schema: str | None) -> list[LockRow]:
    """The granted relay advisory locks of ``schema`` in the current database."""
    namespaces = [namespace(schema, k) for k in (KIND_MEMBER, KIND_LANES, KIND_LANE)]
    result = connection.execute(RELAY_LOCKS_READ, {"namespaces": namespaces})
    return [LockRow(int(r.pid), int(r.classid), int(r.objid)) for r in result]


def relay_ownership(connection: sa.Connection, schema: str | None) -> list[RelayInfo]:
    """Live relays of ``schema`` and the lanes each holds (for ``outbox status``)."""
    owners = ownership_from_locks(read_locks(connection, schema), schema)
    if not owners:
        return []
    rows = connection.execute(RELAY_SESSIONS_READ, {"pids": list(owners)})
    names = {int(r.pid): (r.application_name or "", r.client_addr) for r in rows}
    return [
        RelayInfo(pid, names.get(pid, ("", None))[0], names.get(pid, ("", None))[1], lanes)
        for pid, lanes in owners.items()
    ]


def register(connection: sa.Connection, schema: str | None, lanes: int) -> int:
    """Announce this session as a live relay serving ``lanes`` lanes; returns its backend pid."""
    pid = int(connection.execute(RELAY_BACKEND_PID).scalar_one())
    connection.execute(RELAY_MEMBER_LOCK, {"ns": namespace(schema, KIND_MEMBER), "pid": pid})
    connection.execute(RELAY_LANE_COUNT_LOCK, {"ns": namespace(schema, KIND_LANES), "lanes": lanes})
    return pid


def try_acquire(connection: sa.Connection, schema: str | None, lanes: Sequence[int]) -> list[int]:
    """Try to take each lane in ``lanes`` without waiting; returns those now held."""
    if not lanes:
        return []
    result = connection.execute(
        LANE_TRY_LOCK, {"lanes": list(lanes), "ns": namespace(schema, KIND_LANE)}
    )
    return sorted(int(r.lane) for r in result)


def release(connection: sa.Connection, schema: str | None, lanes: Sequence[int]) -> None:
    """Give lanes back (between batches, never while a claim is open)."""
    if not lanes:
        return
    connection.execute(LANE_UNLOCK, {"lanes": list(lanes), "ns": namespace(schema, KIND_LANE)})


def announce_idle(connection: sa.Connection, schema: str | None, idle: bool) -> None:
    """Start (``idle``) or stop waiting for work: hold or give back the shared ``idle`` lock.

    Writers send a wake-up only while some relay holds it. A relay takes it and then claims once
    more before it waits: a commit that probed before the lock was taken is visible to that
    claim, and one that probed after it sends a wake-up.
    """
    statement = RELAY_IDLE_LOCK if idle else RELAY_IDLE_UNLOCK
    connection.execute(statement, {"ns": namespace(schema, KIND_IDLE)})
