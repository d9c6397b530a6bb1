"""Prometheus metrics and the health endpoints of the consumer runner.

Invariant: the collectors are created once per registry and shared by the runners of a process,
told apart by their ``group`` and ``topic`` labels.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from outbox._core.disposition import AttemptVerdict
from outbox._metrics_server import DEFAULT_HOST, MetricsServer

REPLAY_STORES = ("redis", "postgres")


class _Runner(Protocol):
    """What the health endpoint needs of a consumer runner."""

    metrics_registry: CollectorRegistry | None

    @property
    def config(self) -> Any: ...

    def healthy(self, max_silence: float) -> bool: ...

    def ready(self, max_silence: float) -> bool: ...


class _Series:
    """The labelled series of one ``(group, topic)`` that every message touches: looking them up
    once (``labels()`` costs a lock and a dict lookup) keeps the metrics off the hot path."""

    __slots__ = (
        "answered",
        "consumed",
        "duration",
        "processed",
        "replayed_completed",
        "replayed_failed",
    )

    def __init__(self, metrics: ConsumerMetrics, group: str, topic: str) -> None:
        self.consumed = metrics.consumed.labels(group, topic)
        self.processed = metrics.processed.labels(group, topic)
        self.replayed_completed = metrics.replayed.labels(group, topic, "completed")
        self.replayed_failed = metrics.replayed.labels(group, topic, "failed")
        self.duration = metrics.duration.labels(group, topic)
        self.answered = {s: metrics.replayed_from.labels(group, topic, s) for s in REPLAY_STORES}


class ConsumerMetrics:
    """Prometheus collectors, created once per registry and shared by runners in a process."""

    # Weak keys: a registry that is gone must not hand its collectors to a new registry that
    # happens to reuse its address.
    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ConsumerMetrics] = (
        weakref.WeakKeyDictionary()
    )
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("group", "topic")
        self.consumed = Counter(
            "outbox_consumer_consumed",
            "Messages received from Kafka (redeliveries included).",
            labels, registry=registry,
        )  # fmt: skip
        self.processed = Counter(
            "outbox_consumer_processed",
            "Messages whose handler ran and whose unit of work committed (or, under a Redis "
            "guard, whose outcome was stored).",
            labels, registry=registry,
        )  # fmt: skip
        self.replayed = Counter(
            "outbox_consumer_replayed",
            "Duplicates answered from the stored outcome without calling the handler "
            "(status: completed, or failed for a key that had failed permanently).",
            (*labels, "status"), registry=registry,
        )  # fmt: skip
        self.replayed_from = Counter(
            "outbox_consumer_replayed_from",
            "Duplicates answered from a stored result, by where it was read (store: redis, the "
            "cache's fast path or a Redis guard; postgres, the key's row in the claim).",
            (*labels, "store"), registry=registry,
        )  # fmt: skip
        self.failed = Counter(
            "outbox_consumer_failed",
            "Attempts that did not finish a message (kind: error, permanent, key_in_progress, "
            "conflict, dead_letter_unavailable, database_unavailable, guard_unavailable, "
            "lease_lost).",
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
        self.batch_size = Histogram(
            "outbox_consumer_batch_size",
            "Messages finished per micro-batch (one PostgreSQL transaction for the messages "
            "that need one; duplicates answered by Redis count too).",
            ("group",), registry=registry,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "outbox_consumer_batch_seconds",
            "Time to work through one micro-batch, its transaction's commit included.",
            ("group",), registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )  # fmt: skip
        self.lag = Gauge(
            "outbox_consumer_lag",
            "Messages of an assigned partition not finished yet: the partition's high watermark "
            "(as of the last fetch) minus the next offset to commit. Updated at offset commits.",
            ("group", "topic", "partition"), registry=registry,
        )  # fmt: skip
        self.ready = Gauge(
            "outbox_consumer_ready",
            "1 while the group's runner answers /readyz with 200: its loop turns and its last "
            "checks reached the broker and (with an outbox) PostgreSQL.",
            ("group",), registry=registry,
        )  # fmt: skip
        self._series: dict[tuple[str, str], _Series] = {}

    def _of(self, group: str, topic: str) -> _Series:
        series = self._series.get((group, topic))
        if series is None:
            series = self._series[(group, topic)] = _Series(self, group, topic)
        return series

    def received(self, group: str, topic: str) -> None:
        """A message came from Kafka."""
        self._of(group, topic).consumed.inc()

    def attempted(
        self, group: str, topic: str, outcome: AttemptVerdict | None, seconds: float
    ) -> None:
        """One attempt at a message took ``seconds`` and came to ``outcome`` (None: it raised).

        A message finished in a micro-batch is counted with its share of the batch's time."""
        series = self._of(group, topic)
        series.duration.observe(seconds)
        if outcome is AttemptVerdict.PROCESSED:
            series.processed.inc()
        elif outcome is AttemptVerdict.REPLAYED:
            series.replayed_completed.inc()
        elif outcome is AttemptVerdict.PREVIOUSLY_FAILED:
            series.replayed_failed.inc()

    def attempted_many(
        self, group: str, topic: str, outcome: AttemptVerdict, seconds: float, count: int
    ) -> None:
        """:meth:`attempted` of ``count`` messages with the same outcome and time: each
        counter moves once, by ``count``."""
        series = self._of(group, topic)
        observe = series.duration.observe
        for _ in range(count):
            observe(seconds)
        if outcome is AttemptVerdict.PROCESSED:
            series.processed.inc(count)
        elif outcome is AttemptVerdict.REPLAYED:
            series.replayed_completed.inc(count)
        elif outcome is AttemptVerdict.PREVIOUSLY_FAILED:
            series.replayed_failed.inc(count)

    def answered(self, group: str, topic: str, store: str) -> None:
        """A duplicate was answered from the stored result ``store`` held (redis, postgres)."""
        self._of(group, topic).answered[store].inc()

    def batch(self, group: str, messages: int, seconds: float) -> None:
        """A micro-batch finished ``messages`` messages in ``seconds``."""
        self.batch_size.labels(group).observe(messages)
        self.batch_seconds.labels(group).observe(seconds)

    def lagging(self, group: str, lags: Iterable[tuple[str, int, int]]) -> None:
        """``(topic, partition, lag)`` of assigned partitions whose lag is known."""
        for topic, partition, lag in lags:
            self.lag.labels(group, topic, str(partition)).set(lag)

    def unassigned(self, group: str, partitions: Iterable[tuple[str, int]]) -> None:
        """Partitions no longer assigned: their lag is another member's to report."""
        for topic, partition in partitions:
            with contextlib.suppress(KeyError):
                self.lag.remove(group, topic, str(partition))

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None) -> ConsumerMetrics:
        if registry is None:
            registry = REGISTRY
        with cls._lock:
            metrics = cls._by_registry.get(registry)
            if metrics is None:
                metrics = cls._by_registry[registry] = cls(registry)
            return metrics


