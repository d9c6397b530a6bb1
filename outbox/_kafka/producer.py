"""The Kafka side of the relay: a confluent-kafka producer and the meaning of its errors.

This is the only module of the relay that imports ``confluent_kafka``. It knows how to build
the producer (idempotent, ``acks=all``, Java-compatible partitioner, throughput-oriented
batching), how to send a group of records and learn each one's fate without one flush or one
Python callback per record, and which librdkafka errors are permanent (the row is parked at
once) or retriable.

**No gaps.** The relay sends many records of one key at once and relies on the idempotent
producer to write a partition's records in the order they were produced. That order survives
retries, but by itself not failures: librdkafka may fail a record and still deliver a later one
of the same partition (a *gap*), which would let a later row of a key overtake a failed one.
Three settings close every path to a gap:

* a record that ``produce()`` refuses on the spot stops its key: no later record of that key is
  produced in the same send;
* ``enable.gapless.guarantee``: a batch that the broker refuses for good makes the producer
  fail everything after it (a fatal error, and the relay builds a new producer) instead of
  skipping ahead;
* librdkafka never times a record out by itself (its ``message.timeout.ms`` is 0 here); the
  relay enforces ``message.timeout.ms`` as a deadline for the whole send and then purges every
  outstanding record at once, so what did not get through is, in every partition, the tail of
  what was produced. Purged records are failed, the producer is rebuilt.

Delivery reports come only for failures (``delivery.report.only.error``): a send that succeeds
costs no Python per record after ``produce()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox._core.outage import Outage
from outbox._kafka.config import (
    DEFAULT_CONFIG as DEFAULT_CONFIG,
    REQUIRED_CONFIG as REQUIRED_CONFIG,
    producer_config as producer_config,
)
from outbox.errors import PublishError

log = logging.getLogger("outbox.relay")

# How the relay's own client runs, whatever the configuration says (see the module docstring):
# the relay enforces message.timeout.ms itself and hears only about failures.
CLIENT_SETTINGS: Mapping[str, Any] = {
    "message.timeout.ms": "0",
    "delivery.report.only.error": True,
    # librdkafka warns once that the gap-less guarantee is experimental.
    "log_level": "2",
}

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


def is_undeliverable(code: int) -> bool:
    """True when a record that failed with librdkafka error ``code`` can never be delivered."""
    return code in PERMANENT_ERRORS


Headers = list[tuple[str, str | bytes | None]]

# (topic, key, value, headers): what :meth:`KafkaProducer.send` takes. The relay builds plain
# tuples on its hot path (a NamedTuple costs several times more to create); ``Record`` is the
# same shape with names.
RecordTuple = tuple[str, bytes | None, bytes | None, Headers]  # value None: a tombstone


class Record(NamedTuple):
    """One record to produce."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers


@dataclass(frozen=True)
class DeliveryReport:
    """The delivery report of one record: ``error`` is ``None`` when Kafka confirmed it."""

    error: str | None = None
    code: int | None = None
    permanent: bool = False
    stale_producer: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


CONFIRMED = DeliveryReport()
NOT_SENT = DeliveryReport(error="not sent: the relay stopped before sending this record")

# librdkafka's codes for records failed by purge() (the relay purged them: deadline, fatal
# producer, stop; they may or may not have reached the broker) or by a fatal error.
PURGED: frozenset[int] = frozenset(
    {KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT, KafkaError._FATAL}
)


def _report_of(err: KafkaError) -> DeliveryReport:
    code = int(err.code())
    return DeliveryReport(
        error=f"{err.name()}: {err.str()}",
        code=code,
        permanent=is_undeliverable(code),
        stale_producer=code in PRODUCER_STATE_ERRORS or code in PURGED or err.fatal(),
    )


@dataclass(slots=True)
class Sending:
    """Records handed to :meth:`KafkaProducer.start`, waiting for :meth:`KafkaProducer.finish`."""

    records: Sequence[RecordTuple]
    reports: list[DeliveryReport | None]
    deadline: float


