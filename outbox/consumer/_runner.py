# generated from outbox/consumer/_runner_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/consumer/_runner_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outbox._core.deadletter import DeadLetterInfo, Reason
from outbox._core.disposition import AttemptVerdict
from outbox._core.fingerprint import message_fingerprint, topic_fingerprint
from outbox._core.handlers import BATCH_HANDLER, is_coroutine_handler
from outbox._core.offsets import Assignment, PartitionId
from outbox._core.retry import backoff_delay
from outbox._core.stopping import stop_on_signals
from outbox._kafka.config import consumer_config, producer_config
from outbox._kafka.consumer import KafkaConsumer, Message, coordinates, header_key
from outbox._kafka.deadletter import DeadLetterProducer
from outbox._kafka.serialization import Deserializer
from outbox._pg.engines import database_answers, readiness_engine
from outbox._pg.errors import database_unavailable
from outbox.config import (
    ENV_CONSUMER_GROUP as ENV_GROUP,
    ENV_CONSUMER_METRICS_PORT as ENV_METRICS_PORT,
    ENV_KAFKA_CONFIG as ENV_KAFKA_CONFIG,
    ConsumerConfig,
)
from outbox.consumer._attempt import Attempts, GuardedAttempts, batch_handler
from outbox.consumer._attempt_base import FingerprintFunc, KeyFunc
from outbox.consumer._metrics import ConsumerMetrics, default_max_silence, serve_metrics
from outbox.consumer._micro_batches import MicroBatches
from outbox.consumer._runner_base import RunnerBase, _check_guarded, _describe
from outbox.errors import ConfigurationError, ConsumerError
from outbox.guard import Claim, RedisGuard
from outbox.uow import MessageBatch, Outbox

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outbox.uow import UnitOfWork

__all__ = [
    "ENV_GROUP",
    "ENV_KAFKA_CONFIG",
    "ENV_METRICS_PORT",
    "AttemptVerdict",
    "ConsumerConfig",
    "ConsumerError",
    "ConsumerRunner",
    "DeadLetterInfo",
    "FingerprintFunc",
    "GuardedHandler",
    "Handler",
    "KeyFunc",
    "MessageBatch",
    "Reason",
    "backoff_delay",
    "batch_handler",
    "consume",
    "database_unavailable",
    "header_key",
    "message_fingerprint",
    "serve_metrics",
    "topic_fingerprint",
]

log = logging.getLogger("outbox.consumer")

# Seconds between readiness checks of the broker and the database, and the broker check's bound.
READY_CHECK_INTERVAL = 5.0
READY_CHECK_TIMEOUT = 2.0

_ASYNC = False

Handler = Callable[["UnitOfWork", Message], Any]
"""``def handler(uow, message) -> result``: apply one message inside its unit of work.

The return value must be JSON-serializable; it is stored with the key and replayed to
duplicates (the handler is not called for them).
"""
GuardedHandler = Callable[[Claim, Message], Any]
"""``def handler(claim, message) -> result``: apply one message under its guard's claim
(a runner given an :class:`~outbox.guard.RedisGuard`). The return value must be
JSON-serializable; it is stored as the claim's result and replayed to duplicates.
"""


