"""PostgreSQL becomes unreachable while the consumer works through a partition.

An outage is not the messages' fault: no attempt may be counted against them, nothing may be
dead-lettered, and once the database answers again every message is applied exactly once, in
order, with every offset committed -- by either flavour of the runner. The connection is cut
while a handler is running (a micro-batch is in flight): its whole batch is lost and tried again.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA, Running, committed, keyed, metric, produce, read_topic
from tests.fixtures.kafka import create_topic

COUNT = 40


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_database_outage_retries_without_dead_letters(
    kafka_bootstrap: str, database_url: str, engine: sa.Engine, tcp_proxy: Any, flavour: str
) -> None:
    url = sa.make_url(database_url)
    proxy = tcp_proxy(url.host or "127.0.0.1", url.port or 5432)
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    topic = f"db-outage-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE effects (seq serial, key text NOT NULL, value text NOT NULL)")
        )
    produce(kafka_bootstrap, topic, [keyed(f"k{i}", f"v{i}") for i in range(COUNT // 2)])

    insert = sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)")
    # The handler of this message waits (once) until the connection is cut.
    blocker = f"k{COUNT // 2 + 5}"
    reached, cut = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> None:
        if uow.key == blocker and not cut.is_set():
            reached.set()
            cut.wait(30)
        uow.connection.execute(insert, {"k": uow.key, "v": message.value().decode()})

    async def handle_async(uow: Any, message: Any) -> None:
        if uow.key == blocker and not cut.is_set():
            reached.set()
            while not cut.is_set():
                await asyncio.sleep(0.01)
        await uow.connection.execute(insert, {"k": uow.key, "v": message.value().decode()})

    def effects() -> list[str]:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text("SELECT key FROM effects ORDER BY seq"))]

    registry = CollectorRegistry()
    settings: dict[str, Any] = dict(
        topics=[topic], group=group, bootstrap_servers=kafka_bootstrap,
        kafka_config=KAFKA, metrics_registry=registry,
        # Without the outage rule these would dead-letter the message in hand within ~0.2 s.
        max_attempts=2, retry_backoff=0.05, retry_backoff_max=0.2,
    )  # fmt: skip
    ob: Outbox | None = None
    runner: ConsumerRunner | AsyncConsumerRunner
    if flavour == "sync":
        ob = Outbox(proxied)
        runner = ConsumerRunner(ob, handle, **settings)
    else:  # closed in the runner's event loop by Running
        runner = AsyncConsumerRunner(AsyncOutbox(proxied), handle_async, **settings)
    running = Running(runner, registry)
    try:
        wait_for(lambda: len(effects()) >= 5, 60, "the consumer applies messages")
        produce(kafka_bootstrap, topic, [keyed(f"k{i}", f"v{i}") for i in range(COUNT // 2, COUNT)])
        assert reached.wait(30), "the handler reaches the message it waits at"
        proxy.cut()  # every pooled connection dies; new ones are refused
        cut.set()
        wait_for(
            lambda: metric(running, "outbox_consumer_failed_total", topic=topic,
                           kind="database_unavailable") >= 5,
            30, "the consumer meets the outage several times",
        )  # fmt: skip
        during = len(effects())
        time.sleep(1.0)  # longer than max_attempts x the backoff cap
        proxy.restore()
        wait_for(lambda: len(effects()) >= COUNT, 60, "every message applied after the outage")
        running.stop()
    finally:
        cut.set()
        runner.stop()
        running.thread.join(30)
        if ob is not None:
            ob.close()

    keys = effects()
    assert keys == [f"k{i}" for i in range(COUNT)]  # each once, in partition order
    assert during < COUNT, "the outage came after the last message: it proved nothing"
    assert metric(running, "outbox_consumer_dead_lettered_total", topic=topic,
                  reason="retries-exhausted") == 0  # fmt: skip
    assert read_topic(kafka_bootstrap, topic + ".dlq", at_least=0) == []
    assert committed(kafka_bootstrap, group, topic, 1) == [COUNT]
