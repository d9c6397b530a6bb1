"""The relay fleet's locks and discovery in PostgreSQL (the decisions: :mod:`outbox._core.fleet`).

* membership: ``(fleet-member namespace, member key)`` held by every running member on its
  session to the membership database, read back from ``pg_locks`` of that database;
* ownership: ``(fleet-owner namespace, 0)`` held in each database by the one process that
  serves it, on its relay's own session (taken before the relay registers for lanes, so that
  it goes with that session: a killed process frees it at once);
* discovery: the databases of one server whose names match a ``LIKE`` pattern.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from outbox._core.fleet import member_namespace, owner_namespace

_LOCKS_OF = """
SELECT l.objid::bigint FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def member_join(connection: Any, schema: str | None, key: int) -> bool:
    """Take this member's lock on ``connection`` (a driver connection in autocommit); false
    while another live session holds it (a second process with the same member id)."""
    row = connection.execute(
        "SELECT pg_try_advisory_lock(%s, %s)", (member_namespace(schema), key)
    ).fetchone()
    return bool(row and row[0])


def live_members(connection: Any, schema: str | None) -> set[int]:
    """The member keys whose lock some session of this database holds."""
    rows = connection.execute(_LOCKS_OF, (member_namespace(schema),)).fetchall()
    return {int(r[0]) for r in rows}


def owner_try(conn: sa.Connection, schema: str | None) -> bool:
    """Try to take the serving lock of this database on the relay's session ``conn`` (and end
    the transaction the statement opened); true once held."""
    held = conn.exec_driver_sql(
        "SELECT pg_try_advisory_lock(%s, 0)", (owner_namespace(schema),)
    ).scalar_one()
    conn.commit()
    return bool(held)


def owner_pid(conn: sa.Connection, schema: str | None) -> int | None:
    """The backend pid of the session serving this database, if one does."""
    pid = conn.exec_driver_sql(
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.classid = %s "
        "AND l.objid = 0 AND l.objsubid = 2 AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (owner_namespace(schema),),
    ).scalar()
    return None if pid is None else int(pid)


def discover_databases(connection: Any, pattern: str) -> list[str]:
    """Names of the databases on ``connection``'s server that match the ``LIKE`` ``pattern``
    and accept connections (templates left out), in name order."""
    rows = connection.execute(
        "SELECT datname FROM pg_database WHERE datname LIKE %s AND datallowconn "
        "AND NOT datistemplate ORDER BY datname",
        (pattern,),
    ).fetchall()
    return [str(r[0]) for r in rows]
