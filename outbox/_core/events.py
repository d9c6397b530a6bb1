"""An event published through the outbox, checked and encoded once for every door.

:func:`encode_event` refuses bad input with a specific :class:`~outbox.errors.ValidationError`
before anything is written, and returns the row's values: the unit of work (sync and asyncio)
and the keyless transactional publish all write what it returns.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outbox._core import codec, validate


@dataclass(frozen=True, slots=True)
class Event:
    """An event, encoded and waiting for the statement that writes its outbox row."""

    event_id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    headers_json: str
    key_hash: int


def encode_event(
    topic: str,
    value: Any,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    max_payload_bytes: int,
) -> Event:
    """Check and encode one event (see :meth:`outbox.UnitOfWork.publish` for the rules)."""
    validate.check_topic(topic)
    key_bytes = validate.encode_message_key(key)
    checked = validate.check_headers(headers)
    validate.check_idempotency_header(checked)
    value_bytes, content_type = validate.encode_value(value)
    validate.with_content_type(checked, content_type)
    validate.check_size(key_bytes, value_bytes, checked, max_payload_bytes)
    event_id = uuid.uuid4()
    headers_json = json.dumps(codec.encode_headers(checked), ensure_ascii=False)
    return Event(
        event_id,
        topic,
        key_bytes,
        value_bytes,
        headers_json,
        codec.key_hash(key_bytes, event_id.bytes),
    )


def event_params(events: list[Event], params: dict[str, Any]) -> int:
    """Bind ``events`` into ``params`` as the final statement names them (``e0``, ``t0`` ...);
    returns the total size of their values."""
    size = 0
    for i, e in enumerate(events):
        params[f"e{i}"] = e.event_id
        params[f"t{i}"] = e.topic
        params[f"k{i}"] = e.key
        params[f"v{i}"] = e.value
        params[f"h{i}"] = e.headers_json
        params[f"x{i}"] = e.key_hash
        size += len(e.value)
    return size
