"""The asyncio consumer runner on an asyncpg engine: micro-batches (one transaction, a savepoint
per message) and single attempts, with duplicates, as on psycopg (tests/integration/
test_consumer_async.py)."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import AsyncOutbox, OutboxConfig
from outbox.consumer import AsyncConsumerRunner
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    produce,
    rows,
    topic_with_dead_letters,
)

INSERT = sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)")


def test_duplicates_apply_once_on_asyncpg_in_batches_and_alone(
    kafka_bootstrap: str, engine: sa.Engine, database_url: str, redis_url: str, redis_prefix: str
) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL, value text NOT NULL)"))
    topic = topic_with_dead_letters(kafka_bootstrap, "asyncpg")
    records = [keyed(f"k{i}", f"v{i}", partition=i % 2) for i in range(30)]
    records += [keyed(f"k{i}", f"dup{i}", partition=(i + 1) % 2) for i in range(0, 30, 3)]
    produce(kafka_bootstrap, topic, records)

    async def handle(uow: Any, message: Any) -> dict[str, str]:
        value = message.value().decode()
        await uow.session.execute(INSERT, {"k": uow.key, "v": value})
        uow.publish("orders.accepted", {"key": uow.key}, key=uow.key)
        return {"seen": value}

    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    config = OutboxConfig(cache_prefix=redis_prefix)
    ends = [sum(1 for r in records if r["partition"] == p) for p in range(2)]
    for batch_size in (500, 1):  # the first takes them all in micro-batches; the second replays
        # An engine per runner: its connections belong to the runner's event loop.
        ob = AsyncOutbox(create_async_engine(url), redis_url=redis_url, config=config)
        runner = AsyncConsumerRunner(
            ob, handle, topics=[topic], bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
            group=f"g-{uuid.uuid4().hex[:8]}", scope="orders", batch_size=batch_size,
            metrics_registry=CollectorRegistry(),
        )  # fmt: skip
        running = Running(runner, CollectorRegistry())
        group = runner.config.group
        try:
            wait_for(lambda g=group: committed(kafka_bootstrap, g, topic) == ends,
                     60, "offsets of every message committed")  # fmt: skip
        finally:
            running.stop()  # re-raises what the runner raised
    got = rows(engine)
    assert sorted(k for k, _ in got) == sorted(f"k{i}" for i in range(30))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 30
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one() == 30
