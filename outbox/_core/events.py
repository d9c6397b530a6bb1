"""An event published through the outbox, checked and encoded once for every door.

:func:`encode_event` refuses bad input with a specific :class:`~outbox.errors.ValidationError`
before anything is written, and returns the row's values: the unit of work (sync and asyncio)
and the keyless transactional publish all write what it returns.

**Per-key commit order** (docs/concepts.md I7) is decided here too. The relay sends a key's rows in
``id`` order; ``id`` order equals commit order only if no transaction can take an ``id`` for a
key while another transaction holding a smaller ``id`` of that key is still uncommitted. So the
statement that writes outbox rows first takes a transaction-scoped advisory lock per message key
(:func:`order_lock_id`), in ascending lock-id order, and only then draws the ``id``s: a second
writer of the same key waits there until the first one has committed (or rolled back), and
writers of different keys never wait for each other. The rows are written at the very end of a
unit of work, in the message that also carries its ``COMMIT``, so the wait is for another
writer's commit and nothing longer.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outbox._core import cloudevents, codec, validate
from outbox.errors import SerializationError


@dataclass(frozen=True, slots=True)
class Event:
    """An event, encoded and waiting for the statement that writes its outbox row."""

    event_id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes | None  # None: a tombstone
    headers_json: str
    key_hash: int


# json.dumps(headers, ensure_ascii=False), without the encoder it would make on every call.
_HEADERS_JSON = json.JSONEncoder(ensure_ascii=False)


def encode_event(
    topic: str,
    value: Any,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    max_payload_bytes: int,
    trace_context: Mapping[str, str] | None = None,
    *,
    serialized: bool = False,
    cloudevent: cloudevents.CloudEvent | None = None,
) -> Event:
    """Check and encode one event (see :meth:`outbox.UnitOfWork.publish` for the rules).

    ``trace_context`` (``traceparent``, ``tracestate``: the publish's span, see
    :mod:`outbox._otel`) joins the headers unless the publisher set a ``traceparent`` header
    itself: an explicit context is the publisher's decision and is stored as given.
    ``serialized``: ``value`` is what a serializer returned (``bytes`` or ``None``), sent as it
    is with no content type of its own. ``cloudevent`` adds its ``ce_*`` headers, with the
    event id as ``ce_id`` (:mod:`outbox._core.cloudevents`).
    """
    validate.check_topic(topic)
    if cloudevent is not None:
        if not isinstance(cloudevent, cloudevents.CloudEvent):
            raise SerializationError(
                f"cloudevent must be an outbox.payloads.CloudEvent, got {type(cloudevent).__name__}"
            )
        cloudevent.validate()
    key_bytes = validate.encode_message_key(key)
    checked = validate.check_headers(headers)
    validate.check_idempotency_header(checked)
    if trace_context and not any(name.lower() == codec.TRACEPARENT_HEADER for name in checked):
        checked.update(trace_context)
    if serialized:
        value_bytes, content_type = validate.serialized_value(value), None
    else:
        value_bytes, content_type = validate.encode_value(value)
    event_id = uuid.uuid4()
    if cloudevent is not None:
        checked.update(cloudevents.headers(cloudevent, str(event_id), content_type, checked))
    elif content_type is not None:
        validate.with_content_type(checked, content_type)
    validate.check_size(key_bytes, value_bytes, checked, max_payload_bytes)
    headers_json = _HEADERS_JSON.encode(codec.encode_headers(checked))
    return Event(
        event_id,
        topic,
        key_bytes,
        value_bytes,
        headers_json,
        codec.key_hash(key_bytes, event_id.bytes),
    )


def order_lock_id(schema: str | None, key: bytes) -> int:
    """The signed 64-bit advisory lock id that orders the writers of message ``key``.

    It lives in the single-``bigint`` space of the idempotency keys' locks
    (:func:`outbox._core.claim.lock_id`), hashed under another prefix; an equal value by chance
    (about 2^-64 per pair) only makes a writer wait for another one's commit. The schema is
    part of it: outboxes in different schemas do not order each other's writers.
    """
    prefix = f"outbox-order:{len(schema or '')}:{schema or ''}:".encode()
    digest = hashlib.blake2b(prefix + key, digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def event_params(
    events: list[Event], params: dict[str, Any], schema: str | None
) -> tuple[int, int]:
    """Bind ``events`` into ``params`` as the final statement names them (``e0``, ``t0`` ...,
    and ``l0`` ... for the order locks of their distinct message keys, ascending); returns the
    total size of their values and the number of order locks."""
    size = 0
    keys: set[bytes] = set()
    for i, e in enumerate(events):
        params[f"e{i}"] = e.event_id
        params[f"t{i}"] = e.topic
        params[f"k{i}"] = e.key
        params[f"v{i}"] = e.value
        params[f"h{i}"] = e.headers_json
        params[f"x{i}"] = e.key_hash
        if e.value is not None:
            size += len(e.value)
        if e.key is not None:
            keys.add(e.key)
    # Ascending, so that two writers of overlapping key sets cannot deadlock on these locks.
    for j, lock in enumerate(sorted(order_lock_id(schema, k) for k in keys)):
        params[f"l{j}"] = lock
    return size, len(keys)
