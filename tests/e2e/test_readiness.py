"""``/readyz`` next to ``/healthz``: live means the loop turns, ready means the process also
reaches PostgreSQL and the broker -- for ``outbox-relay`` (a subprocess) and the consumer runner
(in process), with real outages: a killed broker, a cut connection to PostgreSQL."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import Outbox
from outbox.consumer import ConsumerRunner, serve_metrics
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.consumer import KAFKA, Running
from tests.fixtures.kafka import Broker, create_topic
from tests.fixtures.processes import log_tail
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.relay import start_relay

# A readiness change shows within one check interval (5 s for both) plus the check's own
# bound; the waits below leave room for a loaded machine.
CHANGE = 45.0


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def gauge(port: int, name: str) -> float | None:
    """The value of the first sample of ``name`` on ``/metrics``."""
    for line in get(port, "/metrics")[1].splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_relay_is_ready_only_while_the_broker_answers(
    database_url: str, tansu: Callable[..., Broker], tmp_path: Path
) -> None:
    broker = tansu()
    port = free_port()
    log = tmp_path / "relay.log"
    proc = start_relay(
        database_url, broker.bootstrap, "--metrics-port", str(port), "--kafka-config",
        "socket.timeout.ms=1000", log_path=log,
    )  # fmt: skip
    try:
        wait_for(lambda: get(port, "/readyz") == (200, "ready\n"), CHANGE, "relay never ready")
        assert gauge(port, "outbox_relay_ready") == 1.0
        broker.kill()
        wait_for(lambda: get(port, "/readyz")[0] == 503, CHANGE, "ready without a broker")
        assert get(port, "/readyz") == (503, "not ready\n")
        # Not ready, yet alive: its loop turns and its database session is up (no restart).
        assert get(port, "/healthz") == (200, "ok\n")
        assert gauge(port, "outbox_relay_ready") == 0.0
        broker.start()
        wait_for(lambda: get(port, "/readyz")[0] == 200, CHANGE, "not ready again after restart")
    except BaseException:
        print(log_tail(log))
        raise
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def db_proxy(database_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A TCP proxy in front of this test's PostgreSQL, and the database URL through it."""
    parts = urlsplit(database_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0] + "@" if len(netloc) == 2 else ""
    try:
        yield proxy, urlunsplit(parts._replace(netloc=f"{user}{proxy.address}"))
    finally:
        proxy.close()


def handle(uow: Any, message: Any) -> None:
    uow.connection.execute(sa.text("SELECT 1"))


def test_consumer_is_ready_only_while_database_and_broker_answer(
    db_proxy: tuple[TcpProxy, str], tansu: Callable[..., Broker]
) -> None:
    proxy, url = db_proxy
    broker = tansu()
    topic = f"ready-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)
    outbox = Outbox(url)
    registry = CollectorRegistry()
    runner = ConsumerRunner(
        outbox, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=broker.bootstrap,
        kafka_config={**KAFKA, "socket.timeout.ms": 1000}, metrics_registry=registry,
    )  # fmt: skip
    server = serve_metrics(runner, 0, host="127.0.0.1")
    port = server.port
    running: Running | None = None
    try:
        assert get(port, "/readyz") == (503, "not ready\n")  # not consuming yet
        running = Running(runner, registry)
        wait_for(lambda: get(port, "/readyz")[0] == 200, CHANGE, "consumer never ready")
        assert gauge(port, "outbox_consumer_ready") == 1.0

        proxy.cut()  # PostgreSQL unreachable
        wait_for(lambda: get(port, "/readyz")[0] == 503, CHANGE, "ready without PostgreSQL")
        assert get(port, "/healthz") == (200, "ok\n")  # alive: its loop still turns
        assert gauge(port, "outbox_consumer_ready") == 0.0
        proxy.restore()
        wait_for(lambda: get(port, "/readyz")[0] == 200, CHANGE, "not ready after PostgreSQL")

        broker.kill()  # the broker gone
        wait_for(lambda: get(port, "/readyz")[0] == 503, CHANGE, "ready without a broker")
        assert get(port, "/healthz") == (200, "ok\n")
        broker.start()
        wait_for(lambda: get(port, "/readyz")[0] == 200, CHANGE, "not ready after the broker")

        running.stop()
        running = None
        assert get(port, "/readyz")[0] == 503  # stopped
    finally:
        if running is not None:
            running.runner.stop()
            running.thread.join(30)
        server.close()
        outbox.close()
