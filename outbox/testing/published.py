"""The events the code under test wrote to the outbox, decoded, without Kafka."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from outbox._core import codec
from outbox.schema import tables


@dataclass(frozen=True)
class PublishedEvent:
    """An event in the outbox, decoded: ``value`` is the JSON document for a JSON event, the
    text for a ``text/*`` one, else the bytes (``raw`` always holds the bytes); ``None`` in
    both for a tombstone."""

    topic: str
    key: str | bytes | None
    value: Any
    headers: Mapping[str, str | bytes]
    event_id: uuid.UUID
    raw: bytes | None = field(repr=False)


def _decoded(key: bytes | None) -> str | bytes | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return key


def _header(stored: Any) -> str | bytes:
    if isinstance(stored, dict):
        return dict(codec.decode_headers({"v": stored}))["v"]
    return str(stored)


def decode_event(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    headers: Mapping[str, Any],
    event_id: uuid.UUID,
) -> PublishedEvent:
    """An outbox row as a :class:`PublishedEvent`."""
    decoded_headers = {name: _header(stored) for name, stored in headers.items()}
    content_type = next(
        (str(v) for n, v in decoded_headers.items() if n.lower() == codec.CONTENT_TYPE_HEADER), ""
    )
    decoded: Any = value
    if value is None:  # a tombstone
        pass
    elif content_type.startswith(codec.JSON_CONTENT_TYPE):
        decoded = json.loads(value)
    elif content_type.startswith("text/"):
        decoded = value.decode("utf-8", errors="replace")
    return PublishedEvent(topic, _decoded(key), decoded, decoded_headers, event_id, value)


class Published:
    """The events waiting in the outbox (committed, not yet relayed), in commit order.

    Read afresh on every use: ``list(published)``, ``len(published)``,
    ``published.on("orders.accepted")``, ``published.values("orders.accepted")``.
    """

    def __init__(self, engine: sa.Engine, schema: str | None = None) -> None:
        self._engine = engine
        self._table = tables(schema).outbox

    def all(self) -> list[PublishedEvent]:
        t = self._table
        query = sa.select(t.c.topic, t.c.key, t.c.value, t.c.headers, t.c.event_id).order_by(t.c.id)
        with self._engine.connect() as conn:
            rows = conn.execute(query).all()
        return [decode_event(r.topic, r.key, r.value, r.headers or {}, r.event_id) for r in rows]

    def on(self, topic: str) -> list[PublishedEvent]:
        """The events of ``topic``."""
        return [e for e in self.all() if e.topic == topic]

    def values(self, topic: str) -> list[Any]:
        """The decoded values of ``topic``'s events."""
        return [e.value for e in self.on(topic)]

    def __iter__(self) -> Iterator[PublishedEvent]:
        return iter(self.all())

    def __len__(self) -> int:
        return len(self.all())