class ConsumerRunner(RunnerBase):
    """Feeds Kafka messages through units of work and commits offsets behind them.

    ``outbox`` is an :class:`~outbox.uow.Outbox`, or an
    :class:`~outbox.guard.RedisGuard` for handlers whose effects are not in
    PostgreSQL: the handler is then ``handler(claim, message)``, each message runs under a claim
    of its key, one at a time (``batch_size`` must be 1, its default there, unless
    ``concurrency`` is above 1), and no batch handler is taken.

    ``concurrency=N`` (default 1) runs up to N messages at once, each in a unit of work of its
    own: a partition's messages of different Kafka keys concurrently (asyncio tasks here,
    threads in the sync runner), those of one key in offset order; a partition's offset moves
    only past messages that are all finished.

    ``ConsumerRunner(outbox, handler, topics=[...], group="billing",
    bootstrap_servers=..., kafka_config={...}, key_header=..., max_attempts=5,
    dlq_topic_suffix=".dlq", ...)`` takes the fields of :class:`ConsumerConfig` as keywords (or a
    ready ``config=``). ``key_func`` replaces the header lookup; ``fingerprint_func`` is the
    request fingerprint stored with each key (by default the topic, :func:`topic_fingerprint`:
    a key reused on another topic is a ``key-reuse`` dead letter, not a duplicate;
    :func:`message_fingerprint` adds the value; ``None``: no fingerprint);
    ``metrics_registry`` receives the metrics (default: the global registry).
    ``value_deserializer`` / ``key_deserializer`` (confluent-kafka's shape:
    ``deserializer(data, SerializationContext)``, e.g. an ``AvroDeserializer``) decode each
    message before its handler sees it; a message they cannot decode is dead-lettered as a
    permanent failure (``docs/payload-formats.md``).

    :meth:`run` returns after :meth:`stop` is called (from a signal handler, another task or
    another thread), once the message in hand finished and the finished offsets are committed.
    One runner is one Kafka consumer; run several processes (or runners) with the same group to
    scale out.
    """

    def __init__(
        self,
        outbox: Outbox | RedisGuard,
        handler: Handler | GuardedHandler,
        config: ConsumerConfig | None = None,
        *,
        key_func: KeyFunc | None = None,
        fingerprint_func: FingerprintFunc | None = topic_fingerprint,
        metrics_registry: CollectorRegistry | None = None,
        key_deserializer: Deserializer | None = None,
        value_deserializer: Deserializer | None = None,
        **settings: Any,
    ) -> None:
        guarded = isinstance(outbox, RedisGuard)
        if not guarded and not isinstance(outbox, Outbox):
            raise ConfigurationError(
                f"{type(self).__name__} needs an outbox of its flavour "
                f"({'asyncio' if _ASYNC else 'sync'}): an {Outbox.__name__} or an "
                f"{RedisGuard.__name__}, got {type(outbox).__name__}"
            )
        if config is None:
            if guarded:
                settings.setdefault("batch_size", 1)
            config = ConsumerConfig(**settings)
        elif settings:
            config = dataclasses.replace(config, **settings)
        if not callable(handler):
            raise ConfigurationError(f"handler must be callable, got {handler!r}")
        unit = "claim" if guarded else "uow"
        if is_coroutine_handler(handler) != _ASYNC:
            raise ConfigurationError(
                f"{type(self).__name__} runs "
                + ("coroutine functions" if _ASYNC else "plain functions")
                + f" as handler({unit}, message), got {handler!r}: the sync runner takes plain "
                "functions, the asyncio runner coroutine functions"
            )
        self.config = config.validate()
        self.outbox: Outbox | None = None
        self.guard: RedisGuard | None = None
        self._scope = self.config.effective_scope
        self.metrics_registry = metrics_registry
        self._metrics = ConsumerMetrics.for_registry(metrics_registry)
        self._stopping = threading.Event()
        self._partitions: Assignment[Message] = Assignment()
        self._consumer: KafkaConsumer | None = None
        self._last_commit = 0.0
        self._fatal: str | None = None
        self._running = threading.Lock()
        # Last turn of the poll loop (monotonic); None while the loop is not running.
        self._heartbeat: float | None = None
        # Readiness: what the last checks found (see _check_if_due).
        self._broker_up = False
        self._database_up = False
        self._next_check = 0.0
        for name, given in (
            ("key_deserializer", key_deserializer),
            ("value_deserializer", value_deserializer),
        ):
            if given is not None and not callable(given):
                raise ConfigurationError(
                    f"{name} must be callable as deserializer(data, ctx), got {given!r}"
                )
        if isinstance(outbox, RedisGuard):
            _check_guarded(self.config, handler)
            self.guard = outbox
        else:
            if self.config.concurrency > 1 and getattr(handler, BATCH_HANDLER, False):
                raise ConfigurationError(
                    f"concurrency={self.config.concurrency} runs each message in a unit of work "
                    "of its own: a @batch_handler needs concurrency=1"
                )
            if self.config.optimistic and not getattr(outbox._transactions, "tells_failures", True):
                raise ConfigurationError(
                    "optimistic=True needs a psycopg engine (postgresql+psycopg://): it "
                    "pipelines the handlers' statements, which asyncpg cannot"
                )
            if self.config.savepoint_chunk > 1 and not getattr(
                outbox._transactions, "tells_failures", True
            ):
                raise ConfigurationError(
                    f"savepoint_chunk={self.config.savepoint_chunk} needs a psycopg engine "
                    "(postgresql+psycopg://): asyncpg does not tell the runner which message's "
                    "statement failed in a shared savepoint; use savepoint_chunk=1 with asyncpg"
                )
            self.outbox = outbox
        self._store = outbox  # where each key's outcome is kept
        self._handler = handler
        self._rules: dict[str, Any] = {
            "key_func": key_func,
            "fingerprint_func": fingerprint_func,
            "beat": self._beat,
            "key_deserializer": key_deserializer,
            "value_deserializer": value_deserializer,
        }
        # Made by run(): the dead-letter producer and the micro-batches that send to it.
        self._dlq: DeadLetterProducer | None = None
        self._micro_batches: MicroBatches | None = None
        # Readiness checks of the database use a connection of their own (see _check_if_due).
        self._ready_engine = (
            readiness_engine(self.outbox.engine) if self.outbox is not None else None
        )

    # -- public --------------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until :meth:`stop`; then commit finished offsets and leave the group.

        A runner runs once: a :meth:`stop` that comes before :meth:`run` makes it return at once.
        Raises :class:`ConsumerError` on a fatal Kafka client error (after committing what was
        finished).
        """
        if not self._running.acquire(blocking=False):
            raise ConfigurationError("this ConsumerRunner is already running")
        try:
            bootstrap = self.config.effective_bootstrap
            self._consumer = KafkaConsumer(
                consumer_config(bootstrap, self.config.group, self.config.kafka_config),
                on_error=self._on_client_error,
                on_commit=self._on_commit,
            )
            self._dlq = DeadLetterProducer(
                producer_config(bootstrap, self.config.kafka_config, purpose="dead-letter"),
                group=self.config.group,
                suffix=self.config.dlq_topic_suffix,
                timeout=self.config.dlq_timeout,
            )
            self._micro_batches = MicroBatches(
                self._attempts(self._dlq),
                self.config,
                self._partitions,
                self._metrics,
                stopping=self._stopping,
                beat=self._beat,
            )
            self._consumer.subscribe(
                self.config.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            log.info(
                "consuming %s as group %r (scope %r) from %s",
                ", ".join(self.config.topics), self.config.group, self._scope, bootstrap,
            )  # fmt: skip
            silence = default_max_silence(self.config)
            self._metrics.ready.labels(self.config.group).set_function(
                lambda: float(self.ready(silence))
            )
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                self._check_if_due()
                timeout = self._poll_timeout()
                received = self._consumer.consume(
                    self.config.batch_size, timeout, self.config.batch_wait
                )
                for message in received:
                    self._accept(message)
                self._work()
                self._commit_if_due()
        finally:
            self._heartbeat = None
            self._broker_up = self._database_up = False
            try:
                self._shutdown()
            finally:
                self._running.release()
        if self._fatal is not None:
            raise ConsumerError(f"fatal Kafka client error: {self._fatal}; restart the consumer")

    def _attempts(self, dlq: DeadLetterProducer) -> Attempts | GuardedAttempts:
        """The attempts at this runner's messages, sending dead letters to ``dlq``."""
        store = self._store
        if isinstance(store, RedisGuard):
            return GuardedAttempts(
                store, self._handler, self.config, self._metrics, dlq=dlq, **self._rules
            )
        return Attempts(store, self._handler, self.config, self._metrics, dlq=dlq, **self._rules)

    def _check_if_due(self) -> None:
        """Readiness checks, on the loop (so a wedged loop is never ready): a metadata request
        to the broker and ``SELECT 1`` on the outbox's database, each bounded by
        ``READY_CHECK_TIMEOUT`` (the database by its connect timeout). The database is checked
        on a connection of its own, so units of work never wait for a check (nor the check for
        a busy pool)."""
        now = time.monotonic()
        if now < self._next_check or self._consumer is None:
            return
        self._next_check = now + READY_CHECK_INTERVAL
        broker = self._consumer.check(READY_CHECK_TIMEOUT)
        database = True
        if self._ready_engine is not None:
            database = database_answers(self._ready_engine)
        if (broker, database) != (self._broker_up, self._database_up):
            log.log(
                logging.INFO if broker and database else logging.WARNING,
                "readiness: broker %s, database %s",
                "answers" if broker else "does not answer",
                "answers" if database else "does not answer",
            )
        self._broker_up, self._database_up = broker, database

    # -- partitions and offsets ----------------------------------------------------------------

    def _on_revoke(self, partitions: list[PartitionId]) -> None:
        # The new owner starts at the committed offset: commit what is finished. Messages in a
        # backlog are dropped here and redelivered there; a unit of work that committed but
        # whose offset did not is replayed there, not applied twice. Rebalance callbacks run
        # inside a client call, on the client's thread: the commit is made right there.
        consumer = self._consumer
        offsets = self._partitions.to_commit(partitions)
        if consumer is not None and offsets:
            try:
                self._on_commit(None, consumer.commit_now(offsets))
            except ConsumerError as exc:
                log.warning("offset commit of %s failed: %s", _describe(offsets), exc)
        self._forget(partitions)
        log.info("revoked %s", _describe(partitions))

    def _on_lost(self, partitions: list[PartitionId]) -> None:
        # Another member may own these already; committing now could move its offsets back.
        self._forget(partitions)
        log.warning("lost %s without a commit (session timed out?)", _describe(partitions))

    def _forget(self, partitions: list[PartitionId]) -> None:
        self._partitions.forget(partitions)
        self._metrics.unassigned(self.config.group, partitions)
        if self._consumer is not None:
            self._consumer.release(partitions)

    def _commit(self, sync: bool, only: list[PartitionId] | None = None) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        offsets = self._partitions.to_commit(only)
        self._last_commit = time.monotonic()
        if not offsets:
            return
        try:
            committed = consumer.commit(offsets, sync=sync)
        except ConsumerError as exc:
            log.warning("offset commit of %s failed: %s", _describe(offsets), exc)
            return
        if sync:
            self._on_commit(None, committed)

    def _commit_if_due(self) -> None:
        if time.monotonic() - self._last_commit >= self.config.commit_interval:
            self._commit(sync=False)
            self._report_lag()

    def _report_lag(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            highs = consumer.high_watermarks(tp for tp, _ in self._partitions.items())
            lags = self._partitions.lags(highs, lambda message: coordinates(message)[2])
            self._metrics.lagging(self.config.group, lags)

    # -- the work --------------------------------------------------------------------------------

    def _work(self) -> None:
        """Work through what was received, a micro-batch at a time, until every partition's
        backlog is empty or waiting for a retry."""
        consumer, micro_batches = self._consumer, self._micro_batches
        assert consumer is not None and micro_batches is not None
        while not self._stopping.is_set():
            plan = self._partitions.take(self.config.batch_size, time.monotonic())
            if not plan:
                break
            mb = micro_batches.run(plan)
            if mb.dead_lettered:
                # Shrinks the window in which a crash would dead-letter a message again.
                self._commit(sync=True, only=sorted(mb.dead_lettered))
            if not mb.moved:
                break
            self._commit_if_due()
        now = time.monotonic()
        for key, state in self._partitions.items():
            if not state.backlog:
                consumer.resume(key)
            elif state.retry_at > now:
                # Its partition waits; the backlog keeps what was received after the head.
                consumer.pause(key)

    def _shutdown(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            try:
                self._commit(sync=True)
            finally:
                try:
                    consumer.close()  # leaves the group: partitions move on at once
                except ConsumerError as exc:
                    log.warning("closing the Kafka consumer failed: %s", exc)
                self._consumer = None
        self._micro_batches = None
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None
        if self._ready_engine is not None:
            self._ready_engine.dispose()
        self._partitions.clear()
        log.info("consumer of group %r stopped", self.config.group)


def consume(
    outbox: Outbox | RedisGuard,
    handler: Handler | GuardedHandler,
    *,
    install_signal_handlers: bool = True,
    **settings: Any,
) -> None:
    """Run :class:`ConsumerRunner` until SIGTERM or SIGINT (the simple form).

    ``outbox`` is an :class:`~outbox.uow.Outbox` or an
    :class:`~outbox.guard.RedisGuard` (see :class:`ConsumerRunner`).
    ``settings`` are the :class:`ConsumerRunner` keywords (``topics``, ``group``,
    ``bootstrap_servers``, ``kafka_config``, ``key_func``...). A signal lets the message in
    hand finish, commits the finished offsets and returns. Signal handlers are installed only
    from the main thread and restored on return.
    """
    runner = ConsumerRunner(outbox, handler, **settings)
    with stop_on_signals(runner.stop, enabled=install_signal_handlers):
        runner.run()