class KafkaProducer:
    """A confluent-kafka producer that sends groups of records and reports each one's fate."""

    def __init__(
        self,
        bootstrap_servers: str,
        overrides: Mapping[str, str],
        *,
        outage: Outage | None = None,
    ) -> None:
        self.config = producer_config(bootstrap_servers, overrides)
        # The brokers' state for the logs; a relay passes its own, which outlives the producers
        # it rebuilds, so a rebuilt producer does not announce the same outage again.
        self.outage = outage or Outage("Kafka")
        # The deadline of one send (see the module docstring); librdkafka's own is off.
        self.message_timeout = int(self.config["message.timeout.ms"]) / 1000.0
        self._fatal: str | None = None
        self._failures: list[tuple[KafkaError, Any]] = []
        self._producer = Producer(
            {
                **self.config,
                **CLIENT_SETTINGS,
                "error_cb": self._on_error,
                "on_delivery": self._on_failure,
            }
        )

    def _on_error(self, err: KafkaError) -> None:
        # Client-level errors (broker down, auth) arrive here, once per connection attempt;
        # per-record fate arrives in delivery reports. One line when the brokers become
        # unreachable, a summary while they stay so (outbox._core.outage), never one per retry.
        if err.fatal():
            self._fatal = f"{err.name()}: {err.str()}"
            log.error("event=kafka_fatal_error error=%r", self._fatal)
            return
        if line := self.outage.failed(err.name(), err.str(), time.monotonic()):
            log.warning("event=kafka_unreachable %s", line)

    def reachable(self) -> None:
        """The brokers answered (a confirmed delivery, metadata): end an outage in the logs."""
        if line := self.outage.recovered(time.monotonic()):
            log.info("event=kafka_reachable %s", line)

    def serve(self) -> None:
        """Serve pending callbacks (client errors) and a due summary of a lasting outage."""
        self._producer.poll(0)
        if line := self.outage.summary(time.monotonic()):
            log.warning("event=kafka_unreachable %s", line)

    def _on_failure(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:  # only failures are reported (delivery.report.only.error)
            self._failures.append((err, msg))

    def send(
        self,
        records: Sequence[RecordTuple],
        stop: threading.Event,
        grace: float = 5.0,
    ) -> list[DeliveryReport | None]:
        """Produce ``records`` in order and wait until each one's fate is known: :meth:`start`
        then :meth:`finish`."""
        return self.finish(self.start(records), stop, grace)

    def start(self, records: Sequence[RecordTuple]) -> Sending:
        """Produce ``records`` in order and return at once; librdkafka sends them meanwhile
        (the caller can do other work before :meth:`finish`).

        A record that ``produce()`` refuses (too large, invalid topic) gets its error at once,
        and no later record of its key is produced.
        """
        self._failures.clear()
        reports: list[DeliveryReport | None] = [CONFIRMED] * len(records)
        refused: set[bytes] = set()
        produce = self._producer.produce
        done = 0
        try:
            # The usual send, where produce() takes every record at once: runs of 512 records
            # with nothing per record but the call; the loop below takes over from a record
            # that produce() did not take.
            for start in range(0, len(records), 512):
                # Let other threads of the process have the interpreter between runs of
                # produce() calls (the relay's database work overlaps this loop).
                time.sleep(0)
                # `done` is read after the loop: the record produce() refused.
                for done, (topic, key, value, headers) in enumerate(  # noqa: B007
                    records[start : start + 512], start
                ):
                    produce(topic, value, key, headers=headers)
            done = len(records)
        except (BufferError, KafkaException):
            pass  # record `done` was not taken
        for index in range(done, len(records)):
            topic, key, value, headers = records[index]
            if not index & 511:
                time.sleep(0)
            if refused and key in refused:
                reports[index] = None
                continue
            while True:
                try:
                    produce(topic, value, key, headers=headers)
                    break
                except BufferError:
                    self._producer.poll(0.05)  # local queue full: let reports drain, retry
                except KafkaException as exc:
                    reports[index] = _report_of(exc.args[0])
                    if key is not None:
                        refused.add(key)  # no gap: its later records must not go out
                    break
        return Sending(records, reports, time.monotonic() + self.message_timeout)

    def finish(
        self, sending: Sending, stop: threading.Event, grace: float = 5.0
    ) -> list[DeliveryReport | None]:
        """Wait until the fate of every record of ``sending`` is known.

        Returns one :class:`DeliveryReport` per record, in order, or ``None`` for a record that was
        not produced because ``produce()`` refused an earlier record of its key. When the send
        has not completed within ``message.timeout.ms`` of :meth:`start`, every outstanding
        record is purged and failed (retriable, and the producer is to be rebuilt). When
        ``stop`` is set the wait is cut to ``grace`` seconds; records still outstanding then
        are purged and reported as not sent (the caller keeps their rows, so at worst they are
        sent again).
        """
        reports = sending.reports
        complete, purged_as = self._wait(sending.deadline, stop, grace)
        if self._failures:
            self._assign(sending.records, reports, purged_as)
        if not complete:
            # Some record's fate stayed unknown even after the purge: none of them may count
            # as confirmed (at worst they are sent again).
            unknown = purged_as or self._late()
            reports = [unknown if o is CONFIRMED else o for o in reports]
        if any(o is CONFIRMED for o in reports):
            self.reachable()
        return reports

    def _late(self) -> DeliveryReport:
        return DeliveryReport(
            error=f"no delivery report within {self.message_timeout:g}s",
            code=int(KafkaError._MSG_TIMED_OUT),
            stale_producer=True,
        )

    def _wait(
        self, deadline: float, stop: threading.Event, grace: float
    ) -> tuple[bool, DeliveryReport | None]:
        """Serve reports until nothing is outstanding. At the deadline, on a fatal error or
        after the stop's grace, purge what is left (see module). Returns whether every record's
        fate is known, and the report that purged records get (``None``: their own error)."""
        flush = self._producer.flush
        stop_deadline: float | None = None
        while True:
            now = time.monotonic()
            if stop.is_set() and stop_deadline is None:
                # With the brokers unreachable, nothing in flight will be confirmed: no grace.
                stop_deadline = now + (0.0 if self.outage.down else grace)
            limit = min(deadline, stop_deadline) if stop_deadline is not None else deadline
            # flush() sends at once instead of waiting for linger.ms and serves the reports.
            if flush(max(0.0, min(0.1, limit - now))) == 0:
                return True, None
            if self._fatal is not None or time.monotonic() >= limit:
                break
            if line := self.outage.summary(time.monotonic()):
                log.warning("event=kafka_unreachable %s", line)
        purged_as: DeliveryReport | None
        if self._fatal is not None:
            # Records behind the one that broke the producer: not their fault, no attempt.
            purged_as = DeliveryReport(
                error=f"not sent: the producer failed ({self._fatal})", stale_producer=True
            )
        elif stop_deadline is not None and time.monotonic() >= stop_deadline:
            purged_as = NOT_SENT
        else:
            purged_as = self._late()
        try:
            self._producer.purge(in_queue=True, in_flight=True)
        except KafkaException as exc:
            log.warning("event=kafka_purge_failed error=%r", str(exc))
        return flush(1.0) == 0, purged_as

    def _assign(
        self,
        records: Sequence[RecordTuple],
        reports: list[DeliveryReport | None],
        purged_as: DeliveryReport | None,
    ) -> None:
        """Give each failure report to its record. A report names its record by topic, key and
        value (librdkafka drops the headers of records purged from its queue); records alike in
        all three are told apart by order: the failed records of a partition are its tail
        (module docstring), so the reports belong to the last of them."""
        slots: dict[tuple[str, bytes | None, bytes | None], list[int]] = {}
        for index, (topic, key, value, _headers) in enumerate(records):
            if reports[index] is CONFIRMED:
                slots.setdefault((topic, key, value), []).append(index)
        for err, msg in self._failures:
            candidates = slots.get((msg.topic(), msg.key(), msg.value()))
            if not candidates:  # pragma: no cover - a report of a record of no send of ours
                log.warning("event=kafka_unmatched_report error=%r", err.str())
                continue
            index = candidates.pop()
            if purged_as is not None and int(err.code()) in PURGED:
                reports[index] = purged_as
            else:
                reports[index] = _report_of(err)
        self._failures.clear()

    def check(self, timeout: float = 5.0, stop: threading.Event | None = None) -> int:
        """Ask the cluster for metadata; returns the broker count or raises PublishError.
        With ``stop``, the wait is cut into short tries that a stop ends at once."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                step = left if stop is None else max(0.01, min(0.25, left))
                try:
                    metadata = self._producer.list_topics(timeout=step)
                    break
                except KafkaException:
                    if stop is None or stop.is_set() or left <= step:
                        raise
        except KafkaException as exc:
            raise PublishError(
                f"Kafka brokers did not answer within {timeout:g}s "
                f"({self.config['bootstrap.servers']}): {exc.args[0].str()}; check "
                "--bootstrap-servers and --kafka-config (security.protocol, sasl.*)",
                retriable=True,
            ) from exc
        self.reachable()
        return len(metadata.brokers)

    def reusable(self) -> bool:
        """Whether another send may follow on this producer by someone else: nothing queued or
        in flight, no fatal error."""
        return self._fatal is None and len(self._producer) == 0

    def purge(self) -> None:
        """Drop queued and in-flight records (before the producer is thrown away; their rows
        stay in the outbox and are sent again)."""
        try:
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.poll(0)
        except KafkaException as exc:
            log.warning("event=kafka_purge_failed error=%r", str(exc))

    def close(self, timeout: float = 5.0) -> None:
        """Wait briefly for outstanding reports (not at all while the brokers are unreachable:
        none would come), then release the client (once; the producer is not used after).

        Released here, not left to the garbage collector: the client's callbacks are this
        object's methods, a reference cycle that a quiet process may not collect for a long
        time, and the client's threads (three or more) would run on their timers until then."""
        client: Producer | None = self.__dict__.pop("_producer", None)
        if client is None:
            return
        client.flush(0.0 if self.outage.down else timeout)
        del client  # the last reference: librdkafka's threads end here
