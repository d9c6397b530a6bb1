"""Round trips and statements on the wire: a counting proxy in front of PostgreSQL.

:class:`WireCounter` is a loopback TCP proxy, in a process of its own (its work is nobody's
client CPU), that reads the server's side of every connection through it and counts two
messages of PostgreSQL's protocol: ReadyForQuery (``Z``), sent once at the end of every round
trip -- a simple-protocol query, however many statements it holds, or an extended-protocol
``Sync`` -- and CommandComplete (``C``), sent once for every statement the server ran
(``BEGIN``, ``SAVEPOINT`` and ``COMMIT`` included). Connections through it must not use TLS or
GSS encryption (:func:`proxied_url` turns both off), so that every byte is a framed message.

:func:`count_redis` counts the Redis commands a process sends (a command each round trip: the
cache sends no pipelines on the path of a single unit of work).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa


class WireCounter:
    """A counting proxy to ``host:port``; :meth:`read` gives (round trips, statements) so far."""

    def __init__(self, host: str, port: int) -> None:
        ctx = mp.get_context("fork")
        self._trips = ctx.Value("q", 0)
        self._statements = ctx.Value("q", 0)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._process = ctx.Process(
            target=_serve,
            args=(listener, host, port, self._trips, self._statements),
            daemon=True,
        )
        self._process.start()
        listener.close()

    def read(self) -> tuple[int, int]:
        return self._trips.value, self._statements.value

    def close(self) -> None:
        self._process.kill()
        self._process.join()


def proxied_url(url: str, counter: WireCounter) -> str:
    """``url`` through ``counter``, without TLS or GSS encryption."""
    parsed = sa.make_url(url)
    query = {**parsed.query, "sslmode": "disable", "gssencmode": "disable"}
    return parsed.set(host="127.0.0.1", port=counter.port, query=query).render_as_string(
        hide_password=False
    )


def _serve(listener: socket.socket, host: str, port: int, trips: Any, statements: Any) -> None:
    while True:
        client, _ = listener.accept()
        server = socket.create_connection((host, port))
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_forward, args=(client, server, None), daemon=True).start()
        threading.Thread(
            target=_forward, args=(server, client, (trips, statements)), daemon=True
        ).start()


def _forward(src: socket.socket, dst: socket.socket, counters: tuple[Any, Any] | None) -> None:
    pending = b""
    try:
        while data := src.recv(65536):
            if counters is not None:
                # Counted before the bytes go on: once the client has a reply, it is counted.
                pending += data
                trips = statements = 0
                while len(pending) >= 5:
                    length = int.from_bytes(pending[1:5], "big")
                    if len(pending) < 1 + length:
                        break
                    kind = pending[0]
                    trips += kind == ord("Z")
                    statements += kind == ord("C")
                    pending = pending[1 + length :]
                if trips or statements:
                    with counters[0].get_lock():
                        counters[0].value += trips
                    with counters[1].get_lock():
                        counters[1].value += statements
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class _RedisCount:
    commands = 0


@contextlib.contextmanager
def count_redis() -> Iterator[type[_RedisCount]]:
    """Count the commands every redis-py connection of this process sends, while inside."""
    import redis.asyncio.connection
    import redis.connection

    patched = []
    for cls in (redis.connection.AbstractConnection, redis.asyncio.connection.AbstractConnection):
        original = cls.send_packed_command

        def counting(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            _RedisCount.commands += 1
            return _original(self, *args, **kw)

        cls.send_packed_command = counting  # type: ignore[method-assign]
        patched.append((cls, original))
    _RedisCount.commands = 0
    try:
        yield _RedisCount
    finally:
        for cls, original in patched:
            cls.send_packed_command = original  # type: ignore[method-assign]
