"""Parked rows for the admin pages' tests."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from outbox.schema import tables
from tests.fixtures.relay import insert_rows


def park(engine: sa.Engine, topic: str, *keys: str) -> list[uuid.UUID]:
    """Outbox rows of ``topic`` parked as the relay parks them: attempts spent, an error."""
    ids = insert_rows(engine, topic, [(key, b"{}") for key in keys])
    o = tables(None).outbox
    with engine.begin() as conn:
        conn.execute(
            sa.update(o)
            .where(o.c.event_id.in_(ids))
            .values(attempts=5, last_error="MSG_SIZE_TOO_LARGE", parked_at=sa.func.now())
        )
    return ids


def parked_at(engine: sa.Engine, event_id: uuid.UUID) -> object:
    """The row's ``parked_at`` (None once retried); raises when the row is gone."""
    o = tables(None).outbox
    with engine.connect() as conn:
        return conn.execute(sa.select(o.c.parked_at).where(o.c.event_id == event_id)).one()[0]
