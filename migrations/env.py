"""Alembic environment for outbox-kit's tables.

Where the database comes from, first match wins:
1. a connection handed over in ``config.attributes["connection"]`` (``outbox migrate`` and tests);
2. ``-x database_url=...`` on the alembic command line;
3. the ``OUTBOX_DATABASE_URL`` environment variable.

Run through alembic's own command line, the whole upgrade is one transaction whose statements
wait at most ``-x lock_timeout=MILLISECONDS`` (default 2000) for a lock; ``outbox migrate``
runs one transaction per revision and tries a revision again after a lock timeout.

The schema comes from ``config.attributes["outbox_schema"]``, ``-x schema=...`` or
``OUTBOX_SCHEMA`` (default: the search path, usually ``public``). The version table is
``outbox_alembic_version`` in that schema, so an application's own alembic history is untouched.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from alembic import context

from outbox._pg.migrations import set_lock_timeout
from outbox.schema import (
    CACHE_SECRET,
    IDEMPOTENCY_KEYS,
    OUTBOX,
    VERSION_TABLE,
    tables,
    validate_schema_name,
)

config = context.config
x_args = context.get_x_argument(as_dictionary=True)

schema = validate_schema_name(
    config.attributes.get("outbox_schema")
    or x_args.get("schema")
    or os.environ.get("OUTBOX_SCHEMA")
)
config.attributes["outbox_schema"] = schema
target_metadata = tables(schema).metadata
OWN_TABLES = {IDEMPOTENCY_KEYS, OUTBOX, CACHE_SECRET}


def _include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    # Only compare our own tables: the database may hold an application's tables too.
    if type_ == "table":
        return name in OWN_TABLES
    table = getattr(obj, "table", None)
    return table is None or table.name in OWN_TABLES


def _database_url() -> str:
    url = x_args.get("database_url") or os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        raise SystemExit(
            "no database URL: set OUTBOX_DATABASE_URL or pass -x database_url=postgresql+psycopg://..."
        )
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _run(connection: sa.Connection) -> None:
    if schema is not None:
        connection.execute(sa.schema.CreateSchema(schema, if_not_exists=True))
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_schemas=schema is not None,
        include_object=_include_object,
        compare_type=True,
        compare_server_default=False,
    )
    with context.begin_transaction():
        context.run_migrations()
        # `downgrade base` leaves nothing behind, not even an empty version table.
        version = sa.table(VERSION_TABLE, sa.column("version_num"), schema=schema)
        if (
            sa.inspect(connection).has_table(VERSION_TABLE, schema=schema)
            and connection.execute(sa.select(sa.func.count()).select_from(version)).scalar() == 0
        ):
            connection.execute(sa.text(f"DROP TABLE {_quoted(connection, VERSION_TABLE)}"))


def _quoted(connection: sa.Connection, name: str) -> str:
    preparer = connection.dialect.identifier_preparer
    if schema is None:
        return preparer.quote(name)
    return f"{preparer.quote_schema(schema)}.{preparer.quote(name)}"


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(_database_url(), poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        set_lock_timeout(conn, int(x_args.get("lock_timeout", "2000")))
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