def default_max_silence(config: Any) -> float:
    """How long a runner's loop may stand still before ``/healthz`` says it is stuck: 60 s or
    twice ``dlq_timeout``, whichever is longer (one attempt may wait that long for a dead
    letter)."""
    return max(60.0, 2 * float(config.dlq_timeout))


def serve_metrics(
    runner: _Runner, port: int, *, host: str = DEFAULT_HOST, max_silence: float | None = None
) -> MetricsServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` for ``runner`` on ``host:port`` (0: any
    free port; the loopback interface unless ``host`` says otherwise, e.g. ``0.0.0.0`` in a
    container).

    ``/metrics`` is the runner's registry (the global one by default) in Prometheus text format;
    ``/healthz`` answers 200 while :meth:`ConsumerRunner.healthy` holds and 503 otherwise, so an
    orchestrator restarts a wedged consumer; ``/readyz`` answers 200 while
    :meth:`ConsumerRunner.ready` holds (also the broker and the database answer).
    ``max_silence`` defaults to :func:`default_max_silence`. The server is the relay's
    (:class:`~outbox._metrics_server.MetricsServer`); its ``port`` attribute names the bound port,
    ``close()`` stops it.
    """
    if max_silence is None:
        max_silence = default_max_silence(runner.config)
    return MetricsServer(_Health(runner), port, host=host, max_silence=max_silence).start()


class _Health:
    """A runner seen by :class:`~outbox._metrics_server.MetricsServer`."""

    def __init__(self, runner: _Runner) -> None:
        self._runner = runner

    def render(self) -> bytes:
        return bytes(generate_latest(self._runner.metrics_registry or REGISTRY))

    def healthy(self, max_silence: float) -> bool:
        return self._runner.healthy(max_silence)

    def ready(self, max_silence: float) -> bool:
        return self._runner.ready(max_silence)
