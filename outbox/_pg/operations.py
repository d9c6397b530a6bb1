"""The operators' SQL: ``outbox status`` reads, ``outbox gc`` deletes, ``outbox parked`` manages,
``outbox dlq`` records which dead letters are handled.

Invariant: every statement is built from the SQLAlchemy Core tables of :mod:`outbox.schema` or
from constant text with the schema-qualified, quoted table name; values always travel as bound
parameters.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox._pg.statements import qualified
from outbox.schema import IDEMPOTENCY_KEYS, tables, validate_schema_name

# -- outbox status ---------------------------------------------------------------------------


# The outbox table as the session resolves its name (through search_path when no schema is
# given): its schema and its schema-qualified name, or no row when there is none.
OUTBOX_TABLE_RESOLVED = sa.text(
    """
SELECT n.nspname, quote_ident(n.nspname) || '.' || quote_ident(c.relname)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass(:table)
"""
)


def outbox_table_resolved(connection: sa.Connection, schema: str | None) -> tuple[str, str] | None:
    """``(schema, qualified name)`` of the outbox table this session reaches, or ``None``."""
    table = qualified(validate_schema_name(schema), "outbox")
    row = connection.execute(OUTBOX_TABLE_RESOLVED, {"table": table}).one_or_none()
    return None if row is None else (str(row[0]), str(row[1]))


def database_now(connection: sa.Connection) -> datetime:
    """The database clock (every age in the status report is measured against it)."""
    value = connection.execute(sa.select(sa.func.now())).scalar_one()
    assert isinstance(value, datetime)
    return value


def _pending_age(o: sa.Table) -> sa.ColumnElement[Any]:
    pending = o.c.parked_at.is_(None)
    return sa.extract("epoch", sa.func.now() - sa.func.min(o.c.created_at).filter(pending))


def outbox_backlog(
    connection: sa.Connection, schema: str | None, lanes: int
) -> tuple[list[tuple[str, int, int, float | None]], list[tuple[int, int, int]]]:
    """The backlog in one scan of the outbox: ``(topic, pending, parked, oldest pending age in
    seconds)`` per topic and ``(lane, pending, parked)`` per lane, rows split into ``lanes``
    lanes as relays do.

    One ``GROUP BY topic, lane`` (a hash aggregate of at most topics x lanes groups), added up
    here both ways: a scan per grouping, or ``GROUPING SETS`` (which the planner sorts for,
    not knowing how few lanes there are), costs two to four times as much on a big backlog.
    """
    o = tables(schema).outbox
    lane = (o.c.key_hash % sa.literal(lanes, sa.Integer)).label("lane")
    pending = o.c.parked_at.is_(None)
    rows = connection.execute(
        sa.select(
            o.c.topic,
            lane,
            sa.func.count().filter(pending).label("pending"),
            sa.func.count().filter(o.c.parked_at.is_not(None)).label("parked"),
            _pending_age(o).label("age"),
        ).group_by(o.c.topic, lane)
    ).all()
    topics: dict[str, tuple[int, int, float | None]] = {}
    by_lane: dict[int, tuple[int, int]] = {}
    for r in rows:
        t_pending, t_parked, t_age = topics.get(r.topic, (0, 0, None))
        age = _float(r.age)
        if t_age is not None and (age is None or t_age > age):
            age = t_age
        topics[r.topic] = (t_pending + r.pending, t_parked + r.parked, age)
        l_pending, l_parked = by_lane.get(r.lane, (0, 0))
        by_lane[r.lane] = (l_pending + r.pending, l_parked + r.parked)
    return (
        [(topic, *topics[topic]) for topic in sorted(topics)],
        [(n, *by_lane[n]) for n in sorted(by_lane)],
    )


def outbox_parked_backlog(
    connection: sa.Connection, schema: str | None, lanes: int
) -> list[tuple[str, int, int]]:
    """``(topic, lane, parked)`` of the parked rows, found through the partial index
    ``ix_outbox_parked``: what it costs grows with the parked rows, never with the pending."""
    o = tables(schema).outbox
    lane = (o.c.key_hash % sa.literal(lanes, sa.Integer)).label("lane")
    rows = connection.execute(
        sa.select(o.c.topic, lane, sa.func.count().label("parked"))
        .where(o.c.parked_at.is_not(None))
        .group_by(o.c.topic, lane)
    )
    return [(r.topic, int(r.lane), int(r.parked)) for r in rows]


def idempotency_keys_by_scope(
    connection: sa.Connection, schema: str | None
) -> list[tuple[str, str, int]]:
    """``(scope, status, count)`` of the idempotency keys."""
    k = tables(schema).idempotency_keys
    rows = connection.execute(
        sa.select(k.c.scope, k.c.status, sa.func.count().label("n"))
        .group_by(k.c.scope, k.c.status)
        .order_by(k.c.scope, k.c.status)
    )
    return [(r.scope, r.status, int(r.n)) for r in rows]


def idempotency_keys_oldest_update_age(
    connection: sa.Connection, schema: str | None
) -> float | None:
    """Seconds since the least recently updated key changed (served by its updated_at index)."""
    k = tables(schema).idempotency_keys
    return _float(
        connection.execute(
            sa.select(sa.extract("epoch", sa.func.now() - sa.func.min(k.c.updated_at)))
        ).scalar_one()
    )


def _float(value: Any) -> float | None:
    return None if value is None else round(float(value), 3)


# -- outbox gc -------------------------------------------------------------------------------

# Each batch locks at most `limit` old rows, skipping any row a live transaction holds, and
# deletes exactly those by ctid (a TID scan), in its own short transaction. It starts where the
# previous batch ended (`after`, the last `updated_at` it deleted), not at the index's low end:
# the keys deleted before stay in the index as dead entries until VACUUM removes them, which it
# may not while a long transaction holds the xmin horizon, and a walk over them would make each
# batch slower than the last. Keys skipped behind the cursor (locked, or committed late with an
# old `updated_at`) are left to the next run.
IDEMPOTENCY_KEYS_GC_BATCH = """
WITH deleted AS (
    DELETE FROM {keys}
    WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {keys}
        WHERE updated_at < :cutoff
          AND updated_at >= coalesce(CAST(:after AS timestamptz), '-infinity') {scope_filter}
        ORDER BY updated_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ))
    AND updated_at < :cutoff
    AND updated_at >= coalesce(CAST(:after AS timestamptz), '-infinity')
    RETURNING updated_at
)
SELECT count(*) AS n, max(updated_at) AS last FROM deleted
"""

IDEMPOTENCY_KEYS_GC_COUNT = "SELECT count(*) FROM {keys} WHERE updated_at < :cutoff {scope_filter}"

_SCOPE_FILTER = "AND scope = :scope"

# Wait at most this long for a table lock (e.g. behind a migration) instead of queueing and
# making every unit of work queue behind gc.
_GC_LOCK_TIMEOUT = "2s"


def _gc_sql(template: str, schema: str | None, scope: str | None) -> sa.TextClause:
    keys = qualified(validate_schema_name(schema), IDEMPOTENCY_KEYS)
    return sa.text(template.format(keys=keys, scope_filter=_SCOPE_FILTER if scope else ""))


def idempotency_keys_gc_cutoff(connection: sa.Connection, older_than: float) -> datetime:
    """The database's ``now() - older_than`` (the database clock decides, like ``updated_at``)."""
    value = connection.execute(
        sa.text("SELECT now() - make_interval(secs => :s)"), {"s": older_than}
    ).scalar_one()
    assert isinstance(value, datetime)
    return value


