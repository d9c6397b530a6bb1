"""What identifies this database to the Redis cache: the secret and the database's identity.

The cache trusts an entry only when its MAC was made with a key derived from all of these
(:func:`outbox._redis.entry.derive_key`):

* ``outbox_cache_secret.secret`` (random, created by migration 0003): a database created anew
  has another one;
* the cluster's system identifier (``pg_control_system()``), which ``initdb`` chooses: a dump
  carries the secret and a fresh cluster hands out the same OIDs, but restored into a cluster
  of its own the database has another system identifier;
* the timeline the server writes WAL on (the first eight hex digits of the current WAL file's
  name): a promoted standby, and a point-in-time recovery, continue on a new timeline, so a
  database that may have lost the last commits trusts none of the entries written before;
* the database's OID and the OID of its ``idempotency_keys`` table: a database recreated, or
  restored into another database of the same cluster, has other OIDs.

A standby (in recovery) has no timeline of its own to write on and reads ``0``: it trusts
nothing its primary wrote. Copies at the file level that are not promoted (a crash-consistent
snapshot, a base backup started without recovery) keep every part: they are the same database
to the cache.

The unit of work reads the identity once, and again on every new connection its engine opens
(:func:`read_identity`, from the pool's ``connect`` event): a database recreated, restored or
promoted under a running process is noticed when the process reconnects to it.
"""

from __future__ import annotations

import functools
from typing import Any

from outbox._pg.statements import qualified
from outbox.schema import CACHE_SECRET, IDEMPOTENCY_KEYS, validate_schema_name

Identity = tuple[bytes, int, int | None, int, int]


@functools.cache
def cache_identity(schema: str | None) -> tuple[str, dict[str, Any]]:
    """The driver-level statement (and its parameters) that reads the secret and the
    database's identity: one row of ``secret``, ``database_oid``, ``keys_oid``,
    ``system_identifier``, ``timeline``."""
    schema = validate_schema_name(schema)
    statement = (
        "SELECT s.secret, d.oid::bigint AS database_oid, "
        "to_regclass(%(keys)s)::oid::bigint AS keys_oid, "
        "c.system_identifier, "
        "CASE WHEN pg_is_in_recovery() THEN 0 ELSE "
        "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint "
        "END AS timeline "
        f"FROM {qualified(schema, CACHE_SECRET)} AS s, pg_database AS d, "
        "pg_control_system() AS c "
        "WHERE s.id = 1 AND d.datname = current_database()"
    )
    return statement, {"keys": qualified(schema, IDEMPOTENCY_KEYS)}


def identity_of(row: Any) -> Identity:
    """The identity in a row of :func:`cache_identity`'s statement."""
    if row is None:
        raise LookupError("outbox_cache_secret holds no row: run `outbox migrate`")
    secret, database_oid, keys_oid, system_identifier, timeline = row
    return (
        bytes(secret),
        int(database_oid),
        None if keys_oid is None else int(keys_oid),
        int(system_identifier),
        int(timeline),
    )


def for_paramstyle(statement: str, params: dict[str, Any], paramstyle: str) -> tuple[str, Any]:
    """:func:`cache_identity`'s statement and parameters in the driver's ``paramstyle``:
    psycopg's ``%(name)s`` as written, or asyncpg's ``$1`` (``numeric_dollar``)."""
    if paramstyle != "numeric_dollar":
        return statement, params
    return statement.replace("%(keys)s", "$1"), (params["keys"],)


def read_identity(
    dbapi_connection: Any, statement: str, params: dict[str, Any], paramstyle: str = "pyformat"
) -> Identity:
    """Run :func:`cache_identity`'s statement on a new DBAPI connection (psycopg's, or the
    asyncio adapter's sync face inside SQLAlchemy's pool) and leave no transaction open."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(*for_paramstyle(statement, params, paramstyle))
        row = cursor.fetchone()
    finally:
        cursor.close()
        dbapi_connection.rollback()
    return identity_of(row)
