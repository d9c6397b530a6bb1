"""Idempotent Kafka consumer runner: exactly-once effects from at-least-once delivery.

Each message is run through ``Outbox.unit_of_work(key, scope=<group>)`` keyed by its
``X-Idempotency-Key`` header, and its offset is committed only once the unit of work committed,
replayed a stored result, or the message was dead-lettered (and the broker confirmed the dead
letter). Redelivery after a crash or a rebalance is absorbed by the idempotency key::

    from outbox import Outbox
    from outbox.consumer import ConsumerRunner

    def handle(uow, message):
        order = json.loads(message.value())
        uow.session.add(Order(id=order["id"]))
        uow.publish("order.accepted", {"id": order["id"]}, key=str(order["id"]))
        return {"accepted": order["id"]}          # stored, replayed to duplicates

    runner = ConsumerRunner(Outbox(url), handle, topics=["orders"], group="billing",
                            bootstrap_servers="kafka:9092")
    runner.run()        # blocks until runner.stop() (e.g. from a signal handler)

or ``outbox consume app:handle --topic orders --group billing``. The delivery semantics
(offsets, retries, dead letters, rebalances) are described in ``docs/consumer.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import random
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import FrameType
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from outbox._core import validate as _validate
from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._pg.errors import database_unavailable
from outbox.config import ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL, env, env_int, redact_url
from outbox.dlq import (
    DeadLetter,
    DeadLetterProducer,
    Reason,
    dead_letter_headers,
    dead_letter_topic,
    producer_config,
)
from outbox.errors import (
    ConfigurationError,
    ConsumerError,
    DeadLetterError,
    InvalidKeyError,
    KeyInProgress,
    KeyReuseError,
    PermanentError,
    PreviouslyFailed,
    SerializationError,
    ValidationError,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outbox.metrics import MetricsServer
    from outbox.uow import Outbox, UnitOfWork

log = logging.getLogger("outbox.consumer")

Handler = Callable[["UnitOfWork", Message], Any]
"""``handler(uow, message) -> result``: apply one message inside its unit of work.

