"""Tombstones: a publish of ``None`` is a record with a null value, end to end (unit of work,
keyless publish, micro-batches, relay, consumer runner), on a compacted topic."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from outbox import Outbox
from outbox.consumer import ConsumerRunner
from outbox.relay import Relay, RelayConfig
from outbox.uow import Batch
from tests.fixtures.consumer import KAFKA, Running, produce
from tests.fixtures.kafka import create_topic, read_to_end
from tests.fixtures.relay import outbox_count


def _compacted_topic(bootstrap: str) -> str:
    name = f"tomb-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = NewTopic(name, num_partitions=1, replication_factor=1,
                     config={"cleanup.policy": "compact"})  # fmt: skip
    admin.create_topics([topic])[name].result(timeout=15)
    create_topic(bootstrap, name, partitions=1)  # waits until the metadata shows it
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    described = admin.describe_configs([resource])[resource].result(timeout=15)
    assert described["cleanup.policy"].value == "compact"
    return name


def test_tombstones_reach_a_compacted_topic_as_null_values_in_commit_order(
    database_url: str, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    topic = _compacted_topic(kafka_bootstrap)
    ob = Outbox(database_url)
    try:
        with ob.unit_of_work("tomb-1") as uow:
            first = uow.publish(topic, {"state": "open"}, key="order-1")
            dead = uow.publish(topic, None, key="order-1")
        with ob.engine.begin() as conn:  # the keyless publish, in the caller's transaction
            keyless = ob.publish(conn, topic, None, key="order-2")
        with engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT value FROM outbox ORDER BY id")).scalars().all()
        assert stored == [b'{"state":"open"}', None, None]
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    finally:
        ob.close()
    records = read_to_end(kafka_bootstrap, topic, at_least=3)
    got = [(m.key(), m.value(), dict(m.headers() or [])) for m in records]
    assert [(k, v) for k, v, _ in got] == [
        (b"order-1", b'{"state":"open"}'),
        (b"order-1", None),
        (b"order-2", None),
    ]
    ids = [h["X-Idempotency-Key"].decode() for _, _, h in got]
    assert ids == [str(first), str(dead), str(keyless)]
    assert "content-type" not in got[1][2]  # a tombstone has no content to type
    assert outbox_count(engine) == 0


def test_micro_batches_write_tombstones(database_url: str, engine: sa.Engine) -> None:
    keys = ["k0", "k1", "k2"]
    ob = Outbox(database_url)
    try:
        batch = Batch.open(ob, "batch-scope", keys)
        try:
            for i, key in enumerate(keys):
                with batch.unit_of_work(key, "batch-scope") as uow:
                    uow.publish("tomb-batch", None if i % 2 == 0 else b"x", key=key)
            batch.commit()
        finally:
            batch.close()
    finally:
        ob.close()
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT value FROM outbox ORDER BY id")).scalars().all()
    assert stored == [None, b"x", None]


def test_the_consumer_runner_hands_tombstones_to_handlers(
    kafka_bootstrap: str, database_url: str
) -> None:
    topic = f"tomb-in-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    produce(kafka_bootstrap, topic, [
        {"key": b"order-1", "value": None, "headers": [("X-Idempotency-Key", b"t-1")]},
    ])  # fmt: skip
    seen: list[Any] = []
    done = threading.Event()

    def handle(uow: Any, message: Any) -> dict[str, bool]:
        seen.append((message.key(), message.value()))
        done.set()
        return {"deleted": message.value() is None}

    ob = Outbox(database_url)
    runner = ConsumerRunner(
        ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
    )  # fmt: skip
    running = Running(runner, None)  # type: ignore[arg-type]
    try:
        assert done.wait(30), "the tombstone never reached the handler"
    finally:
        running.stop()
        ob.close()
    assert seen == [(b"order-1", None)]
    assert read_to_end(kafka_bootstrap, topic + ".dlq") == []
