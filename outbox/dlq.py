"""Dead letters: where the consumer runner puts a message it will not apply, and why.

A dead letter is the original record (key, value and headers unchanged) produced to
``<topic><suffix>`` (``orders.dlq`` by default) with extra ``outbox.dlq.*`` headers naming the
reason, the error, the number of attempts and the original topic, partition and offset. It is
produced with an idempotent producer (``acks=all``) and the runner waits for the broker's
confirmation before it commits the original offset, so a message is never dropped on the floor.

The runner avoids writing a second dead letter for the same message where it can (see
``docs/consumer.md``); when a crash lands between the confirmation and the offset commit the
message is dead-lettered again on redelivery. Readers of the dead-letter topic can drop such
copies by ``(outbox.dlq.topic, outbox.dlq.partition, outbox.dlq.offset)``, or by the
``X-Idempotency-Key`` header the original carried.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox.errors import DeadLetterError

log = logging.getLogger("outbox.dlq")

HEADER_PREFIX = "outbox.dlq."
HEADER_REASON = "outbox.dlq.reason"
HEADER_ERROR = "outbox.dlq.error"
HEADER_ERROR_TYPE = "outbox.dlq.error-type"
HEADER_ATTEMPTS = "outbox.dlq.attempts"
HEADER_TOPIC = "outbox.dlq.topic"
HEADER_PARTITION = "outbox.dlq.partition"
HEADER_OFFSET = "outbox.dlq.offset"
HEADER_GROUP = "outbox.dlq.group"

_MAX_ERROR_TEXT = 1000  # the error header: enough to diagnose, small next to the record

# librdkafka properties that only a consumer understands: the dead-letter producer is built from
# the runner's kafka_config without them (a producer would log a warning for each).
_CONSUMER_ONLY_PREFIXES = ("group.", "fetch.", "queued.", "auto.", "enable.auto.")
_CONSUMER_ONLY = frozenset(
    {
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "partition.assignment.strategy",
        "isolation.level",
        "enable.partition.eof",
        "check.crcs",
        "coordinator.query.interval.ms",
        "consume.callback.max.messages",
        "offset.store.method",
        "on_commit",
    }
)


class Reason(StrEnum):
    """Why a message was dead-lettered (the ``outbox.dlq.reason`` header)."""

    MISSING_KEY = "missing-key"
    """The message carried no idempotency key, so it cannot be applied at most once."""
    INVALID_INPUT = "invalid-input"
    """The key, the handler's result or an event it published was refused (ValidationError)."""
    KEY_REUSE = "key-reuse"
    """The key was used before for a different request (fingerprint mismatch)."""
    PERMANENT_ERROR = "permanent-error"
    """The handler raised a permanent error; the key is recorded as failed."""
    RETRIES_EXHAUSTED = "retries-exhausted"
    """The handler kept failing for ``max_attempts`` attempts; the key stays free for a redrive."""


@dataclass(frozen=True)
class DeadLetter:
    """What the runner knows about a failed message, written into the dead letter's headers."""

    reason: Reason
    error: str
    error_type: str
    attempts: int

    @classmethod
    def from_exception(cls, reason: Reason, exc: BaseException, attempts: int) -> DeadLetter:
        """Describe ``exc`` (type name and message, truncated) as a dead letter."""
        return cls(reason, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT], type(exc).__name__,
                   attempts)  # fmt: skip


@dataclass(frozen=True)
class DeadLetterInfo:
    """The ``outbox.dlq.*`` headers of a record read from a dead-letter topic, parsed."""

    reason: str
    error: str
    error_type: str
    attempts: int
    topic: str
    partition: int
    offset: int
    group: str
    idempotency_key: str | None

    @classmethod
    def from_headers(cls, headers: Sequence[tuple[str, bytes | None]] | None) -> DeadLetterInfo:
        """Parse a dead letter's headers; raises ``KeyError`` if one of ours is missing."""
        found: dict[str, str] = {}
        for name, value in headers or ():
            if value is not None and (name.startswith(HEADER_PREFIX) or name == IDEMPOTENCY_HEADER):
                found.setdefault(name, value.decode("utf-8", errors="replace"))
        return cls(
            reason=found[HEADER_REASON],
            error=found[HEADER_ERROR],
            error_type=found[HEADER_ERROR_TYPE],
            attempts=int(found[HEADER_ATTEMPTS]),
            topic=found[HEADER_TOPIC],
            partition=int(found[HEADER_PARTITION]),
            offset=int(found[HEADER_OFFSET]),
            group=found[HEADER_GROUP],
            idempotency_key=found.get(IDEMPOTENCY_HEADER),
        )


