"""Prometheus metrics and the health endpoint of ``outbox-relay``.

One small HTTP server on ``--metrics-port`` answers ``/metrics`` (Prometheus text format),
``/healthz`` (200 while the relay's loop is turning and its database session is up, 503
otherwise, so an orchestrator can restart a wedged relay) and ``/readyz`` (200 while it is also
registered for lanes -- owning some or waiting for them -- and the broker answered its last
check, so an orchestrator can tell a starting or cut-off relay from a serving one). Each relay
has its own registry, so several relays can live in one process (tests) without clashing.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class HealthSource(Protocol):
    """What :class:`MetricsServer` serves: a metrics page, a liveness and a readiness verdict.

    :class:`RelayMetrics` is one; the consumer runner brings its own (``outbox.consumer``).
    """

    def render(self) -> bytes: ...

    def healthy(self, max_silence: float) -> bool: ...

    def ready(self, max_silence: float) -> bool: ...


class RelayMetrics:
    """The relay's metrics (names are documented in docs/relay.md)."""

    def __init__(self, max_silence: float = 30.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published", "Records confirmed by Kafka and removed", registry=r
        )
        self.failed = Counter(
            "outbox_relay_failed",
            "Records whose delivery failed (kind: retriable or permanent)",
            ["kind"],
            registry=r,
        )
        self.parked = Counter("outbox_relay_parked", "Rows parked by this relay", registry=r)
        self.backlog = Gauge(
            "outbox_relay_backlog_rows", "Rows waiting in the outbox (not parked)", registry=r
        )
        self.parked_rows = Gauge(
            "outbox_relay_parked_rows", "Parked rows in the outbox", registry=r
        )
        self.oldest_age = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest row waiting in the outbox",
            registry=r,
        )
        self.batch_duration = Histogram(
            "outbox_relay_batch_duration_seconds",
            "Claim, produce, confirm and delete of one batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.lanes_owned = Gauge("outbox_relay_lanes_owned", "Lanes this relay owns", registry=r)
        self.lanes = Gauge(
            "outbox_relay_lanes", "Lanes of the outbox (--lanes), shared by its relays", registry=r
        )
        self.up = Gauge(
            "outbox_relay_database_up", "1 while the database session is up", registry=r
        )
        topic = ("topic",)
        self.topic_backlog = Gauge(
            "outbox_relay_topic_backlog_rows", "Rows waiting in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self.topic_parked = Gauge(
            "outbox_relay_topic_parked_rows", "Parked rows in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self.topic_oldest_age = Gauge(
            "outbox_relay_topic_oldest_pending_age_seconds",
            "Age of the oldest row waiting in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self._topics: set[str] = set()
        self.heartbeat = time.monotonic()
        self.database_up = False
        # Set by the relay: false after a delivery outage or a failed broker check; stopping once
        # it was asked to stop.
        self.broker_up = False
        self.stopping = False
        self.max_silence = max_silence
        Gauge(
            "outbox_relay_ready",
            "1 while /readyz answers 200: the loop turns, the database session is up, the relay "
            "is registered for lanes (owning some or waiting) and the broker answered",
            registry=r,
        ).set_function(lambda: float(self.ready(self.max_silence)))

    def beat(self) -> None:
        """Record that the loop is alive (called every iteration)."""
        self.heartbeat = time.monotonic()

    def healthy(self, max_silence: float) -> bool:
        return self.database_up and time.monotonic() - self.heartbeat <= max_silence

    def ready(self, max_silence: float) -> bool:
        # The database session is registered among the relays before database_up is set.
        return self.broker_up and not self.stopping and self.healthy(max_silence)

    def topics(self, stats: dict[str, tuple[int, int, float]]) -> None:
        """``(backlog, parked, oldest pending age)`` per topic; topics gone from the outbox
        lose their series."""
        gauges = (self.topic_backlog, self.topic_parked, self.topic_oldest_age)
        for topic in self._topics - stats.keys():
            for gauge in gauges:
                gauge.remove(topic)
        for topic, values in stats.items():
            for gauge, value in zip(gauges, values, strict=True):
                gauge.labels(topic).set(value)
        self._topics = set(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a port, served from a daemon thread."""

    def __init__(self, metrics: HealthSource, port: int, host: str = "", max_silence: float = 30.0):
        handler = _handler(metrics, max_silence)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-relay-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(metrics: HealthSource, max_silence: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, metrics.render(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok = metrics.healthy(max_silence)
                self._reply(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n", "text/plain")
            elif path == "/readyz":
                ok = metrics.ready(max_silence)
                self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return None  # scrapes are not meaningful events

    return Handler
