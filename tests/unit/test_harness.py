"""The test harness's own tools that need no service: the TCP proxy, wait_for, free_port."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.common import free_port, in_ci, wait_for
from tests.fixtures.proxy import TcpProxy

REPO_ROOT = Path(__file__).resolve().parents[2]


class EchoServer:
    """A loopback server that echoes every byte and counts what it received."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._socks.append(conn)
            t = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _echo(self, conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                with self._lock:
                    self.received += len(data)
                conn.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        self._accept_thread.join(5)
        for t in self._threads:
            t.join(5)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[TcpProxy]:
    p = TcpProxy("127.0.0.1", echo.port)
    yield p
    p.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf.extend(chunk)
    return bytes(buf)


def _is_closed(sock: socket.socket) -> bool:
    """True when the peer closed or reset ``sock`` (waits up to the socket timeout)."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_proxy_forwards_bytes_both_ways_intact(proxy: TcpProxy) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB: more than the proxy buffers per direction
    with _connect(proxy.port) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        echoed = _recv_exactly(sock, len(payload))
        sender.join(5)
    assert echoed == payload
    assert proxy.accepted == 1


def test_cut_drops_live_connections_and_refuses_new_ones(proxy: TcpProxy, echo: EchoServer) -> None:
    with _connect(proxy.port) as live:
        live.sendall(b"ping")
        assert _recv_exactly(live, 4) == b"ping"

        proxy.cut()

        assert _is_closed(live)
        assert proxy.active == 0
        with pytest.raises(ConnectionRefusedError):
            _connect(proxy.port)

    proxy.restore()
    with _connect(proxy.port) as again:
        again.sendall(b"back")
        assert _recv_exactly(again, 4) == b"back"
    assert echo.connections == 2


def test_stall_forwards_nothing_but_keeps_the_connection(proxy: TcpProxy, echo: EchoServer) -> None:
    with _connect(proxy.port) as sock:
        sock.sendall(b"one")
        assert _recv_exactly(sock, 3) == b"one"

        proxy.stall()
        sock.sendall(b"two")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(3)
        assert echo.received == 3  # "two" never reached the server
        assert proxy.active == 1

        proxy.restore()
        sock.settimeout(5)
        assert _recv_exactly(sock, 3) == b"two"  # held, not lost
    assert echo.received == 6


def test_new_connection_during_stall_is_held_until_restore(proxy: TcpProxy) -> None:
    proxy.stall()
    with _connect(proxy.port) as sock:
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(4)
        proxy.restore()
        sock.settimeout(5)
        assert _recv_exactly(sock, 4) == b"held"


def test_stall_after_cut_reopens_the_listener(proxy: TcpProxy) -> None:
    proxy.cut()
    proxy.stall()
    with _connect(proxy.port) as sock:
        sock.sendall(b"x")
        proxy.restore()
        assert _recv_exactly(sock, 1) == b"x"


def test_client_close_is_propagated_upstream(proxy: TcpProxy, echo: EchoServer) -> None:
    with _connect(proxy.port) as sock:
        sock.sendall(b"bye")
        assert _recv_exactly(sock, 3) == b"bye"
    wait_for(lambda: proxy.active == 0, 5, "proxy kept a closed connection")


def test_unreachable_upstream_closes_the_client() -> None:
    dead_port = free_port()
    with TcpProxy("127.0.0.1", dead_port) as proxy:
        try:
            sock = _connect(proxy.port)
        except ConnectionResetError:
            # The proxy accepted and reset the client before connect() had returned: the
            # client was closed, which is what this test asks.
            assert proxy.accepted == 1
            return
        with sock:
            assert _is_closed(sock)


def test_close_stops_the_thread_and_frees_the_port(echo: EchoServer) -> None:
    proxy = TcpProxy("127.0.0.1", echo.port)
    thread_name = f"tcp-proxy-{proxy.port}"
    assert thread_name in {t.name for t in threading.enumerate()}
    with _connect(proxy.port) as sock:
        sock.sendall(b"a")
        assert _recv_exactly(sock, 1) == b"a"
        proxy.close()
        assert _is_closed(sock)
    assert thread_name not in {t.name for t in threading.enumerate()}
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy.port)
    proxy.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        proxy.cut()


def test_listen_port_is_honoured(echo: EchoServer) -> None:
    port = free_port()
    with TcpProxy("127.0.0.1", echo.port, listen_port=port) as proxy:
        assert proxy.port == port
        with _connect(port) as sock:
            sock.sendall(b"p")
            assert _recv_exactly(sock, 1) == b"p"


def test_wait_for_returns_once_true_and_times_out_with_message() -> None:
    calls = iter([False, False, True])
    wait_for(lambda: next(calls), 5, "never")

    def boom() -> bool:
        raise ValueError("cause")

    with pytest.raises(TimeoutError, match="the thing") as info:
        wait_for(boom, 0.05, "the thing")
    assert isinstance(info.value.__cause__, ValueError)


def test_in_ci_reads_the_ci_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert in_ci()
    monkeypatch.setenv("CI", "false")
    assert not in_ci()
    monkeypatch.delenv("CI")
    assert not in_ci()


_MISSING_SERVICE_TESTS = """
def test_needs_database(database_url):
    raise AssertionError("must not run without PostgreSQL")


def test_needs_redis(redis_url):
    raise AssertionError("must not run without Redis")
"""


def _run_without_services(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    """Run two service-needing tests in a child pytest whose services point at a dead port."""
    dead = f"127.0.0.1:{free_port()}"
    (tmp_path / "test_missing.py").write_text(_MISSING_SERVICE_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(
        {
            "PYTHONPATH": str(REPO_ROOT),
            "OUTBOX_TEST_DATABASE_URL": f"postgresql+psycopg://postgres@{dead}/postgres",
            "OUTBOX_TEST_REDIS_URL": f"redis://{dead}/0",
        }
    )
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-rA", "-q", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_missing_services_skip_with_a_reason_outside_ci(tmp_path: Path) -> None:
    result = _run_without_services(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 skipped" in result.stdout
    assert "PostgreSQL (OUTBOX_TEST_DATABASE_URL) is not available" in result.stdout
    assert "Redis (OUTBOX_TEST_REDIS_URL) is not available" in result.stdout


def test_missing_services_fail_the_run_in_ci(tmp_path: Path) -> None:
    result = _run_without_services(tmp_path, ci="true")
    assert result.returncode != 0
    assert "skipped" not in result.stdout
    assert "2 error" in result.stdout, result.stdout
    assert "CI=true, so a missing service is an error" in result.stdout
