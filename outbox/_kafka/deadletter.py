"""The dead-letter producer: produces a dead letter and waits until the broker confirmed it.

Invariant: this module only talks to Kafka (what a dead letter holds is decided in the core);
the asyncio producer waits for the confirmation on the producer's own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from outbox._core.deadletter import DeadLetter, dead_letter_headers, dead_letter_topic
from outbox._kafka.config import refused
from outbox._kafka.consumer import coordinates, message_headers
from outbox._kafka.thread import ClientThread
from outbox.errors import DeadLetterError

log = logging.getLogger("outbox.dlq")


class DeadLetterProducer:
    """Produces the dead letters of consumer group ``group`` and waits for each to be confirmed.

    Dead letters are rare, so each one is flushed on its own: simple, and the caller knows the
    record is durable before it commits the original offset. ``config`` comes from
    :func:`outbox._kafka.config.producer_config` with ``purpose="dead-letter"``; a configuration
    the client refuses raises :class:`~outbox.errors.ConfigurationError`. The dead letter of a
    record of ``topic`` goes to ``topic + suffix``.
    """

    def __init__(
        self, config: Mapping[str, Any], *, group: str, suffix: str, timeout: float = 30.0
    ) -> None:
        try:
            self._producer = Producer(dict(config))
        except KafkaException as exc:
            raise refused(exc, config) from exc
        self._group = group
        self._suffix = suffix
        self._timeout = timeout
        self._lock = threading.Lock()
        # Dead letters produced but not confirmed yet, by the original's coordinates: librdkafka
        # keeps delivering a record after our wait timed out, so a retry waits for that record
        # instead of producing a second copy.
        self._in_flight: dict[tuple[str, int, int], list[KafkaError | None]] = {}

    def send_message(self, message: Message, letter: DeadLetter) -> None:
        """Dead-letter a consumed ``message``: :meth:`send` with the original key, value and
        headers followed by the ``outbox.dlq.*`` ones."""
        topic, partition, offset = coordinates(message)
        headers = dead_letter_headers(
            message_headers(message),
            topic=topic,
            partition=partition,
            offset=offset,
            group=self._group,
            letter=letter,
        )
        self.send(
            (topic, partition, offset),
            dead_letter_topic(topic, self._suffix),
            message.key(),
            message.value(),
            headers,
        )

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


class AsyncDeadLetterProducer:
    """:class:`DeadLetterProducer` for asyncio callers: producing a dead letter and waiting for
    its confirmation (up to ``timeout``) run on the producer's own thread."""

    def __init__(
        self, config: Mapping[str, Any], *, group: str, suffix: str, timeout: float = 30.0
    ) -> None:
        self._client = DeadLetterProducer(config, group=group, suffix=suffix, timeout=timeout)
        self._thread = ClientThread("outbox-dead-letters")

    async def send_message(self, message: Message, letter: DeadLetter) -> None:
        """See :meth:`DeadLetterProducer.send_message`."""
        await self._thread.run(self._client.send_message, message, letter)

    async def close(self) -> None:
        """See :meth:`DeadLetterProducer.close`; the producer's thread ends afterwards."""
        try:
            await self._thread.run(self._client.close)
        finally:
            self._thread.close()
