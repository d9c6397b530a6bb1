"""Secrets at run time: a password in the database or Redis URL, and a secret Kafka setting,
never reach a log record (DEBUG included, SQLAlchemy's and redis-py's too), an exception, a
``repr``, ``/metrics`` or ``/healthz`` -- with the real services, where PostgreSQL's trust
authentication accepts any password and a Redis without authentication refuses one."""

from __future__ import annotations

import logging
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

import outbox
from outbox import OutboxConfig, PermanentError
from outbox._metrics_server import MetricsServer
from outbox.config import RelayConfig
from outbox.consumer import ConsumerRunner, serve_metrics
from outbox.errors import ConfigurationError, PreviouslyFailed
from outbox.relay import Relay
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    keyed,
    metric,
    produce,
    topic_with_dead_letters,
)
from tests.fixtures.uow import create_orders, place

TOKEN = "Tk5e3c7r9e1t2x"


def with_password(url: str, password: str = TOKEN) -> str:
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{password}@{host}"


@pytest.fixture
def everything_logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # the root logger: every library's records
    for name in ("sqlalchemy.engine", "sqlalchemy.pool", "outbox"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        for name in ("sqlalchemy.engine", "sqlalchemy.pool", "outbox"):
            logging.getLogger(name).setLevel(logging.NOTSET)


def _all_text(caplog: pytest.LogCaptureFixture) -> str:
    parts = [caplog.text]
    for record in caplog.records:
        parts.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            parts.append(repr(record.exc_info[1]))
    return "\n".join(parts)


def test_units_of_work_log_no_password_at_debug(
    engine: sa.Engine, database_url: str, everything_logged: pytest.LogCaptureFixture
) -> None:
    create_orders(engine)
    # A Redis that does not answer: the cache steps aside and says why.
    redis_url = f"redis://:{TOKEN}@127.0.0.1:{free_port()}/0"
    ob = outbox.Outbox(
        with_password(database_url),
        redis_url=redis_url,
        config=OutboxConfig(cache_prefix=f"secrets-{uuid.uuid4().hex[:8]}"),
    )
    try:
        assert place(ob, "s-1") == (False, {"order": "s-1"})
        assert place(ob, "s-1") == (True, {"order": "s-1"})
        with pytest.raises(PermanentError), ob.unit_of_work("s-2", scope="shop"):
            raise PermanentError("declined")
        with pytest.raises(PreviouslyFailed) as failed:
            place(ob, "s-2")
        shown = [repr(ob), repr(ob.engine), str(ob.engine.url), repr(failed.value)]
        assert ob.cache is not None
        shown.append(repr(ob.cache.client))
    finally:
        ob.close()
    text = _all_text(everything_logged)
    assert "redis GET failed" in text  # the cache's failure was logged...
    for item in [text, *shown]:
        assert TOKEN not in item  # ...without the password


@pytest.mark.parametrize(
    "mangled",
    [
        f"postgresql+psycopg://app:{TOKEN}@x@127.0.0.1:5432/db",
        f"postgresql+psycopg://app:{TOKEN}%@127.0.0.1:5432/db",
        f"postgresql+psycopg://app:{TOKEN}@127.0.0.1:54x32/db",
        f"postgresql+psycopg://app:{TOKEN} @127.0.0.1/db",
        f"postgresql+psycopg://app:{TOKEN}",
        f"postgresql+psycopg://app:{TOKEN}@127.0.0.1/db?password={TOKEN}",
    ],
)
def test_malformed_urls_are_refused_without_their_password(
    mangled: str, everything_logged: pytest.LogCaptureFixture
) -> None:
    for redis_url in (None, mangled.replace("postgresql+psycopg", "redis")):
        url = mangled if redis_url is None else "postgresql+psycopg://app@127.0.0.1/db"
        with pytest.raises(ConfigurationError) as refused:
            outbox.Outbox(url, redis_url=redis_url)
        chain: list[BaseException] = []
        error: BaseException | None = refused.value
        while error is not None:  # what a traceback shows: causes, and unsuppressed contexts
            chain.append(error)
            error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        for item in [*map(str, chain), *map(repr, chain)]:
            assert TOKEN not in item
    assert TOKEN not in _all_text(everything_logged)


def test_relay_logs_metrics_and_health_hold_no_secret(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    everything_logged: pytest.LogCaptureFixture,
) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob, ob.unit_of_work("r-1") as uow:
        uow.publish(f"secrets.{uuid.uuid4().hex[:8]}", {"n": 1}, key="r")
    config = RelayConfig(
        with_password(database_url),
        kafka_bootstrap,
        kafka_config={"client.id": "secrets-test", "sasl.oauthbearer.config": TOKEN},
        poll_interval=0.2,
    )
    assert TOKEN not in repr(config)
    relay = Relay(config)
    server = MetricsServer(relay.metrics, 0).start()
    try:
        relay.run(once=True)
        pages = []
        for path in ("/metrics", "/healthz"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}") as reply:
                    pages.append(reply.read().decode())
            except urllib.error.HTTPError as exc:  # /healthz may say 503 after the run
                pages.append(exc.read().decode())
    finally:
        server.close()
    assert "outbox_relay" in pages[0]
    for item in [*pages, _all_text(everything_logged), repr(relay.config)]:
        assert TOKEN not in item


def test_consumer_runner_logs_metrics_and_health_hold_no_secret(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    everything_logged: pytest.LogCaptureFixture,
) -> None:
    """A runner on a password-bearing database URL, a Redis URL with a password (that does not
    answer) and a secret Kafka setting, at DEBUG, with its metrics and health pages."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text PRIMARY KEY, value text NOT NULL)"))
    topic = topic_with_dead_letters(kafka_bootstrap, "secrets", partitions=1)
    produce(kafka_bootstrap, topic, [keyed("c-1", "v")])

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
            {"k": uow.key, "v": message.value().decode()},
        )

    registry = CollectorRegistry()
    ob = outbox.Outbox(
        with_password(database_url),
        redis_url=f"redis://:{TOKEN}@127.0.0.1:{free_port()}/0",
        config=OutboxConfig(cache_prefix=f"secrets-{uuid.uuid4().hex[:8]}"),
    )
    runner = ConsumerRunner(
        ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap,
        kafka_config={**KAFKA, "client.id": "secrets-test", "sasl.oauthbearer.config": TOKEN},
        metrics_registry=registry,
    )  # fmt: skip
    server = serve_metrics(runner, 0)
    running = Running(runner, registry)
    pages: list[str] = []
    try:
        wait_for(lambda: metric(running, "outbox_consumer_processed_total", topic=topic) >= 1,
                 60, "the message processed")  # fmt: skip
        for path in ("/metrics", "/healthz"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}") as reply:
                    pages.append(reply.read().decode())
            except urllib.error.HTTPError as exc:
                pages.append(exc.read().decode())
    finally:
        running.stop()
        server.close()
        ob.close()
    assert "outbox_consumer_processed_total" in pages[0]
    assert "sqlalchemy.engine.Engine" in {r.name for r in everything_logged.records}  # DEBUG on
    for item in [*pages, _all_text(everything_logged), repr(runner.config), repr(ob)]:
        assert TOKEN not in item
