"""Micro-batches whose messages share savepoints (``savepoint_chunk``), against real PostgreSQL,
Redis and a Kafka-protocol broker.

Up to ``savepoint_chunk`` messages run in one savepoint. A handler that fails after touching the
connection rolls its chunk back: the chunk's other messages run once more in the next
micro-batch, the failing one alone, and every effect still commits once, in partition order,
with the rest of its poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import AsyncOutbox, Outbox, OutboxConfig, PermanentError
from outbox.consumer import AsyncConsumerRunner, DeadLetterInfo
from outbox.errors import ConfigurationError
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import committed, keyed, produce, read_topic, topic_with_dead_letters
from tests.integration import test_consumer_batches as batches

# The micro-batch tests' fixtures and helpers, shared.
topic = batches.topic
effects = batches.effects
outbox = batches.outbox
start = batches.start
INSERT, Boom = batches.INSERT, batches.Boom
all_committed, applied, statuses = batches.all_committed, batches.applied, batches.statuses


def test_a_poison_message_rolls_back_only_its_chunk_and_runs_alone_after(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: Counter[str] = Counter()

    def handle(uow: Any, message: Any) -> None:
        calls[uow.key] += 1
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        uow.publish("orders.accepted", {"key": uow.key})
        if uow.key == "k6":
            raise PermanentError("cannot apply k6")

    records = [keyed(f"k{i}", "x", 0) for i in range(10)] + [keyed("j0", "x", 1)]
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic, savepoint_chunk=4)
    all_committed(kafka_bootstrap, running, topic, [10, 1])
    running.stop()

    # k4 and k5 shared k6's savepoint (k0..k3 had the one before): they ran again; k6 once.
    assert calls == {**dict.fromkeys([f"k{i}" for i in range(10)] + ["j0"], 1), "k4": 2, "k5": 2}
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    assert [m.offset() for m in letters] == [0]
    done = [k for k in applied(effects)]
    assert sorted(done) == sorted(["j0", *(f"k{i}" for i in range(10) if i != 6)])  # each once
    assert [k for k in done if k.startswith("k")] == [f"k{i}" for i in range(10) if i != 6]
    keys = statuses(effects)
    assert keys["k6"] == "failed"
    assert sum(1 for s in keys.values() if s == "completed") == 10
    with effects.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 10


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_transient_failure_in_a_chunk_is_retried_alone_and_its_chunk_commits_next(
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
    failures = {"k5": 2}

    def apply(uow: Any) -> None:
        calls[uow.key] += 1
        if failures.get(uow.key, 0):
            failures[uow.key] -= 1
            raise Boom("database blip")

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        apply(uow)

    async def handle_async(uow: Any, message: Any) -> None:
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        apply(uow)

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    config = OutboxConfig(cache_prefix=redis_prefix)
    store: Any
    if flavour == "sync":
        store, handler = Outbox(database_url, redis_url=redis_url, config=config), handle
    else:  # closed in its runner's loop
        store, handler = AsyncOutbox(database_url, redis_url=redis_url, config=config), handle_async
    try:
        running = start(store, handler, topic, savepoint_chunk=4, retry_backoff=0.05)
        all_committed(kafka_bootstrap, running, topic, [10, -1001])
        running.stop()
    finally:
        if flavour == "sync":
            store.close()
    # k4 shared k5's savepoint and ran again once; k5's second failure was its own, alone.
    assert calls == {**{f"k{i}": 1 for i in range(10)}, "k4": 2, "k5": 3}
    assert applied(effects) == [f"k{i}" for i in range(10)]


def test_per_partition_order_holds_across_chunks_and_retries(
    kafka_bootstrap: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    name = topic_with_dead_letters(kafka_bootstrap, "chunks", partitions=4)
    flaky = {f"m{i}" for i in range(400) if i % 7 == 3}
    failed: set[str] = set()

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": str(message.partition())})
        if uow.key in flaky and uow.key not in failed:
            failed.add(uow.key)
            raise Boom("once")

    produce(kafka_bootstrap, name, [keyed(f"m{i}", "x", i % 4) for i in range(400)])
    running = start(outbox, handle, name, retry_backoff=0.01, retry_backoff_max=0.02,
                    batch_size=64, savepoint_chunk=8)  # fmt: skip
    group = running.runner.config.group
    wait_for(lambda: committed(kafka_bootstrap, group, name, 4) == [100] * 4, 60,
             "every offset committed", interval=0.1)  # fmt: skip
    running.stop()
    with effects.connect() as conn:
        got = conn.execute(sa.text("SELECT key, value FROM effects ORDER BY seq")).all()
    assert sorted(k for k, _ in got) == sorted(f"m{i}" for i in range(400))  # each once
    for p in range(4):
        in_partition = [int(k[1:]) for k, v in got if v == str(p)]
        assert in_partition == sorted(in_partition), f"partition {p} out of order"
    assert failed == flaky


def test_a_handler_that_swallows_a_database_error_fails_alone_in_a_chunk(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: Counter[str] = Counter()

    def handle(uow: Any, message: Any) -> None:
        calls[uow.key] += 1
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if uow.key == "k5":
            with contextlib.suppress(sa.exc.DBAPIError):  # the transaction stays failed
                uow.connection.execute(sa.text("SELECT 1 / 0"))

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    running = start(outbox, handle, topic, savepoint_chunk=4, max_attempts=2,
                    retry_backoff=0.05)  # fmt: skip
    all_committed(kafka_bootstrap, running, topic, [10, -1001])
    running.stop()
    # k5 is the one that failed (twice, then dead-lettered), not the message after it; k4,
    # which shared its savepoint, ran once more.
    assert calls == {**{f"k{i}": 1 for i in range(10)}, "k4": 2, "k5": 2}
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    assert [DeadLetterInfo.from_headers(m.headers()).offset for m in letters] == [5]
    assert applied(effects) == [f"k{i}" for i in range(10) if i != 5]


def test_shared_savepoints_are_refused_on_an_asyncpg_engine(database_url: str) -> None:
    async def handle(uow: Any, message: Any) -> None:
        pass

    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    ob = AsyncOutbox(create_async_engine(url))
    try:
        with pytest.raises(ConfigurationError, match=r"^savepoint_chunk=4 needs a psycopg engine"):
            AsyncConsumerRunner(ob, handle, topics=["t"], group="g",
                                bootstrap_servers="127.0.0.1:9092", savepoint_chunk=4)  # fmt: skip
        AsyncConsumerRunner(ob, handle, topics=["t"], group="g",
                            bootstrap_servers="127.0.0.1:9092")  # fmt: skip
    finally:
        asyncio.run(ob.close())