def dead_letter_topic(topic: str, suffix: str) -> str:
    """The dead-letter topic of ``topic``: ``topic + suffix``."""
    return topic + suffix


def dead_letter_headers(
    original: Sequence[tuple[str, bytes | None]] | None,
    *,
    topic: str,
    partition: int,
    offset: int,
    group: str,
    letter: DeadLetter,
) -> list[tuple[str, bytes]]:
    """The original headers (minus stale ``outbox.dlq.*`` ones) followed by ours.

    Stale headers are dropped so a redriven message that fails again describes its latest
    failure only.
    """
    headers = [
        (name, value if value is not None else b"")
        for name, value in (original or ())
        if not name.startswith(HEADER_PREFIX)
    ]
    headers.extend(
        [
            (HEADER_REASON, str(letter.reason).encode()),
            (HEADER_ERROR, letter.error.encode("utf-8", errors="replace")),
            (HEADER_ERROR_TYPE, letter.error_type.encode("utf-8", errors="replace")),
            (HEADER_ATTEMPTS, str(letter.attempts).encode()),
            (HEADER_TOPIC, topic.encode("utf-8")),
            (HEADER_PARTITION, str(partition).encode()),
            (HEADER_OFFSET, str(offset).encode()),
            (HEADER_GROUP, group.encode("utf-8")),
        ]
    )
    return headers


def producer_config(kafka_config: Mapping[str, Any], bootstrap_servers: str) -> dict[str, Any]:
    """Producer settings for dead letters derived from a consumer's ``kafka_config``.

    Connection and security settings carry over; consumer-only properties are dropped;
    idempotence and ``acks=all`` are forced, since a dead letter must not be lost or doubled
    by a producer retry.
    """
    config = {
        key: value
        for key, value in kafka_config.items()
        if key not in _CONSUMER_ONLY and not key.startswith(_CONSUMER_ONLY_PREFIXES)
    }
    config["bootstrap.servers"] = bootstrap_servers
    config["enable.idempotence"] = True
    config["acks"] = "all"
    config.setdefault("linger.ms", 0)
    return config


class DeadLetterProducer:
    """Produces dead letters and waits for each to be confirmed.

    Dead letters are rare, so each one is flushed on its own: simple, and the caller knows the
    record is durable before it commits the original offset.
    """

    def __init__(self, config: Mapping[str, Any], timeout: float = 30.0) -> None:
        self._producer = Producer(dict(config))
        self._timeout = timeout
        self._lock = threading.Lock()
        # Dead letters produced but not confirmed yet, by the original's coordinates: librdkafka
        # keeps delivering a record after our wait timed out, so a retry waits for that record
        # instead of producing a second copy.
        self._in_flight: dict[tuple[str, int, int], list[KafkaError | None]] = {}

    def send(
        self,
        original: tuple[str, int, int],
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
    ) -> None:
        """Produce the dead letter of ``original`` (topic, partition, offset) and wait for it.

        Raises :class:`DeadLetterError` (retriable) if the record was refused or not confirmed
        within the timeout; calling again for the same original waits for the record still in
        flight rather than producing another.
        """
        with self._lock:
            outcome = self._in_flight.get(original)
            if outcome is None or (outcome and outcome[0] is not None):
                outcome = self._produce(topic, key, value, headers)
                self._in_flight[original] = outcome
            remaining = self._producer.flush(self._timeout)
            if not outcome:
                raise DeadLetterError(
                    f"dead letter to {topic!r} not confirmed within {self._timeout:g}s "
                    f"({remaining} record(s) still queued); is the broker reachable?",
                    retriable=True,
                )
            del self._in_flight[original]
        err = outcome[0]
        if err is not None:
            hint = ""
            if err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                hint = f"; create the topic {topic!r} (or enable auto-creation on the broker)"
            raise DeadLetterError(
                f"dead letter to {topic!r} refused by the broker: {err.str()}{hint}",
                retriable=True,
            )

    def _produce(
        self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> list[KafkaError | None]:
        outcome: list[KafkaError | None] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            outcome.append(err)

        record_headers: list[tuple[str, str | bytes | None]] = [(n, v) for n, v in headers]
        try:
            self._producer.produce(
                topic, value=value, key=key, headers=record_headers, on_delivery=on_delivery
            )
        except (KafkaException, BufferError) as exc:
            raise DeadLetterError(
                f"could not produce a dead letter to {topic!r}: {exc}", retriable=True
            ) from exc
        return outcome

    def close(self) -> None:
        """Flush whatever is queued (nothing, normally) and release the producer."""
        with self._lock:
            left = self._producer.flush(self._timeout)
        if left:
            log.warning("%d dead letter(s) were not confirmed before shutdown", left)
