"""SQLAlchemy Core tables for ``idempotency_keys``, ``outbox``, ``outbox_cache_secret``,
``outbox_dlq_handled`` and the window relay's ``outbox_relay_windows`` and ``outbox_relay_held``.

The migrations in ``migrations/`` own the DDL; these tables mirror it exactly (a test compares
them against a migrated database). An optional PostgreSQL schema name places both tables outside
``public``; it goes through an identifier allow-list and is quoted by SQLAlchemy, never spliced
into SQL text.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, base as postgresql_base
from sqlalchemy.types import UserDefinedType

from outbox._core import claim
from outbox._core.validate import shown
from outbox.errors import ConfigurationError

IDEMPOTENCY_KEYS = "idempotency_keys"
OUTBOX = "outbox"
CACHE_SECRET = "outbox_cache_secret"
DLQ_HANDLED = "outbox_dlq_handled"
RELAY_WINDOWS = "outbox_relay_windows"
RELAY_HELD = "outbox_relay_held"
VERSION_TABLE = "outbox_alembic_version"

STATUS_STARTED = "started"
STATUS_COMPLETED = claim.STATUS_COMPLETED
STATUS_FAILED = claim.STATUS_FAILED

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def validate_schema_name(schema: str | None) -> str | None:
    """Return ``schema`` if it is an acceptable PostgreSQL identifier, else raise.

    Only lower-case letters, digits and underscores are allowed (at most 63 characters, not
    starting with a digit, not ``pg_``-prefixed), so the name can never carry SQL.
    """
    if schema is None:
        return None
    if (
        not isinstance(schema, str)
        or not _IDENTIFIER.fullmatch(schema)  # not match(): "$" would allow a final newline
        or schema.startswith("pg_")
    ):
        raise ConfigurationError(
            f"invalid schema name {shown(schema)}: use 1-63 lower-case letters, digits or "
            "underscores, starting with a letter or underscore (and not 'pg_')"
        )
    return schema


class Xid8(UserDefinedType[int]):
    """PostgreSQL's 64-bit transaction id (``xid8``)."""

    cache_ok = True

    def get_col_spec(self, **kw: object) -> str:
        return "xid8"


# Reflection (the migration drift check, an application's autogenerate) knows the type then.
postgresql_base.ischema_names.setdefault("xid8", Xid8)


@dataclass(frozen=True)
class Tables:
    """The toolkit's tables bound to one schema."""

    metadata: MetaData
    idempotency_keys: Table
    outbox: Table
    schema: str | None
    cache_secret: Table
    dlq_handled: Table
    relay_windows: Table
    relay_held: Table


@functools.cache
def tables(schema: str | None = None) -> Tables:
    """Return the Core tables for ``schema`` (``None`` means the search path, usually public)."""
    schema = validate_schema_name(schema)
    metadata = MetaData(schema=schema)
    idempotency_keys = Table(
        IDEMPOTENCY_KEYS,
        metadata,
        Column("scope", Text, nullable=False),
        Column("key", Text, nullable=False),
        Column("status", Text, nullable=False),
        Column("fingerprint", Text, nullable=True),
        Column("result", JSONB(none_as_null=True), nullable=True),
        Column("error", Text, nullable=True),
        Column("attempts", Integer, nullable=False, server_default=text("1")),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("scope", "key", name="idempotency_keys_pkey"),
        CheckConstraint(
            "status IN ('started', 'completed', 'failed')",
            name="idempotency_keys_status_check",
        ),
        # Serves retention clean-up (`outbox gc`); status is deliberately not indexed so that
        # the final status update stays a HOT update.
        Index("ix_idempotency_keys_updated_at", "updated_at"),
    )
    outbox = Table(
        OUTBOX,
        metadata,
        Column("id", BigInteger, Identity(always=False), nullable=False),
        Column("event_id", Uuid(as_uuid=True), nullable=False),
        Column("topic", Text, nullable=False),
        Column("key", LargeBinary, nullable=True),
        # NULL: a tombstone, sent as a record with a null value (migration 0005).
        Column("value", LargeBinary, nullable=True),
        Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        # Stable 31-bit hash of the message key (of the event id for key-less rows). Relays map
        # it to lanes with `key_hash % lanes`, so every row of one key lands in one lane.
        Column("key_hash", Integer, nullable=False),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        Column("parked_at", DateTime(timezone=True), nullable=True),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        # The writing transaction (migration 0007): the window relay reads the rows of the
        # transactions that committed between two snapshots. NULL: written before 0007.
        Column("txid", Xid8(), nullable=True, server_default=text("pg_current_xact_id()")),
        PrimaryKeyConstraint("id", name="outbox_pkey"),
        UniqueConstraint("event_id", name="outbox_event_id_key"),
        # Relay (migration 0002): lets a claim skip keys blocked by a parked row.
        Index(
            "ix_outbox_parked",
            "key_hash",
            "id",
            postgresql_where=text("parked_at IS NOT NULL"),
        ),
        Index("ix_outbox_txid", "txid"),
        # Window relay (migration 0008): the rows a held key owes, from its held row on.
        Index("ix_outbox_key_hash", "key_hash", "id"),
    )
    # One row (migration 0003): the secret that signs the Redis cache's entries.
    cache_secret = Table(
        CACHE_SECRET,
        metadata,
        Column("id", SmallInteger, nullable=False, server_default=text("1")),
        Column("secret", LargeBinary, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("id", name="outbox_cache_secret_pkey"),
        CheckConstraint("id = 1", name="outbox_cache_secret_one_row"),
    )
    # Dead letters an operator discarded or redrove (migration 0006): Kafka keeps them, the
    # listings leave them out.
    dlq_handled = Table(
        DLQ_HANDLED,
        metadata,
        Column("dlq_topic", Text, nullable=False),
        Column("partition", Integer, nullable=False),
        Column("offset", BigInteger, nullable=False),
        Column("handled_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        Column("how", Text, nullable=False),
        Column("handled_by", Text, nullable=True),
        PrimaryKeyConstraint("dlq_topic", "partition", "offset", name="outbox_dlq_handled_pkey"),
        CheckConstraint("how IN ('discarded', 'redriven')", name="outbox_dlq_handled_how_check"),
    )
    # The window relay's cursors (migration 0007): per lane, the snapshot (pg_snapshot as text)
    # up to which its rows were delivered, the window in progress, the last id sent of it
    # and its highest id.
    relay_windows = Table(
        RELAY_WINDOWS,
        metadata,
        Column("lane", Integer, nullable=False),
        Column("lanes", Integer, nullable=False),
        Column("delivered", Text, nullable=True),
        Column("opened", Text, nullable=True),
        Column("done_id", BigInteger, nullable=False, server_default=text("0")),
        Column("high_id", BigInteger, nullable=False, server_default=text("0")),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("lane", name="outbox_relay_windows_pkey"),
    )
    # The first row of each key the window relay still owes (a failed or parked row).
    relay_held = Table(
        RELAY_HELD,
        metadata,
        Column("id", BigInteger, nullable=False),
        Column("key_hash", Integer, nullable=False),
        Column("key", LargeBinary, nullable=True),
        PrimaryKeyConstraint("id", name="outbox_relay_held_pkey"),
    )
    return Tables(
        metadata,
        idempotency_keys,
        outbox,
        schema,
        cache_secret,
        dlq_handled,
        relay_windows,
        relay_held,
    )
