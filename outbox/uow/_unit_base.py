"""What both flavours of the unit of work (:mod:`outbox.uow._unit_async` and its sync twin)
share: the handle's key, result and buffered events, its refusals, and what a completed unit
of work's rows hold. Nothing here waits, so it is written once, not generated."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from outbox._core import validate as _validate
from outbox._core.events import Event, event_params
from outbox._core.typed_results import TypedResult
from outbox.config import OutboxConfig
from outbox.errors import ReplayedWriteError, TransactionEndedError
from outbox.payloads import CloudEvent, Serializer, encode_publish

ReplaySource = Literal["redis", "postgres"]
"""Where a replayed unit of work's stored outcome came from: the Redis fast path, or the claim's
row in PostgreSQL."""


class _Owner(Protocol):
    """What a unit of work needs of the outbox that opened it."""

    config: OutboxConfig


class UnitBase:
    """The part of a unit of work's handle that is the same in both flavours."""

    def __init__(
        self,
        outbox: _Owner,
        scope: str,
        key: str,
        fingerprint: str | None,
        replayed: bool,
        result: Any,
        typed: TypedResult | None,
        replayed_from: ReplaySource | None,
    ) -> None:
        self._outbox = outbox
        self.scope = scope
        self.key = key
        self.fingerprint = fingerprint
        self.replayed = replayed
        self._replayed_from = replayed_from if replayed else None
        self._result: Any = result
        self._events: list[Event] = []
        # A declared result type (outbox._core.typed_results): the result is stored as JSON data
        # it encodes to, and a replay's stored data is decoded on first read.
        self._typed = typed
        self._stored: Any = result

    def _refuse(self, what: str) -> ReplayedWriteError:
        return ReplayedWriteError(
            f"{what} inside a replayed unit of work (key {self.key!r}, scope {self.scope!r}): "
            "the key already completed; return uow.result instead of writing"
        )

    def _ended(self, what: str) -> TransactionEndedError:
        return TransactionEndedError(
            f"{what} is used after the unit of work ended (key {self.key!r}, scope "
            f"{self.scope!r}): its transaction is over; use it inside the with-block"
        )

    @property
    def replayed_from(self) -> ReplaySource | None:
        """Who answered a replay: ``"redis"`` (the cache) or ``"postgres"`` (the key's row);
        ``None`` for a unit of work that runs."""
        return self._replayed_from

    @property
    def result(self) -> Any:
        """The result stored with the key and replayed to every duplicate: JSON-serializable,
        or of the unit of work's declared ``result_type`` (a replay returns an equal value of
        that type)."""
        if self.replayed and self._typed is not None and self._result is self._stored:
            self._result = self._typed.decode(self._stored)
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.replayed:
            raise self._refuse("setting the result")
        stored = self._typed.encode(value) if self._typed is not None else value
        _validate.dumps_json(stored, "uow.result")  # refuse early, before any I/O
        self._result, self._stored = value, stored

    @property
    def event_ids(self) -> list[uuid.UUID]:
        """Ids of the events published so far in this unit of work."""
        return [event.event_id for event in self._events]

    def publish(
        self,
        topic: str,
        value: Any,
        key: str | bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
        *,
        serializer: Serializer | None = None,
        key_serializer: Serializer | None = None,
        cloudevent: CloudEvent | None = None,
    ) -> uuid.UUID:
        """Append an event to the outbox; it is written when the unit of work commits.

        Synchronous in both flavours: it only buffers. ``value`` may be ``bytes``, ``str``
        (UTF-8) or anything JSON-serializable (encoded as JSON with a
        ``content-type: application/json`` header); ``None`` is a tombstone, a record with a
        null value (a compacted topic deletes the key). ``key`` is the Kafka message key (``str``,
        ``bytes`` or ``None``); events with the same key reach Kafka in commit order. Returns
        the event's UUID, also sent as the ``X-Idempotency-Key`` header unless ``headers`` sets
        one. Invalid input raises before anything is written. Inside an active OpenTelemetry
        span, a ``create {topic}`` span is started and its context stored with the event as
        ``traceparent``/``tracestate`` headers (unless ``headers`` has a ``traceparent``); see
        ``docs/tracing.md``.

        ``serializer`` / ``key_serializer`` (else the topic's in ``OutboxConfig.serializers`` /
        ``key_serializers``) turn the value / key into bytes here, with confluent-kafka's
        serializer shape (an ``AvroSerializer`` with a Schema Registry client, or any function
        ``(obj, SerializationContext) -> bytes``); what they refuse raises
        :class:`~outbox.errors.SerializerError`. ``cloudevent`` sends the event as a CloudEvent
        in binary content mode, its event id as ``ce_id``. See ``docs/payload-formats.md``.
        """
        if self.replayed:
            raise self._refuse("publish()")
        event = encode_publish(
            self._outbox.config, topic, value, key, headers, serializer, key_serializer, cloudevent
        )
        self._events.append(event)
        return event.event_id


@dataclass(frozen=True, slots=True)
class Completion:
    """What a completed unit of work's key row and outbox rows hold."""

    scope: str
    key: str
    fingerprint: str | None
    result_json: str  # the result's exact JSON text, as Redis keeps it
    result: Any  # the result as the key's row stores it
    events: list[Event]

    def bind(self, schema: str | None) -> tuple[dict[str, Any], int, int]:
        """The final statement's parameters (key, result, events), the events' total size and
        their number of order locks."""
        params: dict[str, Any] = {
            "scope": self.scope,
            "key": self.key,
            "fingerprint": self.fingerprint,
            "result": self.result,
        }
        size, locks = event_params(self.events, params, schema)
        return params, size, locks


def _refuse_session_commit(session: Any) -> None:
    raise TransactionEndedError(
        "uow.session.commit() is not allowed inside a unit of work: it commits when the "
        "with-block ends, together with its idempotency key and outbox rows (use "
        "uow.session.flush() to send pending rows now, begin_nested() for a savepoint)"
    )
