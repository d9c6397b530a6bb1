"""The health and metrics server cannot be starved: idle and half-sent connections cost a
socket, not a thread, are bounded in number and in time, and ``/healthz`` keeps answering."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from outbox._metrics_server import MAX_CONNECTIONS, MetricsServer
from outbox.cli import relay as relay_cli
from outbox.errors import ConfigurationError
from outbox.relay._metrics import RelayMetrics


@pytest.fixture
def metrics() -> RelayMetrics:
    source = RelayMetrics()
    source.database_up = True
    source.beat()
    return source


@pytest.fixture
def server(metrics: RelayMetrics) -> Iterator[MetricsServer]:
    served = MetricsServer(metrics, 0, max_silence=3600.0).start()
    try:
        yield served
    finally:
        served.close()


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _connect(port: int, sent: bytes) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    if sent:
        client.sendall(sent)
    return client


def test_healthz_answers_through_hundreds_of_idle_and_half_sent_connections(
    server: MetricsServer,
) -> None:
    threads_before = threading.active_count()
    clients: list[socket.socket] = []
    try:
        for n in range(2 * MAX_CONNECTIONS):
            sent = b"" if n % 2 else b"GET /healthz HTTP/1.1\r\nHost: relay\r\n"  # no blank line
            clients.append(_connect(server.port, sent))
            if n % 64 == 63:
                assert _get(server.port, "/healthz") == (200, b"ok\n")
        for _ in range(20):
            assert _get(server.port, "/healthz") == (200, b"ok\n")
        status, body = _get(server.port, "/metrics")
        assert status == 200 and b"outbox_relay_published_total" in body
        # One thread serves them all, and no more than the bound stay open.
        assert threading.active_count() == threads_before
        assert server.open_connections <= MAX_CONNECTIONS
        # The oldest were closed to make room: the server hung up on the very first client.
        assert clients[0].recv(1) == b""
    finally:
        for client in clients:
            client.close()


def test_a_half_sent_request_is_closed_after_the_request_timeout(metrics: RelayMetrics) -> None:
    served = MetricsServer(metrics, 0, request_timeout=0.2).start()
    try:
        client = _connect(served.port, b"GET /healthz HTTP/1.1\r\n")
        try:
            assert client.recv(1) == b""  # closed by the server, not answered
        finally:
            client.close()
        assert _get(served.port, "/healthz") == (200, b"ok\n")
    finally:
        served.close()


def test_an_oversized_or_malformed_request_gets_no_answer_but_the_server_keeps_serving(
    server: MetricsServer,
) -> None:
    long = _connect(server.port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")
    bad = _connect(server.port, b"BREW /pot\r\n\r\n")
    try:
        assert long.recv(1) == b""
        assert bad.recv(64).startswith(b"HTTP/1.1 400 ")
    finally:
        long.close()
        bad.close()
    assert _get(server.port, "/nothing")[0] == 404
    assert _get(server.port, "/healthz") == (200, b"ok\n")


def test_methods_other_than_get_are_refused(server: MetricsServer) -> None:
    client = _connect(server.port, b"DELETE /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
    try:
        assert client.recv(64).startswith(b"HTTP/1.1 405 ")
    finally:
        client.close()


def test_the_server_listens_on_the_loopback_interface_unless_told_otherwise(
    metrics: RelayMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = MetricsServer(metrics, 0)
    try:
        assert served._socket.getsockname()[0] == "127.0.0.1"
    finally:
        served.close()
    monkeypatch.delenv("OUTBOX_METRICS_HOST", raising=False)
    base = ["--database-url", "postgresql+psycopg://u@h/d", "--bootstrap-servers", "k:9092"]
    args = relay_cli.build_parser().parse_args(base)
    assert relay_cli.config_from_args(args).metrics_host == "127.0.0.1"
    monkeypatch.setenv("OUTBOX_METRICS_HOST", "0.0.0.0")
    args = relay_cli.build_parser().parse_args(base)
    assert relay_cli.config_from_args(args).metrics_host == "0.0.0.0"
    args = relay_cli.build_parser().parse_args([*base, "--metrics-host", "bad host\n"])
    with pytest.raises(ConfigurationError, match="--metrics-host"):
        relay_cli.config_from_args(args)