def idempotency_keys_count_expired(
    connection: sa.Connection, cutoff: datetime, schema: str | None, scope: str | None
) -> int:
    """Idempotency keys last updated before ``cutoff``."""
    sql = _gc_sql(IDEMPOTENCY_KEYS_GC_COUNT, schema, scope)
    return int(connection.execute(sql, {"cutoff": cutoff, "scope": scope}).scalar_one())


def idempotency_keys_delete_expired_batch(
    engine: sa.Engine,
    cutoff: datetime,
    schema: str | None,
    scope: str | None,
    limit: int,
    after: datetime | None = None,
) -> tuple[int, datetime | None]:
    """Delete up to ``limit`` keys last updated before ``cutoff`` (and not before ``after``) in
    one short transaction, skipping rows a live transaction holds; returns how many were
    deleted and the last ``updated_at`` among them (where the next batch starts)."""
    sql = _gc_sql(IDEMPOTENCY_KEYS_GC_BATCH, schema, scope)
    with engine.begin() as conn:
        conn.execute(sa.text(f"SET LOCAL lock_timeout = '{_GC_LOCK_TIMEOUT}'"))
        # The batch is the first `limit` entries of the updated_at index from `after` on: an
        # ordered index scan that stops there. Statistics that lag behind a table gc is
        # emptying make the planner read every expired key into a bitmap and sort it instead,
        # once per batch.
        conn.execute(sa.text("SET LOCAL enable_bitmapscan = off"))
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))
        row = conn.execute(
            sql, {"cutoff": cutoff, "limit": limit, "scope": scope, "after": after}
        ).one()
        return int(row.n), row.last


