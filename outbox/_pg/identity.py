"""What identifies this database to the Redis cache: the secret and the database's identity.

The cache trusts an entry only when its MAC was made with a key derived from all of these
(:func:`outbox._redis.entry.derive_key`): ``outbox_cache_secret.secret`` (random, created by
migration 0003), the database's OID and the OID of its ``idempotency_keys`` table. A
database created anew has another secret; one restored from a dump into a new database, or
over the old one's tables, has other OIDs: neither trusts what Redis kept of its predecessor.

The unit of work reads the identity once, and again on every new connection its engine opens
(:func:`read_identity`, from the pool's ``connect`` event): a database recreated or restored
under a running process is noticed when the process reconnects to it.
"""

from __future__ import annotations

import functools
from typing import Any

from outbox._pg.statements import qualified
from outbox.schema import CACHE_SECRET, IDEMPOTENCY_KEYS, validate_schema_name

Identity = tuple[bytes, int, int | None]


@functools.cache
def cache_identity(schema: str | None) -> tuple[str, dict[str, Any]]:
    """The driver-level statement (and its parameters) that reads the secret and the
    database's identity: one row of ``secret``, ``database_oid``, ``keys_oid``."""
    schema = validate_schema_name(schema)
    statement = (
        "SELECT s.secret, d.oid::bigint AS database_oid, "
        "to_regclass(%(keys)s)::oid::bigint AS keys_oid "
        f"FROM {qualified(schema, CACHE_SECRET)} AS s, pg_database AS d "
        "WHERE s.id = 1 AND d.datname = current_database()"
    )
    return statement, {"keys": qualified(schema, IDEMPOTENCY_KEYS)}


def identity_of(row: Any) -> Identity:
    """The identity in a row of :func:`cache_identity`'s statement."""
    if row is None:
        raise LookupError("outbox_cache_secret holds no row: run `outbox migrate`")
    secret, database_oid, keys_oid = row
    return bytes(secret), int(database_oid), None if keys_oid is None else int(keys_oid)


def read_identity(dbapi_connection: Any, statement: str, params: dict[str, Any]) -> Identity:
    """Run :func:`cache_identity`'s statement on a new DBAPI connection (psycopg's, or the
    asyncio adapter's sync face inside SQLAlchemy's pool) and leave no transaction open."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(statement, params)
        row = cursor.fetchone()
    finally:
        cursor.close()
        dbapi_connection.rollback()
    return identity_of(row)
