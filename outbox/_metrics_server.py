"""The HTTP server of ``/metrics``, ``/healthz`` and ``/readyz`` that the relay and consumer share.

Invariant: an idle, slow or oversized client never blocks an answer to a probe -- one asyncio
loop serves every connection, each request has a deadline and a size limit, and connections past
the limit push out the oldest unanswered one.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST


class HealthSource(Protocol):
    """What :class:`MetricsServer` serves: a metrics page, a liveness and a readiness verdict.

    The relay's metrics are one; the consumer runner brings its own.
    """

    def render(self) -> bytes: ...

    def healthy(self, max_silence: float) -> bool: ...

    def ready(self, max_silence: float) -> bool: ...


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
