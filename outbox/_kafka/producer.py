"""The Kafka side of the relay: a confluent-kafka producer and the meaning of its errors.

This is the only module of the relay that imports ``confluent_kafka``. It builds the producer
from :func:`outbox._kafka.config.producer_config` (idempotent, ``acks=all``, Java-compatible
partitioner, throughput-oriented batching), sends a group of records and waits for every
delivery report without one flush per record, and knows which librdkafka errors are permanent
(the row is parked at once) or retriable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox._kafka.config import (
    DEFAULT_CONFIG as DEFAULT_CONFIG,
    REQUIRED_CONFIG as REQUIRED_CONFIG,
    producer_config as producer_config,
)
from outbox.errors import FatalProducerError, PublishError

log = logging.getLogger("outbox.relay")

# librdkafka error codes after which sending the same record again cannot succeed: the row is
# parked with the error. Everything else is retriable (timeouts, leader moves, transport).
PERMANENT_ERRORS: frozenset[int] = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,  # record above message.max.bytes (client or broker)
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_RECORD,
        KafkaError.TOPIC_EXCEPTION,  # invalid topic name
        KafkaError.UNKNOWN_TOPIC_OR_PART,  # topic absent and auto-creation off
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.POLICY_VIOLATION,
        KafkaError._INVALID_ARG,
    }
)


# Errors that mean the producer's idempotence state (producer id, epoch, sequence numbers) is
# no longer usable, e.g. after message timeouts made librdkafka bump the epoch and the broker
# refused it. The records are retriable, but only with a fresh producer.
PRODUCER_STATE_ERRORS: frozenset[int] = frozenset(
    {
        KafkaError.PRODUCER_FENCED,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.INVALID_PRODUCER_ID_MAPPING,
    }
)


def is_permanent(code: int) -> bool:
    """True when a record that failed with librdkafka error ``code`` can never be delivered."""
    return code in PERMANENT_ERRORS


Headers = list[tuple[str, str | bytes | None]]

# (topic, key, value, headers): what :meth:`KafkaProducer.send` takes. The relay builds plain
# tuples on its hot path (a NamedTuple costs several times more to create); ``Record`` is the
# same shape with names.
RecordTuple = tuple[str, bytes | None, bytes, Headers]


class Record(NamedTuple):
    """One record to produce."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Headers


@dataclass(frozen=True)
class Outcome:
    """The delivery report of one record: ``error`` is ``None`` when Kafka confirmed it."""

    error: str | None = None
    code: int | None = None
    permanent: bool = False
    stale_producer: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


CONFIRMED = Outcome()
NOT_SENT = Outcome(error="not sent: the relay stopped before sending this record")


def _outcome(err: KafkaError) -> Outcome:
    code = int(err.code())
    return Outcome(
        error=f"{err.name()}: {err.str()}",
        code=code,
        permanent=is_permanent(code),
        stale_producer=code in PRODUCER_STATE_ERRORS or err.fatal(),
    )


class KafkaProducer:
    """A confluent-kafka producer that sends groups of records and reports each one's fate."""

    def __init__(self, bootstrap_servers: str, overrides: Mapping[str, str]) -> None:
        self.config = producer_config(bootstrap_servers, overrides)
        self.message_timeout = int(self.config["message.timeout.ms"]) / 1000.0
        self._fatal: str | None = None
        self._last_error: tuple[str, float] = ("", 0.0)
        self._producer = Producer({**self.config, "error_cb": self._on_error})

    def _on_error(self, err: KafkaError) -> None:
        # Client-level errors (broker down, auth) arrive here, once per connection attempt;
        # per-record fate arrives in delivery reports. Log a state change, or a reminder every
        # 30 s, not every reconnect.
        if err.fatal():
            self._fatal = f"{err.name()}: {err.str()}"
            log.error("event=kafka_fatal_error error=%r", self._fatal)
            return
        name, last = self._last_error
        now = time.monotonic()
        if err.name() != name or now - last > 30.0:
            self._last_error = (err.name(), now)
            log.warning("event=kafka_client_error error=%r", f"{err.name()}: {err.str()}")

    def send(
        self,
        records: Sequence[RecordTuple],
        stop: threading.Event,
        grace: float = 5.0,
    ) -> list[Outcome]:
        """Produce ``records`` and wait until each has a delivery report.

        Returns one :class:`Outcome` per record, in order. Records refused inside
        ``produce()`` (too large, invalid topic) get their error at once; the others are
        batched by librdkafka and confirmed by the broker. When ``stop`` is set the wait is cut
        to ``grace`` seconds; records still without a report count as not confirmed (the
        caller keeps their rows, so at worst they are sent again).
        """
        outcomes: list[Outcome | None] = [None] * len(records)
        pending = 0

        def report(index: int) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Any) -> None:
                nonlocal pending
                pending -= 1
                outcomes[index] = CONFIRMED if err is None else _outcome(err)

            return on_delivery

        produce = self._producer.produce
        for index, (topic, key, value, headers) in enumerate(records):
            while True:
                try:
                    produce(topic, value, key, headers=headers, on_delivery=report(index))
                    pending += 1
                    break
                except BufferError:
                    self._producer.poll(0.05)  # local queue full: let reports drain, retry
                except KafkaException as exc:
                    outcomes[index] = _outcome(exc.args[0])
                    break
        deadline = time.monotonic() + self.message_timeout + 5.0
        stop_deadline: float | None = None
        while pending > 0:
            if self._fatal is not None:
                raise FatalProducerError(f"Kafka producer fatal error: {self._fatal}")
            now = time.monotonic()
            if stop.is_set() and stop_deadline is None:
                stop_deadline = now + grace
            limit = min(deadline, stop_deadline) if stop_deadline is not None else deadline
            if now >= limit:
                break
            # flush() sends at once instead of waiting for linger.ms and serves callbacks.
            self._producer.flush(min(0.1, limit - now))
        if stop_deadline is not None:
            return [o if o is not None else NOT_SENT for o in outcomes]
        # No report although message.timeout.ms (+5 s) passed: librdkafka lost track of these
        # records. Retriable, and the producer is rebuilt (its queue purged) before a retry.
        late = Outcome(
            error=f"no delivery report within {self.message_timeout + 5.0:g}s",
            code=int(KafkaError._MSG_TIMED_OUT),
            stale_producer=True,
        )
        return [o if o is not None else late for o in outcomes]

    def check(self, timeout: float = 5.0) -> int:
        """Ask the cluster for metadata; returns the broker count or raises PublishError."""
        try:
            metadata = self._producer.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise PublishError(
                f"Kafka brokers did not answer within {timeout:g}s "
                f"({self.config['bootstrap.servers']}): {exc.args[0].str()}; check "
                "--bootstrap-servers and --kafka-config (security.protocol, sasl.*)",
                retriable=True,
            ) from exc
        return len(metadata.brokers)

    def purge(self) -> None:
        """Drop queued and in-flight records (before the producer is thrown away; their rows
        stay in the outbox and are sent again)."""
        try:
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.poll(0)
        except KafkaException as exc:
            log.warning("event=kafka_purge_failed error=%r", str(exc))

    def close(self, timeout: float = 5.0) -> None:
        """Wait briefly for outstanding reports, then release the client."""
        self._producer.flush(timeout)