The return value must be JSON-serializable; it is stored with the key and replayed to
duplicates (the handler is not called for them).
"""
KeyFunc = Callable[[Message], "str | None"]
"""``key_func(message) -> str | None``: the idempotency key of a message (None: none)."""
FingerprintFunc = Callable[[Message], "str | None"]
"""``fingerprint_func(message) -> str | None``: a request hash stored with the key."""

ENV_GROUP = "OUTBOX_CONSUMER_GROUP"
ENV_METRICS_PORT = "OUTBOX_CONSUMER_METRICS_PORT"
ENV_KAFKA_CONFIG = "OUTBOX_KAFKA_CONFIG"


class Outcome(StrEnum):
    """What became of one attempt at a message."""

    PROCESSED = "processed"
    """The handler ran and its unit of work committed."""
    REPLAYED = "replayed"
    """A duplicate: the key had completed, the stored result was replayed, the handler skipped."""
    PREVIOUSLY_FAILED = "previously_failed"
    """The key had failed permanently (and was dead-lettered then): acknowledged, not re-sent."""
    DEAD_LETTERED = "dead_lettered"
    """Sent to the dead-letter topic and confirmed."""
    RETRY = "retry"
    """Not finished: the same message is tried again after a backoff (nothing was committed)."""


@dataclass(frozen=True)
class ConsumerConfig:
    """Settings of a :class:`ConsumerRunner`.

    ``kafka_config`` takes any librdkafka property (``session.timeout.ms``, security settings...);
    the connection and security ones also configure the dead-letter producer. ``scope`` defaults
    to ``group``: consumer groups see independent key spaces, so two services consuming the same
    topic each apply every message once.
    """

    topics: tuple[str, ...]
    group: str
    bootstrap_servers: str | None = None
    kafka_config: Mapping[str, Any] = field(default_factory=dict)
    scope: str | None = None
    key_header: str = IDEMPOTENCY_HEADER
    max_attempts: int = 5
    retry_backoff: float = 0.2
    retry_backoff_max: float = 10.0
    in_progress_backoff: float = 0.05
    in_progress_backoff_max: float = 1.0
    dlq_topic_suffix: str = ".dlq"
    dlq_timeout: float = 30.0
    batch_size: int = 500
    poll_timeout: float = 0.5
    commit_interval: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", (self.topics,))
        else:
            object.__setattr__(self, "topics", tuple(self.topics))
        object.__setattr__(self, "kafka_config", dict(self.kafka_config))

    @property
    def effective_scope(self) -> str:
        """The idempotency scope the runner uses: ``scope`` or else the group name."""
        return self.scope or self.group

    @property
    def effective_bootstrap(self) -> str:
        """``bootstrap_servers``, or ``bootstrap.servers`` from ``kafka_config``."""
        value = self.bootstrap_servers or self.kafka_config.get("bootstrap.servers")
        if not value:
            raise ConfigurationError(
                "no Kafka bootstrap servers: pass bootstrap_servers='host:port' "
                f"(CLI: --bootstrap-servers or {ENV_KAFKA_BOOTSTRAP})"
            )
        return str(value)

    def validate(self) -> ConsumerConfig:
        """Refuse inconsistent settings with a message that says how to fix them."""
        if not self.topics:
            raise ConfigurationError("no topics to consume: pass topics=['orders', ...]")
        for topic in self.topics:
            _validate.check_topic(topic)
            if not self.dlq_topic_suffix:
                raise ConfigurationError("dlq_topic_suffix must not be empty, e.g. '.dlq'")
            _validate.check_topic(dead_letter_topic(topic, self.dlq_topic_suffix))
        if not isinstance(self.group, str) or not self.group.strip():
            raise ConfigurationError("group must be a non-empty consumer group name")
        try:
            _validate.check_scope(self.effective_scope)
        except ValidationError as exc:
            raise ConfigurationError(
                f"{exc} -- the scope defaults to the group name; pass scope=... explicitly"
            ) from exc
        self.effective_bootstrap  # noqa: B018 -- raises when missing
        if not self.key_header:
            raise ConfigurationError("key_header must name a header, e.g. 'X-Idempotency-Key'")
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.batch_size < 1:
            raise ConfigurationError(f"batch_size must be at least 1, got {self.batch_size}")
        for name in (
            "retry_backoff",
            "retry_backoff_max",
            "in_progress_backoff",
            "in_progress_backoff_max",
            "dlq_timeout",
            "poll_timeout",
            "commit_interval",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)!r}")
        auto_commit = str(self.kafka_config.get("enable.auto.commit", "false")).lower()
        if auto_commit in ("true", "1"):
            raise ConfigurationError(
                "enable.auto.commit must stay false: the runner commits an offset only after "
                "the message's unit of work committed; remove it from kafka_config"
            )
        group_id = self.kafka_config.get("group.id")
        if group_id is not None and group_id != self.group:
            raise ConfigurationError(
                f"kafka_config group.id={group_id!r} disagrees with group={self.group!r}; "
                "pass the group once"
            )
        return self


# -- pure decisions ------------------------------------------------------------------------------


def backoff_delay(
    attempt: int, initial: float, maximum: float, rand: Callable[[], float] = random.random
) -> float:
    """Delay before retry number ``attempt`` (1-based): capped exponential with equal jitter.

    The jitter keeps consumers that failed together (a database blip) from retrying in lockstep;
    half of the delay is kept so a retry never comes sooner than half the nominal backoff.
    """
    nominal = min(maximum, initial * 2.0 ** max(0, attempt - 1))
    return float(nominal / 2 + rand() * nominal / 2)


def header_key(message: Message, header: str) -> str | None:
    """The idempotency key from the first ``header`` header, or ``None`` if there is none.

    The name is matched without regard to case, as the relay does when it decides whether the
    publisher set the header itself. Raises :class:`~outbox.errors.InvalidKeyError` for a value
    that is not UTF-8.
    """
    wanted = header.lower()
    for name, value in message_headers(message):
        if name.lower() == wanted and value is not None:
            try:
                text: str = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidKeyError(
                    f"header {header!r} is not UTF-8 text: {value[:40]!r}"
                ) from exc
            return text
    return None


def message_headers(message: Message) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers as a list of ``(name, value)`` pairs (empty if none)."""
    raw = message.headers()
    if raw is None:
        return []
    items = raw.items() if isinstance(raw, dict) else raw
    return [
        (name, value.encode("utf-8") if isinstance(value, str) else value) for name, value in items
    ]


