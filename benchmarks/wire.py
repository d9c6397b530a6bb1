"""A loopback TCP relay that counts round trips: how many times a client spoke after the server.

``--round-trips`` in benchmarks/consumer.py puts it between the measured processes and
PostgreSQL. A round trip is one turn of the conversation: the client sends (one or many
packets) and then waits for the server's answer; a pipelined batch of statements is one turn,
however many statements it holds. The relay forwards bytes as they come, on one thread of the
benchmark's process, so it adds a little latency to every turn (the figures of such a run carry
it, as under ``--profile``).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class RoundTrips:
    """Relays 127.0.0.1:``port`` to ``target`` and counts the clients' turns (:attr:`turns`)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self.turns = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        # Each side's peer, and whether the client spoke last on that connection.
        self._peer: dict[socket.socket, socket.socket] = {}
        self._client: dict[socket.socket, bool] = {}
        self._spoke: dict[socket.socket, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-trips", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(self.target)
        for side in (client, upstream):
            side.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(side, selectors.EVENT_READ, None)
        self._peer[client], self._peer[upstream] = upstream, client
        self._client[client], self._client[upstream] = True, False
        self._spoke[client] = False

    def _close(self, side: socket.socket) -> None:
        peer = self._peer.pop(side, None)
        for s in (side, peer):
            if s is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            self._peer.pop(s, None)
            self._client.pop(s, None)
            self._spoke.pop(s, None)
            s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.2):
                side = key.fileobj
                assert isinstance(side, socket.socket)
                if side is self._listener:
                    self._accept()
                    continue
                peer = self._peer.get(side)
                if peer is None:
                    continue
                try:
                    data = side.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._close(side)
                    continue
                if self._client[side]:
                    if not self._spoke[side]:
                        self.turns += 1
                        self._spoke[side] = True
                else:
                    self._spoke[peer] = False
                try:
                    peer.sendall(data)
                except OSError:
                    self._close(side)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for side in list(self._peer):
            self._close(side)
        self._sel.close()
        self._listener.close()
