"""Prometheus metrics and the health endpoint of ``outbox-relay``.

One small HTTP server on ``--metrics-port`` answers ``/metrics`` (Prometheus text format) and
``/healthz`` (200 while the relay's loop is turning and its database session is up, 503
otherwise, so an orchestrator can restart a wedged relay). Each relay has its own registry, so
several relays can live in one process (tests) without clashing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
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

from outbox._core.health import HorizonHolder, TableHealth


class HealthSource(Protocol):
    """What :class:`MetricsServer` serves: a metrics page and a liveness verdict.

    :class:`RelayMetrics` is one; the consumer runner brings its own (``outbox.consumer``).
    """

    def render(self) -> bytes: ...

    def healthy(self, max_silence: float) -> bool: ...


class RelayMetrics:
    """The relay's metrics (names are documented in docs/relay.md)."""

    def __init__(self) -> None:
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
        self.up = Gauge(
            "outbox_relay_database_up", "1 while the database session is up", registry=r
        )
        # Table health (outbox._core.health), refreshed with the backlog.
        self.table_live = Gauge(
            "outbox_table_live_tuples", "Live tuples of a toolkit table (estimate)", ["table"],
            registry=r,
        )  # fmt: skip
        self.table_dead = Gauge(
            "outbox_table_dead_tuples",
            "Dead tuples of a toolkit table: deleted rows VACUUM has not removed (yet)",
            ["table"],
            registry=r,
        )
        self.table_size = Gauge(
            "outbox_table_size_bytes", "A toolkit table with its indexes and TOAST", ["table"],
            registry=r,
        )  # fmt: skip
        self.table_vacuumed = Gauge(
            "outbox_table_last_vacuum_timestamp_seconds",
            "When a toolkit table was last vacuumed (by hand or autovacuum); 0 if never",
            ["table"],
            registry=r,
        )
        self.horizon_age = Gauge(
            "outbox_horizon_age_seconds",
            "How long the oldest transaction holding the xmin horizon back has been open "
            "(0 when nothing holds it or the holder is a replication slot)",
            registry=r,
        )
        self.horizon_xids = Gauge(
            "outbox_horizon_xid_age",
            "Transaction ids between the xmin horizon and now",
            registry=r,
        )
        self.horizon_holder = Gauge(
            "outbox_horizon_holder_info",
            "The oldest holder of the xmin horizon (1; never its query)",
            ["kind", "pid", "application_name", "state"],
            registry=r,
        )
        self.heartbeat = time.monotonic()
        self.database_up = False

    def set_health(self, tables: Sequence[TableHealth], holder: HorizonHolder | None) -> None:
        """Publish the tables' health and the horizon's holder."""
        for t in tables:
            self.table_live.labels(t.table).set(t.live_tuples)
            self.table_dead.labels(t.table).set(t.dead_tuples)
            self.table_size.labels(t.table).set(t.size_bytes)
            vacuumed = t.last_vacuum.timestamp() if t.last_vacuum is not None else 0.0
            self.table_vacuumed.labels(t.table).set(vacuumed)
        self.horizon_holder.clear()
        if holder is None:
            self.horizon_age.set(0)
            self.horizon_xids.set(0)
            return
        self.horizon_age.set(holder.age_seconds or 0.0)
        self.horizon_xids.set(holder.xid_age)
        self.horizon_holder.labels(
            holder.kind,
            "" if holder.pid is None else str(holder.pid),
            holder.application_name or holder.name or "",
            holder.state or "",
        ).set(1)

    def beat(self) -> None:
        """Record that the loop is alive (called every iteration)."""
        self.heartbeat = time.monotonic()

    def healthy(self, max_silence: float) -> bool:
        return self.database_up and time.monotonic() - self.heartbeat <= max_silence

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """``/metrics`` and ``/healthz`` on a port, served from a daemon thread."""

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