# -- outbox parked ---------------------------------------------------------------------------


def _parked_selection(
    table: sa.Table, event_ids: Sequence[uuid.UUID] | None, topic: str | None
) -> list[sa.ColumnElement[bool]]:
    where: list[sa.ColumnElement[bool]] = [table.c.parked_at.is_not(None)]
    if event_ids:
        where.append(table.c.event_id.in_(list(event_ids)))
    if topic is not None:
        where.append(table.c.topic == topic)
    return where


def outbox_parked_list(
    connection: sa.Connection, schema: str | None, topic: str | None, limit: int
) -> list[tuple[Any, ...]]:
    """``(id, event_id, topic, key, attempts, last_error, parked_at, created_at)`` of parked
    rows, oldest first."""
    t = tables(schema).outbox
    query = (
        sa.select(
            t.c.id, t.c.event_id, t.c.topic, t.c.key, t.c.attempts, t.c.last_error,
            t.c.parked_at, t.c.created_at,
        )
        .where(*_parked_selection(t, None, topic))
        .order_by(t.c.id)
        .limit(limit)
    )  # fmt: skip
    return [tuple(row) for row in connection.execute(query)]


def outbox_parked_retry(
    connection: sa.Connection,
    schema: str | None,
    event_ids: Sequence[uuid.UUID] | None,
    topic: str | None,
) -> int:
    """Unpark rows with a fresh attempt count; returns how many. The caller commits."""
    t = tables(schema).outbox
    result = connection.execute(
        sa.update(t)
        .where(*_parked_selection(t, event_ids, topic))
        .values(parked_at=None, attempts=0)
    )
    return int(result.rowcount)


def outbox_parked_discard(
    connection: sa.Connection,
    schema: str | None,
    event_ids: Sequence[uuid.UUID] | None,
    topic: str | None,
) -> int:
    """Delete parked rows; returns how many. The caller commits."""
    t = tables(schema).outbox
    result = connection.execute(sa.delete(t).where(*_parked_selection(t, event_ids, topic)))
    return int(result.rowcount)


# -- outbox dlq ------------------------------------------------------------------------------

_MARK_CHUNK = 5000


def dlq_handled_mark(
    connection: sa.Connection,
    schema: str | None,
    dlq_topic: str,
    refs: Sequence[tuple[int, int]],
    how: str,
    handled_by: str | None,
) -> int:
    """Record dead letters of ``dlq_topic`` as handled at the database's clock; a letter handled
    before keeps its first record. Returns how many were newly recorded. The caller commits."""
    if not refs:
        return 0
    t = tables(schema).dlq_handled
    rows = [
        {"dlq_topic": dlq_topic, "partition": p, "offset": o, "how": how, "handled_by": handled_by}
        for p, o in sorted(set(refs))
    ]
    added = 0
    # Multi-row INSERTs of at most _MARK_CHUNK rows (PostgreSQL takes at most 65,535 bound
    # values a statement); RETURNING counts the new rows, which rowcount does not report.
    for start in range(0, len(rows), _MARK_CHUNK):
        result = connection.execute(
            pg_insert(t)
            .values(rows[start : start + _MARK_CHUNK])
            .on_conflict_do_nothing(constraint="outbox_dlq_handled_pkey")
            .returning(t.c.offset)
        )
        added += len(result.all())
    return added


def dlq_handled_refs(
    connection: sa.Connection, schema: str | None, dlq_topic: str
) -> dict[tuple[int, int], str]:
    """``(partition, offset) -> how`` of the handled dead letters of ``dlq_topic``."""
    t = tables(schema).dlq_handled
    rows = connection.execute(
        sa.select(t.c.partition, t.c.offset, t.c.how).where(t.c.dlq_topic == dlq_topic)
    )
    return {(int(r.partition), int(r.offset)): str(r.how) for r in rows}
