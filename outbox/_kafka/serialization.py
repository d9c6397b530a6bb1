"""Serializers and deserializers of confluent-kafka's shape, at the outbox's two doors.

A serializer is any callable ``serializer(obj, ctx) -> bytes | None`` that takes a
confluent-kafka ``SerializationContext`` (topic, field, headers): confluent-kafka's own
``AvroSerializer``, ``ProtobufSerializer`` and ``JSONSchemaSerializer`` (which register or look up
their schema in a Schema Registry and prepend the magic byte and the schema id), or a function
of the same shape. A publish runs it inside the unit of work (:func:`serialize`), so whatever
it refuses is refused before anything is written. The consumer runner runs deserializers of
the same shape before the handler (:func:`decode`); what they cannot decode is a permanent
failure of its message.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from confluent_kafka.serialization import MessageField, SerializationContext

from outbox._core.failures import is_unreachable
from outbox._core.redact import one_line
from outbox._kafka.consumer import Message
from outbox.errors import OutboxError, SerializerError, UndecodableMessage

Serializer = Callable[[Any, Any], "bytes | None"]
"""``serializer(obj, ctx: SerializationContext) -> bytes | None`` (confluent-kafka's shape)."""
Deserializer = Callable[["bytes | None", Any], Any]
"""``deserializer(data: bytes | None, ctx: SerializationContext) -> object``."""


def serialize(
    serializer: Serializer,
    topic: str,
    obj: Any,
    *,
    key: bool,
    headers: MutableMapping[str, str | bytes],
) -> bytes | None:
    """``serializer(obj, ctx)`` for the key or value of a record to ``topic``. Headers the
    serializer adds to the context (a schema id sent as a header) join ``headers``.

    Raises :class:`~outbox.errors.SerializerError`: ``retriable`` when the schema registry could
    not be reached, not when it refused the value or the schema."""
    record_headers: list[tuple[str, str | bytes | None]] = list(headers.items())
    known = len(record_headers)
    field = MessageField.KEY if key else MessageField.VALUE
    try:
        out = serializer(obj, SerializationContext(topic, field, record_headers))
    except OutboxError:
        raise
    except Exception as exc:
        what = "key" if key else "value"
        if is_unreachable(exc):
            raise SerializerError(
                f"the {what} serializer of topic {topic!r} could not reach its schema registry "
                f"({one_line(exc)}); nothing was written: try again once the registry answers",
                retriable=True,
            ) from exc
        raise SerializerError(
            f"the {what} for topic {topic!r} was refused by its serializer ({one_line(exc)}); "
            "nothing was written: fix the value, or register its schema"
        ) from exc
    for name, value in record_headers[known:]:
        if value is not None:
            headers[name] = value
    return out


def decode(
    message: Message,
    key_deserializer: Deserializer | None,
    value_deserializer: Deserializer | None,
) -> DecodedMessage:
    """``message`` with its key and value decoded by the given deserializers (a ``None`` value,
    a tombstone, stays ``None``).

    Raises :class:`~outbox.errors.UndecodableMessage` (permanent: the message is dead-lettered)
    when a deserializer refuses the bytes, and a retriable
    :class:`~outbox.errors.SerializerError` when it could not reach its schema registry."""
    key = _decoded(message, key_deserializer, key=True)
    value = _decoded(message, value_deserializer, key=False)
    return DecodedMessage(message, key, value)


def _decoded(message: Message, deserializer: Deserializer | None, *, key: bool) -> Any:
    raw = message.key() if key else message.value()
    if deserializer is None or raw is None:
        return raw
    topic = message.topic() or ""
    field = MessageField.KEY if key else MessageField.VALUE
    try:
        return deserializer(raw, SerializationContext(topic, field, message.headers()))
    except OutboxError:
        raise
    except Exception as exc:
        what = "key" if key else "value"
        where = f"{topic}[{message.partition()}]@{message.offset()}"
        if is_unreachable(exc):
            raise SerializerError(
                f"the {what} deserializer of {where} could not reach its schema registry "
                f"({one_line(exc)})",
                retriable=True,
            ) from exc
        raise UndecodableMessage(
            f"the {what} of {where} cannot be decoded by its deserializer: {one_line(exc)}"
        ) from exc


class DecodedMessage:
    """A consumed message as its handler sees it with deserializers: ``key()`` and ``value()``
    return the decoded objects, ``raw_key()`` and ``raw_value()`` the bytes; every other
    accessor (``topic()``, ``headers()``, ``offset()``...) is the message's own."""

    __slots__ = ("_key", "_message", "_value")

    def __init__(self, message: Message, key: Any, value: Any) -> None:
        self._message = message
        self._key = key
        self._value = value

    def key(self) -> Any:
        return self._key

    def value(self) -> Any:
        return self._value

    def raw_key(self) -> bytes | None:
        raw: bytes | None = self._message.key()
        return raw

    def raw_value(self) -> bytes | None:
        raw: bytes | None = self._message.value()
        return raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)

    def __repr__(self) -> str:
        return f"DecodedMessage({self._message.topic()!r}, key={self._key!r})"