def _coordinates(message: Message) -> tuple[str, int, int]:
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    # Only records fetched from a partition reach this point, and they always carry all three.
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def load_handler(ref: str) -> Handler:
    """Import ``module:attribute`` (attribute may be dotted) and check that it is callable."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(
            f"invalid handler {ref!r}: expected module:function, e.g. myapp.consumers:handle"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import handler module {module_name!r}: {exc} (run from the directory that "
            "contains it, or put it on PYTHONPATH)"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ConfigurationError(f"handler {ref!r} is not callable")
    handler: Handler = obj
    return handler


# -- metrics -------------------------------------------------------------------------------------


class _Metrics:
    """Prometheus collectors, created once per registry and shared by runners in a process."""

    # Weak keys: a registry that is gone must not hand its collectors to a new registry that
    # happens to reuse its address.
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = (
        weakref.WeakKeyDictionary()
    )
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        labels = ("group", "topic")
        self.consumed = Counter(
            "outbox_consumer_consumed",
            "Messages received from Kafka (redeliveries included).",
            labels, registry=registry,
        )  # fmt: skip
        self.processed = Counter(
            "outbox_consumer_processed",
            "Messages whose handler ran and whose unit of work committed.",
            labels, registry=registry,
        )  # fmt: skip
        self.replayed = Counter(
            "outbox_consumer_replayed",
            "Duplicates answered from the stored outcome without calling the handler "
            "(status: completed, or failed for a key that had failed permanently).",
            (*labels, "status"), registry=registry,
        )  # fmt: skip
        self.failed = Counter(
            "outbox_consumer_failed",
            "Attempts that did not finish a message (kind: error, permanent, key_in_progress, "
            "dead_letter_unavailable, database_unavailable).",
            (*labels, "kind"), registry=registry,
        )  # fmt: skip
        self.dead_lettered = Counter(
            "outbox_consumer_dead_lettered",
            "Messages sent to the dead-letter topic and confirmed, by reason.",
            (*labels, "reason"), registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            "outbox_consumer_processing_seconds",
            "Time to handle one attempt at a message (unit of work included).",
            labels, registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )  # fmt: skip

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None) -> _Metrics:
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        with cls._lock:
            metrics = cls._by_registry.get(registry)
            if metrics is None:
                metrics = cls._by_registry[registry] = cls(registry)
            return metrics


# -- the runner ----------------------------------------------------------------------------------


@dataclass
class _Partition:
    """What the runner holds for one assigned partition.

    ``backlog`` keeps received messages in offset order; its head is the message being worked
    on. ``next_offset`` is the offset to commit (last finished message + 1), so a commit never
    passes an unfinished message.
    """

    backlog: deque[Message] = field(default_factory=deque)
    next_offset: int | None = None
    committed: int | None = None
    attempts: int = 0
    waits: int = 0
    retry_at: float = 0.0
    paused: bool = False
    dead_letter: DeadLetter | None = None

    def finish(self, offset: int) -> None:
        self.backlog.popleft()
        self.next_offset = offset + 1
        self.attempts = 0
        self.waits = 0
        self.retry_at = 0.0
        self.dead_letter = None


_TP = tuple[str, int]


class ConsumerRunner:
    """Feeds Kafka messages through units of work and commits offsets behind them.

    ``ConsumerRunner(outbox, handler, topics=[...], group="billing", bootstrap_servers=...,
    kafka_config={...}, key_header=..., max_attempts=5, dlq_topic_suffix=".dlq", ...)`` takes
    the fields of :class:`ConsumerConfig` as keywords (or a ready ``config=``). ``key_func``
    replaces the header lookup; ``fingerprint_func`` adds a request fingerprint to each key.

    :meth:`run` blocks until :meth:`stop` is called (from a signal handler or another thread),
    then finishes the message in hand, commits and returns. One runner is one Kafka consumer;
    run several processes (or runners) with the same group to scale out.
    """

    def __init__(
        self,
        outbox: Outbox,
        handler: Handler,
        config: ConsumerConfig | None = None,
        *,
        key_func: KeyFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
        metrics_registry: CollectorRegistry | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = ConsumerConfig(**settings)
        elif settings:
            config = dataclasses.replace(config, **settings)
        if not callable(handler):
            raise ConfigurationError(f"handler must be callable, got {handler!r}")
        self.config = config.validate()
        self.outbox = outbox
        self._handler = handler
        self._key_func = key_func
        self._fingerprint_func = fingerprint_func
        self._scope = config.effective_scope
        self._permanent: tuple[type[BaseException], ...] = (
            PermanentError,
            *outbox.config.permanent_errors,
        )
        self._metrics = _Metrics.for_registry(metrics_registry)
        self._registry = metrics_registry
        self._stopping = threading.Event()
        self._partitions: dict[_TP, _Partition] = {}
        self._consumer: Consumer | None = None
        self._dlq: DeadLetterProducer | None = None
        self._last_commit = 0.0
        self._fatal: KafkaError | None = None
        self._running = threading.Lock()
        # Last turn of the poll loop (monotonic); None while the loop is not running.
        self._heartbeat: float | None = None

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
            try:
                self._consumer = Consumer(self._consumer_config())
                self._dlq = DeadLetterProducer(
                    producer_config(self.config.kafka_config, self.config.effective_bootstrap),
                    timeout=self.config.dlq_timeout,
                )
            except KafkaException as exc:
                raise ConfigurationError(
                    "the Kafka client refused the configuration: "
                    f"{_redact_secrets(str(exc), self.config.kafka_config)}; check kafka_config"
                ) from exc
            self._consumer.subscribe(
                list(self.config.topics),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            log.info(
                "consuming %s as group %r (scope %r) from %s",
                ", ".join(self.config.topics),
                self.config.group,
                self._scope,
                self.config.effective_bootstrap,
            )
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                batch = self._consumer.consume(self.config.batch_size, self._poll_timeout())
                for message in batch:
                    self._accept(message)
                self._work()
                self._commit_if_due()
        finally:
            self._heartbeat = None
            try:
                self._shutdown()
            finally:
                self._running.release()
        if self._fatal is not None:
            raise ConsumerError(f"fatal Kafka client error: {self._fatal}; restart the consumer")

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (safe from signal handlers)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    def healthy(self, max_silence: float) -> bool:
        """True while :meth:`run` is consuming and its loop moved within ``max_silence`` seconds.

        The loop moves on every poll (at least every ``poll_timeout``) and on every attempt at a
        message, so only one step that takes longer -- a handler, or a dead letter waiting up to
        ``dlq_timeout`` for the broker -- makes the runner look stuck. False before :meth:`run`,
        once :meth:`stop` was called, and after :meth:`run` returned.
        """
        beat = self._heartbeat
        return (
            beat is not None
            and not self._stopping.is_set()
            and time.monotonic() - beat <= max_silence
        )

    # -- Kafka plumbing ------------------------------------------------------------------------

    def _consumer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
        }
        config.update(self.config.kafka_config)
        config.update(
            {
                "bootstrap.servers": self.config.effective_bootstrap,
                "group.id": self.config.group,
                "enable.auto.commit": False,
                "on_commit": self._on_commit,
                "error_cb": self._on_client_error,
            }
        )
        return config

    def _on_client_error(self, err: KafkaError) -> None:
        # librdkafka reconnects by itself; these are reported, never dropped silently.
        if err.fatal():
            log.error("fatal Kafka client error: %s", err)
            self._fatal = err
            self.stop()
        else:
            log.warning("Kafka client error: %s", err)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._partitions.setdefault((tp.topic, tp.partition), _Partition())
        log.info("assigned %s", _describe(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        # The new owner starts at the committed offset: commit what is finished. Messages in a
        # backlog are dropped here and redelivered there; a unit of work that committed but
        # whose offset did not is replayed there, not applied twice.
        self._commit(sync=True, only=keys)
        self._forget(consumer, keys)
        log.info("revoked %s", _describe(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member may own these already; committing now could move its offsets back.
        self._forget(consumer, [(tp.topic, tp.partition) for tp in partitions])
        log.warning("lost %s without a commit (session timed out?)", _describe(partitions))

    def _forget(self, consumer: Consumer, keys: Iterable[_TP]) -> None:
        paused = []
        for key in keys:
            state = self._partitions.pop(key, None)
            if state is not None and state.paused:
                paused.append(TopicPartition(*key))
        if paused:
            # A pause outlives the assignment in some client versions; never carry it over.
            try:
                consumer.resume(paused)
            except KafkaException as exc:
                log.debug("resume of revoked partitions failed: %s", exc)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if err is not None:
            # The next commit carries the same or a later offset; until then a crash only means
            # redelivery, which the idempotency key absorbs.
            log.warning("offset commit failed: %s", err)
            return
        for tp in partitions:
            if tp.error is not None:
                log.warning("offset commit of %s[%d] failed: %s", tp.topic, tp.partition, tp.error)
                continue
            state = self._partitions.get((tp.topic, tp.partition))
            if state is not None and tp.offset >= 0:
                state.committed = max(state.committed or 0, tp.offset)

    def _commit(self, sync: bool, only: Iterable[_TP] | None = None) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        keys = list(only) if only is not None else list(self._partitions)
        offsets = []
        for key in keys:
            state = self._partitions.get(key)
            if (
                state is not None
                and state.next_offset is not None
                and (state.committed is None or state.next_offset > state.committed)
            ):
                offsets.append(TopicPartition(key[0], key[1], state.next_offset))
        self._last_commit = time.monotonic()
        if not offsets:
            return
        try:
            if sync:
                self._on_commit(None, consumer.commit(offsets=offsets, asynchronous=False))
            else:
                consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            log.warning("offset commit of %s failed: %s", _describe(offsets), exc)

    def _commit_if_due(self) -> None:
        if time.monotonic() - self._last_commit >= self.config.commit_interval:
            self._commit(sync=False)

    def _poll_timeout(self) -> float:
        now = time.monotonic()
        timeout = min(self.config.poll_timeout, self.config.commit_interval)
        for state in self._partitions.values():
            if state.backlog:
                timeout = min(timeout, max(0.0, state.retry_at - now))
        return timeout

    def _accept(self, message: Message) -> None:
        err = message.error()
        if err is not None:
            if err.fatal():
                raise ConsumerError(f"fatal Kafka consumer error: {err}; restart the consumer")
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("Kafka consumer error on %s: %s", message.topic(), err)
            return
        topic, partition, _ = _coordinates(message)
        key = (topic, partition)
        state = self._partitions.get(key)
        if state is None:
            # Fetched before its partition was revoked in this same poll: it belongs to the new
            # owner now. Processing it here would apply it with no offset of ours to commit,
            # and the new owner would meet it again.
            log.debug("dropped %s[%d]@%d: partition no longer assigned", *_coordinates(message))
            return
        state.backlog.append(message)
        self._metrics.consumed.labels(self.config.group, key[0]).inc()

    def _pause(self, key: _TP, state: _Partition) -> None:
        if not state.paused and self._consumer is not None:
            # Pausing stops fetching and drops prefetched records; resume() continues after the
            # last message handed to us, which is the tail of the backlog: nothing is skipped.
            self._consumer.pause([TopicPartition(*key)])
            state.paused = True

    def _resume(self, key: _TP, state: _Partition) -> None:
        if state.paused and self._consumer is not None:
            self._consumer.resume([TopicPartition(*key)])
            state.paused = False

    # -- the work ------------------------------------------------------------------------------

    def _work(self) -> None:
        for key, state in list(self._partitions.items()):
            while state.backlog and not self._stopping.is_set():
                if key not in self._partitions:
                    break  # revoked while a dead-letter commit served a rebalance
                now = time.monotonic()
                if state.retry_at > now:
                    break
                message = state.backlog[0]
                self._heartbeat = now
                outcome = self._attempt(message, state)
                if outcome is Outcome.RETRY:
                    self._pause(key, state)
                    break
                state.finish(_coordinates(message)[2])
                if outcome is Outcome.DEAD_LETTERED:
                    # Shrinks the window in which a crash would dead-letter it a second time.
                    self._commit(sync=True, only=[key])
            if key not in self._partitions:
                continue  # revoked while a dead-letter commit served a rebalance
            if not state.backlog:
                self._resume(key, state)

    def _attempt(self, message: Message, state: _Partition) -> Outcome:
        topic = message.topic()
        started = time.perf_counter()
        try:
            outcome = self._apply(message, state)
        finally:
            self._metrics.duration.labels(self.config.group, topic).observe(
                time.perf_counter() - started
            )
        labels = (self.config.group, topic)
        if outcome is Outcome.PROCESSED:
            self._metrics.processed.labels(*labels).inc()
        elif outcome is Outcome.REPLAYED:
            self._metrics.replayed.labels(*labels, "completed").inc()
        elif outcome is Outcome.PREVIOUSLY_FAILED:
            self._metrics.replayed.labels(*labels, "failed").inc()
        return outcome

    def _key_of(self, message: Message) -> str | None:
        if self._key_func is not None:
            return self._key_func(message)
        return header_key(message, self.config.key_header)

    def _apply(self, message: Message, state: _Partition) -> Outcome:
        if state.dead_letter is not None:  # only the dead letter itself is left to send
            return self._send_dead_letter(message, state, state.dead_letter)
        try:
            key = self._key_of(message)
            fingerprint = self._fingerprint_func(message) if self._fingerprint_func else None
        except ValidationError as exc:
            return self._dead_letter_now(message, state, Reason.INVALID_INPUT, exc)
        except Exception as exc:
            return self._failed(message, state, exc)
        if key is None:
            return self._dead_letter_now(message, state, Reason.MISSING_KEY, _MissingKey(
                f"no {self.config.key_header!r} header: without an idempotency key the message "
                "cannot be applied at most once; have the producer set the header (the outbox "
                "relay always does) or pass key_func"
            ))  # fmt: skip
        sent = False
        try:
            with self.outbox.unit_of_work(key, scope=self._scope, fingerprint=fingerprint) as uow:
                if uow.replayed:
                    return Outcome.REPLAYED
                try:
                    result = self._handler(uow, message)
                except self._permanent as exc:
                    # Dead-letter while the key is still held, before the failure is recorded:
                    # a key recorded as failed has always been dead-lettered, so redeliveries
                    # and duplicates of it need no second dead letter.
                    letter = DeadLetter.from_exception(
                        Reason.PERMANENT_ERROR, exc, state.attempts + 1
                    )
                    self._metrics.failed.labels(
                        self.config.group, message.topic(), "permanent"
                    ).inc()
                    try:
                        self._produce_dead_letter(message, letter)
                    except DeadLetterError as unconfirmed:
                        raise _Unconfirmed(unconfirmed) from unconfirmed
                    sent = True
                    raise
                try:
                    uow.result = result
                except SerializationError as exc:
                    # Leaves the unit of work as a BaseException: rolled back, and never
                    # recorded as failed by an OutboxConfig.permanent_errors entry.
                    raise _Refused(
                        SerializationError(
                            f"the handler's return value cannot be stored as the key's result "
                            f"({exc}); return JSON-compatible data (dict, list, str, number, "
                            "bool or None)"
                        )
                    ) from exc
            return Outcome.PROCESSED
        except _Unconfirmed as exc:
            return self._dead_letter_unavailable(message, state, exc.error)
        except _Refused as exc:
            return self._dead_letter_now(message, state, Reason.INVALID_INPUT, exc.error)
        except Exception as exc:
            if sent:
                self._count_dead_letter(message, Reason.PERMANENT_ERROR)
                log.warning("dead-lettered %s (key %r): %s", _where(message), key, _one_line(exc))
                return Outcome.DEAD_LETTERED
            if isinstance(exc, KeyInProgress):
                return self._in_progress(message, state, key)
            if isinstance(exc, PreviouslyFailed):
                log.info(
                    "%s: key %r failed permanently earlier and was dead-lettered then; "
                    "acknowledged without a second dead letter", _where(message), key,
                )  # fmt: skip
                return Outcome.PREVIOUSLY_FAILED
            if isinstance(exc, KeyReuseError):
                return self._dead_letter_now(message, state, Reason.KEY_REUSE, exc)
            if isinstance(exc, ValidationError):
                return self._dead_letter_now(message, state, Reason.INVALID_INPUT, exc)
            if isinstance(exc, DeadLetterError):
                return self._dead_letter_unavailable(message, state, exc)
            if database_unavailable(exc):
                return self._database_unavailable(message, state, exc)
            return self._failed(message, state, exc)

    def _database_unavailable(self, message: Message, state: _Partition, exc: Exception) -> Outcome:
        # Not the message's fault: an outage or failover must never exhaust its attempts and
        # dead-letter it. Retried, in order, until PostgreSQL answers again.
        delay = self._wait(
            message,
            state,
            "database_unavailable",
            self.config.retry_backoff,
            self.config.retry_backoff_max,
        )
        log.warning(
            "%s: PostgreSQL unavailable (%s); retrying in %.2fs, attempts not counted",
            _where(message), _one_line(exc), delay,
        )  # fmt: skip
        return Outcome.RETRY

    def _wait(
        self, message: Message, state: _Partition, kind: str, base: float, cap: float
    ) -> float:
        """Schedule the same message again after a backoff, without counting an attempt (the
        cause is not the message); returns the delay."""
        state.waits += 1
        delay = backoff_delay(state.waits, base, cap)
        state.retry_at = time.monotonic() + delay
        self._metrics.failed.labels(self.config.group, message.topic(), kind).inc()
        return delay

    def _in_progress(self, message: Message, state: _Partition, key: str) -> Outcome:
        delay = self._wait(
            message,
            state,
            "key_in_progress",
            self.config.in_progress_backoff,
            self.config.in_progress_backoff_max,
        )
        log.debug("%s: key %r in progress elsewhere; retry in %.3fs", _where(message), key, delay)
        return Outcome.RETRY

    def _failed(self, message: Message, state: _Partition, exc: Exception) -> Outcome:
        state.attempts += 1
        self._metrics.failed.labels(self.config.group, message.topic(), "error").inc()
        if state.attempts >= self.config.max_attempts:
            log.error(
                "%s failed %d times, dead-lettering it: %s",
                _where(message), state.attempts, _one_line(exc), exc_info=exc,
            )  # fmt: skip
            return self._dead_letter_now(message, state, Reason.RETRIES_EXHAUSTED, exc)
        delay = backoff_delay(
            state.attempts, self.config.retry_backoff, self.config.retry_backoff_max
        )
        state.retry_at = time.monotonic() + delay
        log.warning(
            "%s failed (attempt %d of %d), retrying in %.2fs: %s",
            _where(message), state.attempts, self.config.max_attempts, delay, _one_line(exc),
        )  # fmt: skip
        return Outcome.RETRY

    def _dead_letter_now(
        self, message: Message, state: _Partition, reason: Reason, exc: BaseException
    ) -> Outcome:
        letter = DeadLetter.from_exception(reason, exc, max(1, state.attempts))
        state.dead_letter = letter
        return self._send_dead_letter(message, state, letter)

    def _send_dead_letter(self, message: Message, state: _Partition, letter: DeadLetter) -> Outcome:
        try:
            self._produce_dead_letter(message, letter)
        except DeadLetterError as exc:
            return self._dead_letter_unavailable(message, state, exc)
        self._count_dead_letter(message, letter.reason)
        log.warning("dead-lettered %s (%s): %s", _where(message), letter.reason, letter.error)
        return Outcome.DEAD_LETTERED

    def _dead_letter_unavailable(
        self, message: Message, state: _Partition, exc: DeadLetterError
    ) -> Outcome:
        # Never commit a message whose dead letter is not durable: keep retrying it.
        delay = self._wait(
            message,
            state,
            "dead_letter_unavailable",
            self.config.retry_backoff,
            self.config.retry_backoff_max,
        )
        log.error("%s: %s; retrying in %.2fs", _where(message), exc, delay)
        return Outcome.RETRY

    def _produce_dead_letter(self, message: Message, letter: DeadLetter) -> None:
        assert self._dlq is not None
        topic, partition, offset = _coordinates(message)
        headers = dead_letter_headers(
            message_headers(message),
            topic=topic,
            partition=partition,
            offset=offset,
            group=self.config.group,
            letter=letter,
        )
        self._dlq.send(
            (topic, partition, offset),
            dead_letter_topic(topic, self.config.dlq_topic_suffix),
            message.key(),
            message.value(),
            headers,
        )

    def _count_dead_letter(self, message: Message, reason: Reason) -> None:
        self._metrics.dead_lettered.labels(self.config.group, message.topic(), str(reason)).inc()

    def _shutdown(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            try:
                self._commit(sync=True)
            finally:
                try:
                    consumer.close()  # leaves the group: partitions move on at once
                except (KafkaException, RuntimeError) as exc:
                    log.warning("closing the Kafka consumer failed: %s", exc)
                self._consumer = None
        if self._dlq is not None:
            self._dlq.close()
            self._dlq = None
        self._partitions.clear()
        log.info("consumer of group %r stopped", self.config.group)


class _MissingKey(Exception):
    """Stands for the error of a message that carries no idempotency key."""


class _Refused(BaseException):
    """Carries a refused handler result out of a unit of work (rolled back, not recorded).

    A BaseException for the same reason as :class:`_Unconfirmed`: the message is dead-lettered
    as ``invalid-input`` whatever ``OutboxConfig.permanent_errors`` holds.
    """

    def __init__(self, error: ValidationError) -> None:
        super().__init__(str(error))
        self.error = error


class _Unconfirmed(BaseException):
    """Carries a failed dead letter out of a unit of work without recording the key as failed.

    A BaseException, so that no ``OutboxConfig.permanent_errors`` entry (even ``Exception``)
    can make the unit of work record a failure for a message whose dead letter is not durable.
    """

    def __init__(self, error: DeadLetterError) -> None:
        super().__init__(str(error))
        self.error = error


def serve_metrics(
    runner: ConsumerRunner, port: int, *, host: str = "", max_silence: float | None = None
) -> MetricsServer:
    """Serve ``/metrics`` and ``/healthz`` for ``runner`` on ``port`` (0: any free port).

    ``/metrics`` is the runner's registry (the global one by default) in Prometheus text format;
    ``/healthz`` answers 200 while :meth:`ConsumerRunner.healthy` holds and 503 otherwise, so an
    orchestrator restarts a wedged consumer. ``max_silence`` defaults to 60 s or twice
    ``dlq_timeout``, whichever is longer: one attempt at a message may legitimately wait that
    long for a dead letter. The server is the relay's (:class:`outbox.metrics.MetricsServer`);
    its ``port`` attribute names the bound port, ``close()`` stops it.
    """
    from outbox.metrics import MetricsServer

    if max_silence is None:
        max_silence = max(60.0, 2 * runner.config.dlq_timeout)
    return MetricsServer(_Health(runner), port, host=host, max_silence=max_silence).start()


class _Health:
    """A runner seen by :class:`outbox.metrics.MetricsServer`."""

    def __init__(self, runner: ConsumerRunner) -> None:
        self._runner = runner

    def render(self) -> bytes:
        from prometheus_client import REGISTRY, generate_latest

        return bytes(generate_latest(self._runner._registry or REGISTRY))

    def healthy(self, max_silence: float) -> bool:
        return self._runner.healthy(max_silence)


def consume(
    outbox: Outbox,
    handler: Handler,
    *,
    install_signal_handlers: bool = True,
    **settings: Any,
) -> None:
    """Run a :class:`ConsumerRunner` until SIGTERM or SIGINT (the simple, blocking form).

    ``settings`` are the :class:`ConsumerRunner` keywords (``topics``, ``group``,
    ``bootstrap_servers``, ``kafka_config``, ``key_func``...). A signal lets the message in
    hand finish, commits the finished offsets and returns. Signal handlers are installed only
    from the main thread and restored on return.
    """
    runner = ConsumerRunner(outbox, handler, **settings)
    with _signals_stop(runner, install_signal_handlers):
        runner.run()


class _signals_stop:
    """Context manager: SIGTERM/SIGINT call ``runner.stop()``; previous handlers come back."""

    def __init__(self, runner: ConsumerRunner, enabled: bool) -> None:
        self._runner = runner
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: finishing the message in hand", signal.Signals(signum).name)
        self._runner.stop()

    def __enter__(self) -> None:
        if self._enabled:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _describe(partitions: Iterable[TopicPartition]) -> str:
    parts = [f"{tp.topic}[{tp.partition}]" for tp in partitions]
    return ", ".join(parts) if parts else "nothing"


def _where(message: Message) -> str:
    return f"{message.topic()}[{message.partition()}]@{message.offset()}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- CLI -----------------------------------------------------------------------------------------


def register_cli(subparsers: Any) -> None:
    """Add ``outbox consume`` to the ``outbox`` command."""
    from outbox import cli_old as cli

    p: argparse.ArgumentParser = subparsers.add_parser(
        "consume",
        help="run a handler on Kafka messages, at most once per idempotency key",
        description="Consume TOPICs as consumer group GROUP and run HANDLER (module:function, "
        "called as handler(uow, message)) inside a unit of work keyed by each message's "
        "X-Idempotency-Key header. SIGTERM/SIGINT finish the message in hand, commit and exit 0.",
    )
    p.add_argument("handler", metavar="HANDLER", help="module:function, e.g. app.consumers:handle")
    p.add_argument(
        "--topic", dest="topics", action="append", required=True, metavar="TOPIC",
        help="topic to consume (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--group", default=env(ENV_GROUP),
        help=f"Kafka consumer group, also the idempotency scope (env {ENV_GROUP})",
    )  # fmt: skip
    p.add_argument(
        "--scope", default=None,
        help="idempotency scope, if it must differ from the group name",
    )  # fmt: skip
    cli.add_database_url(p)
    p.add_argument(
        "--redis-url", default=env(ENV_REDIS_URL),
        help=f"Redis URL for the duplicate fast path (env {ENV_REDIS_URL}; optional)",
    )  # fmt: skip
    cli.add_kafka(p)
    p.add_argument(
        "--key-header", default=IDEMPOTENCY_HEADER,
        help=f"header that carries the idempotency key (default {IDEMPOTENCY_HEADER})",
    )  # fmt: skip
    p.add_argument(
        "--max-attempts", type=int, default=5,
        help="attempts before a failing message is dead-lettered (default 5)",
    )  # fmt: skip
    p.add_argument(
        "--dlq-suffix", default=".dlq",
        help="dead-letter topic of TOPIC is TOPIC+suffix (default .dlq)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-port", type=int, default=env_int(ENV_METRICS_PORT, None),
        help=f"serve /metrics (Prometheus) and /healthz on this port (env {ENV_METRICS_PORT}; "
        "default off)",
    )  # fmt: skip
    cli.add_log_level(p)
    p.set_defaults(func=_cmd_consume)


def _cmd_consume(args: argparse.Namespace) -> int:
    from outbox import cli_old as cli
    from outbox.uow import Outbox

    database_url = cli.require(args.database_url, "--database-url", "OUTBOX_DATABASE_URL")
    group = cli.require(args.group, "--group", ENV_GROUP)
    bootstrap = cli.require(args.bootstrap_servers, "--bootstrap-servers", ENV_KAFKA_BOOTSTRAP)
    kafka_config = cli.parse_kafka_config(args.kafka_config, env(ENV_KAFKA_CONFIG))
    # Like `python -m`: handler modules next to where the command runs are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    handler = load_handler(args.handler)
    config = ConsumerConfig(
        topics=tuple(args.topics),
        group=group,
        scope=args.scope,
        bootstrap_servers=bootstrap,
        kafka_config=kafka_config,
        key_header=args.key_header,
        max_attempts=args.max_attempts,
        dlq_topic_suffix=args.dlq_suffix,
    ).validate()
    ob = Outbox(database_url, redis_url=args.redis_url, schema=args.schema)
    try:
        runner = ConsumerRunner(ob, handler, config)
        server = None
        if args.metrics_port:
            server = serve_metrics(runner, args.metrics_port)
            log.info("metrics on :%d/metrics, health on :%d/healthz", server.port, server.port)
        log.info(
            "database %s, redis %s",
            redact_url(database_url),
            redact_url(args.redis_url) if args.redis_url else "off",
        )
        try:
            with _signals_stop(runner, True):
                runner.run()
        finally:
            if server is not None:
                server.close()
    finally:
        ob.close()
    return cli.EXIT_OK


def _redact_secrets(text: str, kafka_config: Mapping[str, object]) -> str:
    """Hide the values of secret-looking properties (passwords, secrets, keys) in ``text``."""
    for name, value in kafka_config.items():
        secret = any(word in name.lower() for word in ("password", "secret", "key.pem", "token"))
        if secret and isinstance(value, str) and value:
            text = text.replace(value, "***")
    return text
