"""Parked rows: outbox rows the relay gave up on (``outbox parked``), listed, retried, discarded.

Invariant: a parked row holds back every later row of its key (per-key order) until it is
retried, with a fresh attempt count, or discarded.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from outbox._pg import operations as ops
from outbox.schema import validate_schema_name


@dataclass(frozen=True)
class ParkedRow:
    """A parked outbox row as an operator sees it."""

    id: int
    event_id: uuid.UUID
    topic: str
    key: bytes | None
    attempts: int
    error: str | None
    parked_at: datetime
    created_at: datetime

    def key_text(self) -> str:
        """The key as text when it is UTF-8, else as a bytes literal; ``-`` when absent."""
        if self.key is None:
            return "-"
        try:
            return self.key.decode("utf-8")
        except UnicodeDecodeError:
            return repr(self.key)


def list_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    topic: str | None = None,
    limit: int = 100,
) -> list[ParkedRow]:
    """Parked rows, oldest first (at most ``limit``)."""
    rows = ops.outbox_parked_list(connection, validate_schema_name(schema), topic, limit)
    return [ParkedRow(*row) for row in rows]


def retry_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    event_ids: Sequence[uuid.UUID] | None = None,
    topic: str | None = None,
) -> int:
    """Put parked rows back in line with a fresh attempt count; returns how many.

    Without ``event_ids`` every parked row (of ``topic``, if given) is retried. The caller
    commits.
    """
    return ops.outbox_parked_retry(connection, validate_schema_name(schema), event_ids, topic)


def discard_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    event_ids: Sequence[uuid.UUID] | None = None,
    topic: str | None = None,
) -> int:
    """Delete parked rows (they are never sent); returns how many. The caller commits."""
    return ops.outbox_parked_discard(connection, validate_schema_name(schema), event_ids, topic)
