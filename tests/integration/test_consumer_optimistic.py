"""Optimistic micro-batches (``optimistic=True``), against real PostgreSQL, Redis and a
Kafka-protocol broker.

An optimistic batch sets no savepoint between its messages and pipelines their statements. A
failure -- a handler's exception, or a pipelined statement's error, which may surface in a later
message's statement -- gives the batch up: nothing of it is recorded, no dead letter is sent,
and its messages run again with a savepoint each, where each failure is its own. Every effect
still commits once, in partition order, the poison message is dead-lettered once, and the rest
of the poll commits.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import AsyncOutbox, Outbox, OutboxConfig, PermanentError
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner
from outbox.errors import ConfigurationError
from tests.fixtures.consumer import keyed, produce, read_topic
from tests.integration import test_consumer_batches as batches

topic = batches.topic
effects = batches.effects
outbox = batches.outbox
start = batches.start
all_committed, applied, statuses = batches.all_committed, batches.applied, batches.statuses

INSERT = sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)")
# Fails in the database (NOT NULL) the first time k3 runs: in an optimistic batch its error
# surfaces in a later statement or at the commit, not in k3's own call.
INSERT_NULL = sa.text("INSERT INTO effects (key, value) VALUES (:k, NULL)")


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_failure_gives_the_batch_up_and_each_message_is_decided_alone_after(
    kafka_bootstrap: str,
    topic: str,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    effects: sa.Engine,
    start: Any,
    flavour: str,
) -> None:
    calls: Counter[str] = Counter()

    def statement(key: str) -> sa.TextClause:
        calls[key] += 1
        return INSERT_NULL if key == "k3" and calls[key] == 1 else INSERT

    def after(key: str) -> None:
        if key == "k15":
            raise PermanentError("cannot apply k15")

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(statement(uow.key), {"k": uow.key, "v": "x"})
        uow.publish("orders.accepted", {"key": uow.key})
        after(uow.key)

    async def handle_async(uow: Any, message: Any) -> None:
        await uow.connection.execute(statement(uow.key), {"k": uow.key, "v": "x"})
        uow.publish("orders.accepted", {"key": uow.key})
        after(uow.key)

    records = [keyed(f"k{i}", "x", 0) for i in range(20)] + [
        keyed(f"j{i}", "x", 1) for i in range(5)
    ]
    produce(kafka_bootstrap, topic, records)
    config = OutboxConfig(cache_prefix=redis_prefix)
    store: Any
    if flavour == "sync":
        store, handler = Outbox(database_url, redis_url=redis_url, config=config), handle
    else:  # closed in its runner's loop
        store, handler = AsyncOutbox(database_url, redis_url=redis_url, config=config), handle_async
    try:
        running = start(store, handler, topic, optimistic=True, retry_backoff=0.05)
        all_committed(kafka_bootstrap, running, topic, [20, 5])
        running.stop()
    finally:
        if flavour == "sync":
            store.close()

    letters = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    assert len(letters) == 1  # once: the given-up batch sent none
    assert dict(letters[0].headers() or [])["X-Idempotency-Key"] == b"k15"
    done = applied(effects)
    expected = [f"k{i}" for i in range(20) if i != 15]
    assert sorted(done) == sorted(expected + [f"j{i}" for i in range(5)])  # each once
    assert [k for k in done if k.startswith("k")] == expected  # in partition order
    # k3 failed in the given-up batch and succeeded with a savepoint; no message ran more than
    # twice (once optimistic, once careful): no replay storm.
    assert calls["k3"] == 2
    assert max(calls.values()) <= 2
    keys = statuses(effects)
    assert keys["k15"] == "failed"
    assert sum(1 for s in keys.values() if s == "completed") == 24
    with effects.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 24


def test_an_optimistic_batch_holds_more_messages_that_write_than_the_savepoint_cap(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> str:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        return uow.key

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", i % 2) for i in range(300)])
    running = start(outbox, handle, topic, optimistic=True, batch_size=500, batch_wait=0.2)
    all_committed(kafka_bootstrap, running, topic, [150, 150])
    running.stop()
    assert sorted(applied(effects)) == sorted(f"k{i}" for i in range(300))
    # A careful batch commits after 48 savepoints that wrote; an optimistic one sets none, so
    # a micro-batch finished more than 50 messages that wrote.
    group = running.runner.config.group
    sample = running.registry.get_sample_value
    batches_seen = sample("outbox_consumer_batch_size_count", {"group": group})
    up_to_50 = sample("outbox_consumer_batch_size_bucket", {"group": group, "le": "50.0"})
    assert batches_seen is not None and up_to_50 is not None
    assert batches_seen > up_to_50


def test_optimistic_needs_psycopg_and_a_bool(database_url: str, outbox: Outbox) -> None:
    async def handle(uow: Any, message: Any) -> None:
        pass

    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    ob = AsyncOutbox(create_async_engine(url))
    try:
        with pytest.raises(ConfigurationError, match=r"^optimistic=True needs a psycopg engine"):
            AsyncConsumerRunner(ob, handle, topics=["t"], group="g",
                                bootstrap_servers="127.0.0.1:9092", optimistic=True)  # fmt: skip
    finally:
        asyncio.run(ob.close())
    for bad in (1, "yes", None):
        with pytest.raises(ConfigurationError, match=r"^optimistic must be True or False"):
            ConsumerRunner(outbox, lambda uow, message: None, topics=["t"], group="g",
                           bootstrap_servers="127.0.0.1:9092", optimistic=bad)  # fmt: skip
