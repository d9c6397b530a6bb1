"""Units of work, batches, the consumer's attempts and the consumer runner on engines that run
REPEATABLE READ or SERIALIZABLE transactions: on a fresh connection (no statement prepared yet)
and on a pooled one, in both flavours, the transaction runs at the engine's level; a
serialization failure leaves the key free and the consumer retries it without counting an
attempt."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox._core.disposition import AttemptVerdict
from outbox._core.offsets import Tries
from outbox._pg.errors import transaction_conflict
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner
from outbox.consumer._attempt_async import AsyncAttempts
from outbox.consumer._metrics import ConsumerMetrics
from outbox.testing import Deliverer
from outbox.uow import AsyncBatch, Batch
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    metric,
    produce,
    topic_with_dead_letters,
)

LEVELS = ["REPEATABLE READ", "SERIALIZABLE"]
# Any level set on the engine, also one PostgreSQL runs as another (READ UNCOMMITTED).
ENGINE_LEVELS = ["READ UNCOMMITTED", *LEVELS]
POOLS = ["fresh", "pooled"]
LEVEL = sa.text("SELECT current_setting('transaction_isolation')")
COUNTER = "CREATE TABLE IF NOT EXISTS counters (id integer PRIMARY KEY, n integer NOT NULL)"
BUMP = sa.text("UPDATE counters SET n = n + 1 WHERE id = 1")


def _pool(kind: str) -> dict[str, Any]:
    # NullPool: every unit of work on a new connection, where nothing is prepared yet.
    return {"poolclass": sa.pool.NullPool} if kind == "fresh" else {"pool_size": 2}


@pytest.fixture
def counter(engine: sa.Engine) -> Iterator[None]:
    with engine.begin() as conn:
        conn.execute(sa.text(COUNTER))
        conn.execute(sa.text("INSERT INTO counters VALUES (1, 0)"))
    yield


def _key_status(engine: sa.Engine, key: str) -> list[Any]:
    with engine.connect() as conn:
        query = sa.text("SELECT status FROM idempotency_keys WHERE key = :k")
        return list(conn.execute(query, {"k": key}))


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("level", ENGINE_LEVELS)
def test_sync_units_of_work_run_at_the_engines_level(
    database_url: str, engine: sa.Engine, level: str, pool: str
) -> None:
    isolated = sa.create_engine(database_url, isolation_level=level, **_pool(pool))
    try:
        with outbox.Outbox(isolated) as ob:
            for i in range(3):  # the first prepares its statements, later ones reuse them
                with ob.unit_of_work(f"k{i}") as uow:
                    assert uow.connection.execute(LEVEL).scalar() == level.lower()
                    uow.publish("iso.events", {"i": i}, key="same")
                    uow.result = i
            with ob.unit_of_work("k0") as uow:
                assert uow.replayed and uow.result == 0
            batch = Batch.open(ob, "default", ["b1", "b2"])
            try:
                for key in ("b1", "b2"):
                    with batch.unit_of_work(key, "default") as uow:
                        assert uow.connection.execute(LEVEL).scalar() == level.lower()
                        uow.result = key
                batch.commit()
            finally:
                batch.close()
    finally:
        isolated.dispose()
    for key in ("k0", "k1", "k2", "b1", "b2"):
        assert _key_status(engine, key) == [("completed",)]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("level", ENGINE_LEVELS)
def test_async_units_of_work_run_at_the_engines_level(
    database_url: str, engine: sa.Engine, level: str, pool: str
) -> None:
    async def run() -> None:
        isolated = create_async_engine(database_url, isolation_level=level, **_pool(pool))
        try:
            async with outbox.AsyncOutbox(isolated) as aob:
                for i in range(3):
                    async with aob.unit_of_work(f"k{i}") as uow:
                        level_seen = (await uow.connection.execute(LEVEL)).scalar()
                        assert level_seen == level.lower()
                        uow.publish("iso.events", {"i": i}, key="same")
                        uow.result = i
                batch = await AsyncBatch.open(aob, "default", ["b1", "b2"])
                try:
                    for key in ("b1", "b2"):
                        async with batch.unit_of_work(key, "default") as uow:
                            uow.result = key
                    await batch.commit()
                finally:
                    await batch.close()
        finally:
            await isolated.dispose()

    asyncio.run(run())
    for key in ("k0", "k1", "k2", "b1", "b2"):
        assert _key_status(engine, key) == [("completed",)]


@pytest.mark.parametrize("level", LEVELS)
def test_a_serialization_failure_leaves_the_key_free(
    database_url: str, engine: sa.Engine, counter: None, level: str
) -> None:
    isolated = sa.create_engine(database_url, isolation_level=level)
    try:
        with outbox.Outbox(isolated) as ob:
            with pytest.raises(sa.exc.OperationalError) as raised, ob.unit_of_work("lost") as uow:
                # The claim took this transaction's snapshot; another transaction then changes
                # the row this one is about to change.
                with engine.begin() as other:
                    other.execute(BUMP)
                uow.connection.execute(BUMP)
            assert transaction_conflict(raised.value)
            with ob.unit_of_work("lost") as uow:  # the retry runs the body
                assert not uow.replayed
                uow.connection.execute(BUMP)
    finally:
        isolated.dispose()
    assert _key_status(engine, "lost") == [("completed",)]


def _conflicting_handler(engine: sa.Engine, calls: list[int]) -> Any:
    def handler(uow: Any, message: Any) -> str:
        calls.append(1)
        if len(calls) == 1:  # the first attempt loses to a concurrent transaction
            with engine.begin() as other:
                other.execute(BUMP)
        uow.connection.execute(BUMP)
        return "ok"

    return handler


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("level", LEVELS)
def test_sync_consumer_attempts_on_an_isolated_engine(
    database_url: str, engine: sa.Engine, counter: None, level: str, pool: str
) -> None:
    isolated = sa.create_engine(database_url, isolation_level=level, **_pool(pool))
    try:
        with outbox.Outbox(isolated) as ob:
            deliver = Deliverer(ob, max_attempts=1)
            for i in range(3):
                done = deliver(lambda uow, message: "ok", {"i": i})
                assert done.outcome == "processed", done
            calls: list[int] = []
            first = deliver(_conflicting_handler(engine, calls), {"c": 1}, idempotency_key="c")
            # Retried, not counted: with max_attempts=1 a counted failure is dead-lettered.
            assert first.outcome == "retry" and transaction_conflict(first.error)
            done = deliver(_conflicting_handler(engine, calls), {"c": 1}, idempotency_key="c")
            assert done.outcome == "processed"
            assert deliver.dead_letters == []
    finally:
        isolated.dispose()


@pytest.mark.parametrize("level", LEVELS)
def test_async_consumer_attempts_on_an_isolated_engine(
    database_url: str, engine: sa.Engine, counter: None, level: str
) -> None:
    deliver = Deliverer(outbox.Outbox(engine), max_attempts=1)  # its config and messages
    calls: list[int] = []

    async def handler(uow: Any, message: Any) -> str:
        calls.append(1)
        if len(calls) == 1:
            with engine.begin() as other:
                other.execute(BUMP)
        await uow.connection.execute(BUMP)
        return "ok"

    async def run() -> list[tuple[AttemptVerdict, int]]:
        isolated = create_async_engine(database_url, isolation_level=level)
        seen = []
        try:
            async with outbox.AsyncOutbox(isolated) as aob:
                attempts = AsyncAttempts(
                    aob, handler, deliver.config, ConsumerMetrics(CollectorRegistry()),
                    dlq=_NoDeadLetters(), key_func=None, fingerprint_func=None, beat=lambda: None,
                )  # fmt: skip
                message = deliver.message({"c": 1}, idempotency_key="c")
                tries = Tries()
                for _ in range(2):
                    seen.append((await attempts.apply(message, tries), tries.attempts))
        finally:
            await isolated.dispose()
        return seen

    # max_attempts=1: a counted failure would dead-letter the message at once.
    assert asyncio.run(run()) == [(AttemptVerdict.RETRY, 0), (AttemptVerdict.PROCESSED, 0)]


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_the_consumer_runner_on_a_serializable_engine(
    kafka_bootstrap: str, database_url: str, engine: sa.Engine, counter: None, flavour: str
) -> None:
    topic = topic_with_dead_letters(kafka_bootstrap, "isolation")
    options = {"isolation_level": "SERIALIZABLE"}  # through engine_options, as users do
    processed: list[str] = []

    def handle(uow: Any, message: Any) -> str:
        processed.append(uow.key)
        uow.connection.execute(BUMP)
        return uow.key

    async def ahandle(uow: Any, message: Any) -> str:
        processed.append(uow.key)
        await uow.connection.execute(BUMP)
        return uow.key

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", i % 2) for i in range(10)])
    ob: Any
    if flavour == "sync":
        ob = outbox.Outbox(database_url, engine_options=options)
        runner: Any = ConsumerRunner(
            ob, handle, topics=[topic], bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
            group=f"g-{uuid.uuid4().hex[:8]}", metrics_registry=CollectorRegistry(),
        )  # fmt: skip
    else:  # closed by Running on its event loop
        ob = outbox.AsyncOutbox(database_url, engine_options=options)
        runner = AsyncConsumerRunner(
            ob, ahandle, topics=[topic], bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
            group=f"g-{uuid.uuid4().hex[:8]}", metrics_registry=CollectorRegistry(),
        )  # fmt: skip
    registry = runner.metrics_registry
    running = Running(runner, registry)
    try:
        wait_for(
            lambda: committed(kafka_bootstrap, runner.config.group, topic) == [5, 5],
            60,
            "all ten messages processed and their offsets committed",
            interval=0.1,
        )
    finally:
        running.stop()
        if flavour == "sync":
            ob.close()
    assert sorted(set(processed)) == sorted(f"k{i}" for i in range(10))
    assert metric(running, "outbox_consumer_dead_lettered_total", topic=topic) == 0
    # Not one attempt failed (a failure would have been retried on a connection that had
    # prepared its statements by then, and gone unnoticed).
    assert metric(running, "outbox_consumer_failed_total", topic=topic, kind="error") == 0
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT n FROM counters")).scalar() == 10


class _NoDeadLetters:
    """A dead-letter producer for attempts that must not dead-letter."""

    async def send_message(self, message: Any, letter: Any) -> None:
        raise AssertionError(f"unexpected dead letter: {letter}")
