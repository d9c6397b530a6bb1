"""Prometheus metrics and the health endpoint of ``outbox-relay``.

One small HTTP server on ``--metrics-port`` (on the loopback interface unless
``--metrics-host`` says otherwise) answers ``/metrics`` (Prometheus text format),
``/healthz`` (200 while the relay's loop is turning and its database session is up, 503
otherwise, so an orchestrator can restart a wedged relay) and ``/readyz`` (200 while it is also
registered for lanes -- owning some or waiting for them -- and the broker answered its last
check, so an orchestrator can tell a starting or cut-off relay from a serving one). Each relay
has its own registry, so several relays can live in one process (tests) without clashing.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence
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


# The server's bounds: a request is one line and a few headers; a scrape or probe sends it at
# once. Connections beyond MAX_CONNECTIONS push out the oldest unanswered one (an idle or
# half-sent request), so a flood of idle clients never crowds out a probe.
MAX_CONNECTIONS = 256
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 10.0
DEFAULT_HOST = "127.0.0.1"


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port``, served by one asyncio loop
    in a daemon thread.

    One thread serves every connection: an idle or half-sent request costs a socket, not a
    thread. Each connection has :data:`REQUEST_TIMEOUT` seconds to send a request of at most
    :data:`MAX_REQUEST_BYTES`; at most :data:`MAX_CONNECTIONS` are open at once, and a new one
    past that closes the oldest still unanswered. ``host`` defaults to the loopback interface:
    a container that is probed from outside sets ``0.0.0.0`` (``--metrics-host``).
    """

    def __init__(
        self,
        metrics: HealthSource,
        port: int,
        host: str = DEFAULT_HOST,
        max_silence: float = 30.0,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT,
    ):
        self._metrics = metrics
        self._max_silence = max_silence
        self._max_connections = max_connections
        self._request_timeout = request_timeout
        # Bound here, so that a port in use or an unknown host fails the caller at once.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=128)
        self.port = int(self._socket.getsockname()[1])
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._pending: dict[asyncio.StreamWriter, None] = {}  # unanswered, oldest first
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="outbox-relay-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        self._ready.wait()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        else:  # never started
            self._socket.close()
            self._loop.close()

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet answered (for tests and debugging)."""
        return len(self._pending)

    def _serve(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(
            asyncio.start_server(self._connection, sock=self._socket, limit=MAX_REQUEST_BYTES)
        )
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in list(self._pending):
                writer.transport.abort()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(server.wait_closed())
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._pending[writer] = None
        while len(self._pending) > self._max_connections:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.transport.abort()
        try:
            async with asyncio.timeout(self._request_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, content_type = self._answer(head)
            self._pending.pop(writer, None)
            writer.write(
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode("ascii")
                + body
            )
            async with asyncio.timeout(self._request_timeout):
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # too slow, too long, or gone: nothing to answer
        finally:
            self._pending.pop(writer, None)
            writer.close()

    def _answer(self, head: bytes) -> tuple[int, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n", "text/plain"
        method, target = parts[0].upper(), parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return 405, b"method not allowed: GET /metrics, /healthz or /readyz\n", "text/plain"
        if target == b"/metrics":
            return 200, self._metrics.render(), CONTENT_TYPE_LATEST
        if target == b"/healthz":
            ok = self._metrics.healthy(self._max_silence)
            return (200, b"ok\n", "text/plain") if ok else (503, b"unhealthy\n", "text/plain")
        if target == b"/readyz":
            ok = self._metrics.ready(self._max_silence)
            return (200, b"ready\n", "text/plain") if ok else (503, b"not ready\n", "text/plain")
        return 404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
