"""The web console's SQL: parked rows by topic, key and error text, one row whole, a key's rows.

Invariant: every filter value travels as a bound parameter, and a ``LIKE`` pattern's wildcards
are escaped, so a filter is matched literally.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox.schema import OUTBOX, tables


@dataclass(frozen=True)
class ParkedFilter:
    """Which parked rows an operator looks at: every field is optional and they combine."""

    topic: str | None = None
    key: bytes | None = None
    error: str | None = None  # a substring of the error text, case-insensitive


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _selection(
    t: sa.Table, where: ParkedFilter, event_ids: Sequence[uuid.UUID] | None = None
) -> list[sa.ColumnElement[bool]]:
    out: list[sa.ColumnElement[bool]] = [t.c.parked_at.is_not(None)]
    if where.topic is not None:
        out.append(t.c.topic == where.topic)
    if where.key is not None:
        out.append(t.c.key == where.key)
    if where.error is not None:
        out.append(t.c.last_error.ilike(_like(where.error), escape="\\"))
    if event_ids is not None:
        out.append(t.c.event_id.in_(list(event_ids)))
    return out


def parked_search(
    connection: sa.Connection, schema: str | None, where: ParkedFilter, limit: int, offset: int
) -> list[sa.Row[Any]]:
    """Parked rows matching ``where``, oldest first; the value is cut to its size and first
    bytes so a page of rows never carries megabytes."""
    t = tables(schema).outbox
    # The page's ids first, ordered by `id + 0`: parked rows are few, and an ordered walk of
    # the primary key would step over every pending row to find them; this way the parked
    # index finds them and only the page's rows are read whole.
    page = (
        sa.select(t.c.id)
        .where(*_selection(t, where))
        .order_by(t.c.id + 0)
        .limit(limit)
        .offset(offset)
        .scalar_subquery()
    )
    query = (
        sa.select(
            t.c.id, t.c.event_id, t.c.topic, t.c.key, t.c.attempts, t.c.last_error,
            t.c.parked_at, t.c.created_at, t.c.headers,
            sa.func.octet_length(t.c.value).label("value_size"),
            sa.func.substring(t.c.value, 1, 4096).label("value_head"),
        )
        .where(t.c.id == sa.func.any(sa.func.array(page)))
        .order_by(t.c.id)
    )  # fmt: skip
    return list(connection.execute(query))


def parked_count(
    connection: sa.Connection,
    schema: str | None,
    where: ParkedFilter,
    event_ids: Sequence[uuid.UUID] | None = None,
) -> int:
    """How many parked rows match ``where`` (and ``event_ids``)."""
    t = tables(schema).outbox
    query = sa.select(sa.func.count()).select_from(t).where(*_selection(t, where, event_ids))
    return int(connection.execute(query).scalar_one())


def parked_retry(
    connection: sa.Connection,
    schema: str | None,
    where: ParkedFilter,
    event_ids: Sequence[uuid.UUID] | None,
) -> int:
    """Unpark the matching rows with a fresh attempt count; the caller commits."""
    t = tables(schema).outbox
    result = connection.execute(
        sa.update(t).where(*_selection(t, where, event_ids)).values(parked_at=None, attempts=0)
    )
    return int(result.rowcount)


def parked_discard(
    connection: sa.Connection,
    schema: str | None,
    where: ParkedFilter,
    event_ids: Sequence[uuid.UUID] | None,
) -> int:
    """Delete the matching parked rows; the caller commits."""
    t = tables(schema).outbox
    result = connection.execute(sa.delete(t).where(*_selection(t, where, event_ids)))
    return int(result.rowcount)


def idempotency_key(
    connection: sa.Connection, schema: str | None, scope: str, key: str
) -> sa.Row[Any] | None:
    """The idempotency key row, or ``None``."""
    k = tables(schema).idempotency_keys
    query = sa.select(
        k.c.scope, k.c.key, k.c.status, k.c.fingerprint, k.c.result, k.c.error, k.c.attempts,
        k.c.created_at, k.c.updated_at,
    ).where(k.c.scope == scope, k.c.key == key)  # fmt: skip
    return connection.execute(query).first()  # type: ignore[return-value]


def outbox_rows_of_key(
    connection: sa.Connection,
    schema: str | None,
    key: str,
    header: str,
    written_at: datetime | None,
    limit: int,
) -> list[sa.Row[Any]]:
    """In one scan of the outbox: the rows written in the transaction that completed a key
    (``of_unit``: its ``created_at`` is ``written_at``, the key's ``updated_at``), and the rows
    whose message key is ``key`` or whose ``header`` header holds it.

    The schema keeps no column that links an event to its unit of work; the transaction does.
    The key's final row and its events are written by one statement (see
    :func:`outbox._pg.statements.idempotency_key_complete`), so the events' ``created_at`` and
    the key's ``updated_at`` are the same transaction timestamp (``now()``, in microseconds),
    which the relay never changes. (Their ``xmin`` would be exact, but the relay's updates of a
    failed or parked row give it a new one.) A unit of work whose transaction began in the same
    microsecond would match too. A row that left the outbox (delivered, or discarded) is not
    found: the outbox keeps no history.
    """
    t = tables(schema).outbox
    naming = sa.or_(t.c.key == key.encode("utf-8"), t.c.headers[header].astext == key)
    of_unit: sa.ColumnElement[bool] = (
        sa.false() if written_at is None else t.c.created_at == written_at
    )
    query = (
        sa.select(
            t.c.id, t.c.event_id, t.c.topic, t.c.key, t.c.attempts, t.c.last_error,
            t.c.parked_at, t.c.created_at, of_unit.label("of_unit"),
        )
        .where(sa.or_(of_unit, naming))
        .order_by(t.c.id)
        .limit(limit)
    )  # fmt: skip
    return list(connection.execute(query))


def keys_in_transaction(connection: sa.Connection, schema: str | None, scope: str, key: str) -> int:
    """How many keys the transaction that last wrote ``(scope, key)`` completed (more than
    one: a consumer micro-batch). Key rows are not updated once completed, so their ``xmin``
    is the completing transaction's; found through the updated_at index."""
    t = tables(schema)
    k = t.idempotency_keys.alias("k")
    k2 = t.idempotency_keys.alias("k2")
    sharing = (
        sa.select(sa.func.count())
        .select_from(k.join(k2, k2.c.updated_at == k.c.updated_at))
        .where(
            k.c.scope == scope,
            k.c.key == key,
            sa.literal_column("k2.xmin") == sa.literal_column("k.xmin"),
        )
    )
    return int(connection.execute(sharing).scalar_one())


def outbox_rows_deleted(connection: sa.Connection, schema: str | None) -> int | None:
    """PostgreSQL's cumulative count of rows deleted from the outbox table (statistics)."""
    query = sa.text(
        "SELECT n_tup_del FROM pg_stat_user_tables WHERE schemaname = :schema AND relname = :table"
    )
    value = connection.execute(query, {"schema": schema or "public", "table": OUTBOX}).scalar()
    return None if value is None else int(value)
