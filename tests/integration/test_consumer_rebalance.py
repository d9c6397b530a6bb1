"""Rebalances: a member joins and another leaves while messages flow.

Offsets are committed only on revocation and shutdown here (the periodic commit is pushed out
of reach), so the test sees whether a revoked member committed what it had finished: if it had
not, the next owner would receive finished messages again and replay them. Both flavours of the
runner: the asyncio one meets its rebalance callbacks on its Kafka client's thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA, Running, committed, rows
from tests.fixtures.kafka import create_topic

PARTITIONS = 4
COUNT = 2000


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize(
    "strategy",
    [
        "range",  # eager: every partition is revoked, then the whole assignment handed out
        "cooperative-sticky",  # incremental: only the partitions that move are revoked
    ],
)
def test_revoked_partitions_commit_finished_work_and_nothing_applies_twice(
    kafka_bootstrap: str,
    database_url: str,
    engine: sa.Engine,
    caplog: pytest.LogCaptureFixture,
    strategy: str,
    flavour: str,
) -> None:
    caplog.set_level("INFO", logger="outbox.consumer")
    topic = f"rebalance-{uuid.uuid4().hex[:10]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=PARTITIONS)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL, value text NOT NULL)"))

    per_partition = [0] * PARTITIONS
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for i in range(COUNT):
        producer.produce(topic, value=b"x", partition=i % PARTITIONS,
                         headers=[("X-Idempotency-Key", f"k{i}".encode())])  # fmt: skip
        per_partition[i % PARTITIONS] += 1
    assert producer.flush(30) == 0

    # Work stays in flight while the group changes: handlers are slow until the first member
    # has left. A cooperative rebalance moves partitions only in a second round, seconds after
    # the new member joined; at full speed the first member could have finished them by then.
    slow = threading.Event()
    slow.set()

    insert = sa.text("INSERT INTO effects (key, value) VALUES (:k, :w)")

    def handle(uow: Any, message: Any) -> None:
        time.sleep(0.01 if slow.is_set() else 0.002)
        uow.connection.execute(insert, {"k": uow.key, "w": threading.current_thread().name})

    async def handle_async(uow: Any, message: Any) -> None:
        await asyncio.sleep(0.01 if slow.is_set() else 0.002)
        await uow.connection.execute(insert, {"k": uow.key, "w": threading.current_thread().name})

    ob = Outbox(database_url)
    registries: list[CollectorRegistry] = []
    running: list[Running] = []

    def start() -> Running:
        registry = CollectorRegistry()
        settings: dict[str, Any] = dict(
            topics=[topic], group=group, bootstrap_servers=kafka_bootstrap,
            # A longer session than the other tests: a member frozen for a moment on a loaded
            # machine must not lose its partitions (lost partitions are not committed).
            kafka_config={**KAFKA, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500,
                          "partition.assignment.strategy": strategy},
            commit_interval=3600,
            batch_size=50, metrics_registry=registry,
        )  # fmt: skip
        runner: ConsumerRunner | AsyncConsumerRunner
        if flavour == "sync":
            runner = ConsumerRunner(ob, handle, **settings)
        else:  # an outbox of its own, in the runner's event loop (closed there by Running)
            runner = AsyncConsumerRunner(AsyncOutbox(database_url), handle_async, **settings)
        registries.append(registry)
        running.append(Running(runner, registry))
        return running[-1]

    def applied(n: int) -> bool:
        for r in running:
            if r.error is not None:
                raise AssertionError(f"a runner failed: {r.error!r}") from r.error
        return len(rows(engine)) >= n

    def applied_by(r: Running) -> int:
        applied(0)
        return sum(1 for _, worker in rows(engine) if worker == r.thread.name)

    try:
        first = start()
        wait_for(lambda: applied(COUNT // 10), 60, "first member working", interval=0.05)
        second = start()  # joins: the first member's partitions are revoked mid-flow
        wait_for(lambda: applied_by(second) >= 20, 60, "the second member working",
                 interval=0.05)  # fmt: skip
        first.stop()  # leaves: its partitions move to the second member
        slow.clear()
        # Otherwise the leave moved no work and proved nothing.
        assert not applied(COUNT), "every message was applied before the first member left"
        wait_for(lambda: applied(COUNT), 60, "every message applied", interval=0.1)
        second.stop()
    finally:
        for r in running:
            r.runner.stop()
        for r in running:
            r.thread.join(30)
        ob.close()

    keys = [k for k, _ in rows(engine)]
    assert sorted(keys) == sorted(f"k{i}" for i in range(COUNT))  # each exactly once
    workers = {w for _, w in rows(engine)}
    assert len(workers) == 2  # both members applied messages
    assert committed(kafka_bootstrap, group, topic, PARTITIONS) == per_partition

    def total(name: str, **labels: str) -> float:
        return sum(
            r.get_sample_value(name, {"group": group, "topic": topic, **labels}) or 0.0
            for r in registries
        )

    # Finished work was committed on every revocation: no finished message came back. A
    # partition *lost* to a session timeout is not committed, by design (its finished messages
    # are replayed from their keys), so a loss would mean this run tested another path.
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost ")]
    assert not lost, f"a member lost its partitions instead of handing them over: {lost}"
    assert "revoked" in caplog.text
    assert total("outbox_consumer_replayed_total", status="completed") == 0
    assert total("outbox_consumer_processed_total") == COUNT
