"""Payload formats: serializers at the door, CloudEvents, tombstones (docs/payload-formats.md).

Invariant: a value is encoded inside the unit of work, so a value its serializer refuses, an
unknown schema or a registry out of reach raises :class:`~outbox.errors.SerializerError` before
anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from outbox._core import cloudevents
from outbox._core.cloudevents import CloudEvent, Received as ReceivedCloudEvent
from outbox._core.events import Event
from outbox._core.validate import check_headers, check_topic
from outbox._otel import encode_event
from outbox.config import OutboxConfig
from outbox.errors import SerializationError

__all__ = [
    "CloudEvent",
    "Deserializer",
    "ReceivedCloudEvent",
    "Serializer",
    "cloudevent_id",
    "read_cloudevent",
]

Serializer = Callable[[Any, Any], "bytes | None"]
"""``serializer(obj, ctx: SerializationContext) -> bytes | None`` (confluent-kafka's shape)."""
Deserializer = Callable[["bytes | None", Any], Any]
"""``deserializer(data: bytes | None, ctx: SerializationContext) -> object``."""


def read_cloudevent(message: Any) -> ReceivedCloudEvent | None:
    """The CloudEvent a consumed record carries in binary content mode (its ``ce_*`` headers),
    or None. ``message`` is a confluent-kafka ``Message`` (or what a handler receives)."""
    return cloudevents.read(message.headers())


def cloudevent_id(message: Any) -> str | None:
    """The ``ce_id`` of a consumed record, or None: pass as the consumer runner's
    ``key_func`` to use CloudEvents ids as idempotency keys (or set ``key_header="ce_id"``)."""
    event = read_cloudevent(message)
    return event.id if event is not None else None


def encode_publish(
    config: OutboxConfig,
    topic: str,
    value: Any,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    serializer: Serializer | None,
    key_serializer: Serializer | None,
    cloudevent: CloudEvent | None,
) -> Event:
    """The event a publish writes: its value and key through their serializers (the call's,
    else the topic's in ``config``), then checked and encoded
    (:func:`outbox._otel.encode_event`)."""
    for name, given in (("serializer", serializer), ("key_serializer", key_serializer)):
        if given is not None and not callable(given):
            raise SerializationError(
                f"{name} must be callable as serializer(obj, SerializationContext), "
                f"got {type(given).__name__}"
            )
    if config.serializers or config.key_serializers:
        check_topic(topic)  # a name to look up, before any look-up
        serializer = serializer or config.serializers.get(topic)
        key_serializer = key_serializer or config.key_serializers.get(topic)
    if serializer is None and key_serializer is None:
        return encode_event(topic, value, key, headers, config.payload_limit, cloudevent=cloudevent)
    check_topic(topic)  # the serializers name their schema subjects after it
    checked = check_headers(headers)
    from outbox._kafka import serialization  # the Kafka client: only for a serializer

    if key_serializer is not None and key is not None:
        key = serialization.serialize(key_serializer, topic, key, key=True, headers=checked)
    if serializer is None:
        return encode_event(topic, value, key, checked, config.payload_limit, cloudevent=cloudevent)
    if value is not None:  # a tombstone stays a null value
        value = serialization.serialize(serializer, topic, value, key=False, headers=checked)
    return encode_event(
        topic, value, key, checked, config.payload_limit,
        serialized=True, cloudevent=cloudevent,
    )  # fmt: skip
