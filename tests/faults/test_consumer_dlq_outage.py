"""The broker becomes unreachable just as a message must be dead-lettered.

The offset must not be committed and the key not recorded as failed until the dead letter is
confirmed; once the network is back the message is dead-lettered exactly once. Both flavours of
the runner: the asyncio one waits for the broker on its producer's thread.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox, PermanentError
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.consumer import KAFKA, Running, committed, read_topic
from tests.fixtures.kafka import create_topic


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_dead_letter_waits_for_the_broker_and_is_written_once(
    tansu: Any, tcp_proxy: Any, database_url: str, flavour: str
) -> None:
    advertised = free_port()
    broker = tansu(advertised_port=advertised)
    proxy = tcp_proxy("127.0.0.1", broker.port, listen_port=advertised)
    bootstrap = f"127.0.0.1:{advertised}"
    topic = f"outage-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, topic + ".dlq", partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, value=b"poison", headers=[("X-Idempotency-Key", b"p1")])
    assert producer.flush(30) == 0

    entered, release = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> None:
        entered.set()
        release.wait(30)
        raise PermanentError("cannot apply")

    async def handle_async(uow: Any, message: Any) -> None:
        entered.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        raise PermanentError("cannot apply")

    ob = Outbox(database_url)  # the test reads the key's status through it
    registry = CollectorRegistry()
    settings: dict[str, Any] = dict(
        topics=[topic], group=group, bootstrap_servers=bootstrap,
        kafka_config=KAFKA, dlq_timeout=1.0, retry_backoff=0.1,
        retry_backoff_max=0.5, metrics_registry=registry,
    )  # fmt: skip
    runner: ConsumerRunner | AsyncConsumerRunner
    if flavour == "sync":
        runner = ConsumerRunner(ob, handle, **settings)
    else:  # closed in the runner's event loop by Running
        runner = AsyncConsumerRunner(AsyncOutbox(database_url), handle_async, **settings)
    running = Running(runner, registry)

    def unavailable() -> float:
        labels = {"group": group, "topic": topic, "kind": "dead_letter_unavailable"}
        return registry.get_sample_value("outbox_consumer_failed_total", labels) or 0.0

    def key_status() -> str | None:
        with ob.engine.connect() as conn:
            status: str | None = conn.execute(
                sa.text("SELECT status FROM idempotency_keys WHERE key = 'p1'")
            ).scalar()
        return status

    try:
        assert entered.wait(30)
        proxy.cut()
        release.set()
        wait_for(lambda: unavailable() >= 2, 30, "dead letter retried while the broker is away")
        assert key_status() is None  # no failure recorded without a durable dead letter
        proxy.restore()
        wait_for(lambda: key_status() == "failed", 60, "dead letter confirmed, failure recorded")
        wait_for(lambda: committed(bootstrap, group, topic, 1) == [1], 30, "offset committed",
                 interval=0.1)  # fmt: skip
    finally:
        release.set()
        running.stop()
        ob.close()

    # Read to the end of the topic: a second copy from a retry would show up here.
    letters = read_topic(bootstrap, topic + ".dlq", at_least=1, timeout=30)
    assert [m.value() for m in letters] == [b"poison"]
