"""The relay's producer: built when first needed, rebuilt after an outage, and ``send``, the one
way both engines hand a batch's records to Kafka (inside the tracing module's spans)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from outbox._core.delivery import KEY, TOPIC, ClaimedRow, deliver_in_rounds
from outbox._core.outage import Outage
from outbox._core.retry import Backoff
from outbox._kafka.producer import DeliveryReport, KafkaProducer, RecordTuple
from outbox._otel import spans
from outbox.config import RelayConfig
from outbox.relay._producers import ProducerPool

log = logging.getLogger("outbox.relay")

T = TypeVar("T")


class Producing:
    """The relay's Kafka producer and the back-off of a Kafka outage."""

    def __init__(
        self,
        config: RelayConfig,
        stop_event: threading.Event,
        factory: Callable[[], KafkaProducer] | None = None,
        pool: ProducerPool | None = None,
    ) -> None:
        self.config = config
        self.stop_event = stop_event
        # The brokers' state for the logs, kept across the producers an outage makes us rebuild.
        self.outage = Outage("Kafka")
        self.factory = factory or (
            lambda: KafkaProducer(config.bootstrap_servers, config.kafka_config, outage=self.outage)
        )
        self.producer: KafkaProducer | None = None
        self.backoff = Backoff(config.backoff_initial, config.backoff_max)
        # A fleet's relays borrow their producer from the process's pool while they send.
        self.pool = pool

    def get(self) -> KafkaProducer:
        """The producer, built (or borrowed from the pool) now if there is none."""
        if self.producer is None:
            self.producer = self.factory() if self.pool is None else self.pool.lend()
        return self.producer

    def drop(self) -> None:
        """Purge and forget the producer (the next batch builds a fresh one)."""
        producer, self.producer = self.producer, None
        if producer is not None:
            producer.purge()
            producer.close(timeout=0.0)
            if self.pool is not None:
                self.pool.forget()

    def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is None:
            return
        if self.pool is not None:
            self.pool.give_back(producer)
        else:
            producer.close(timeout=1.0)

    def check(self, timeout: float, stop: threading.Event) -> int:
        """Ask the brokers for metadata (:meth:`KafkaProducer.check`); a producer borrowed
        for it goes back to the pool at once."""
        borrowed = self.pool is not None and self.producer is None
        try:
            return self.get().check(timeout, stop)
        finally:
            if borrowed:
                self.close()

    def serve(self) -> None:
        """Client errors, and a due outage summary (while the relay waits for work); a
        borrowed producer goes back to the pool, which serves it from then on."""
        if self.producer is None:
            return
        if self.pool is not None:
            self.close()
        else:
            self.producer.serve()

    def send(
        self,
        rows: Sequence[ClaimedRow],
        records: Sequence[RecordTuple | None],
        unsendable: dict[int, DeliveryReport],
        *,
        alongside: Callable[[], Future[T]] | None = None,
        joined: Callable[[T], None] | None = None,
    ) -> tuple[list[DeliveryReport | None], int, Future[T] | None]:
        """Send ``rows`` (their ``records``) in delivery rounds (the round rule of
        :func:`outbox._core.delivery.deliver_in_rounds`), each round inside the spans of
        :func:`outbox._otel.spans.traced_send`. Returns a report per row (``None``: not sent),
        how many were sent, and the future ``alongside`` started.

        ``alongside`` starts the database's share of the batch on the relay's database thread
        when the first round is handed to the producer; given ``joined``, that round waits for
        it (the connection is then this thread's again) and hands its result to ``joined``
        before it waits for Kafka's reports."""
        producer = self.get()
        work: Future[T] | None = None

        def send(todo: list[int]) -> list[DeliveryReport | None]:
            nonlocal work
            chosen = records if len(todo) == len(records) else [records[i] for i in todo]
            started = None
            if alongside is not None and work is None:
                work = started = alongside()
            if started is None or joined is None:
                sending = producer.start(chosen)  # type: ignore[arg-type]  # no unsendable
            else:
                try:
                    sending = producer.start(chosen)  # type: ignore[arg-type]
                finally:
                    done = started.result()
                joined(done)
            return producer.finish(sending, self.stop_event, self.config.shutdown_grace)

        traced = send if spans is None else spans.traced_send(rows, send)
        reports, sent, gaps = deliver_in_rounds(
            [r[KEY] for r in rows],
            [r[TOPIC] for r in rows],
            traced,
            failed=unsendable,
            stopping=self.stop_event.is_set,
        )
        if gaps:
            log.error(
                "event=order_gap rows=%d: Kafka confirmed rows after a failed row of their key "
                "(the producer settings that prevent this were changed?)",
                gaps,
            )
        return reports, sent, work
