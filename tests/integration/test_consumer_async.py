"""AsyncConsumerRunner against real PostgreSQL, Redis and a Kafka-protocol broker, in process.

The runner's loop is the same source as ConsumerRunner's (tests/integration/test_consumer.py);
these tests hold the asyncio flavour to the same guarantees with coroutine handlers on an
AsyncOutbox: duplicates applied once, dead letters, retries in order, offsets only behind
committed units of work -- and an event loop that the Kafka client never blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox, OutboxConfig, PermanentError
from outbox._kafka import consumer as kafka_consumer
from outbox.consumer import AsyncConsumerRunner, DeadLetterInfo
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    metric,
    produce,
    read_topic,
    rows,
    topic_with_dead_letters,
)

INSERT = sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)")


class Boom(Exception):
    """A transient failure raised by test handlers."""


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    return topic_with_dead_letters(kafka_bootstrap, "orders")


@pytest.fixture
def effects(engine: sa.Engine) -> sa.Engine:
    """A business table without a unique key, so a doubled effect shows up as a second row."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL, value text NOT NULL)"))
    return engine


@pytest.fixture
def start(
    kafka_bootstrap: str, database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[Callable[..., Running]]:
    """``start(handler, topic, **options)``: an AsyncConsumerRunner on a new AsyncOutbox, in an
    event loop on a thread of its own (the outbox is closed in that loop when it stops)."""
    running: list[Running] = []

    def make(handler: Any, topic: str, **options: Any) -> Running:
        options.setdefault("group", f"g-{uuid.uuid4().hex[:8]}")
        registry = options.setdefault("metrics_registry", CollectorRegistry())
        config = OutboxConfig(cache_prefix=redis_prefix, **options.pop("outbox_config", {}))
        ob = AsyncOutbox(database_url, redis_url=redis_url, config=config)
        runner = AsyncConsumerRunner(
            ob, handler, topics=[topic], bootstrap_servers=kafka_bootstrap,
            kafka_config=KAFKA, **options,
        )  # fmt: skip
        r = Running(runner, registry)
        running.append(r)
        return r

    try:
        yield make
    finally:
        for r in running:
            r.runner.stop()
        for r in running:
            r.thread.join(30)


def end_offsets(records: list[dict[str, Any]], partitions: int = 2) -> list[int]:
    """Offsets after the last of ``records`` (produced to explicit partitions of a new topic)."""
    return [sum(1 for r in records if r["partition"] == p) for p in range(partitions)]


def key_status(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT key, status FROM idempotency_keys")).all())


def test_duplicates_apply_once_and_offsets_follow(
    kafka_bootstrap: str, topic: str, effects: sa.Engine, start: Any
) -> None:
    calls: list[str] = []

    async def handle(uow: Any, message: Any) -> dict[str, str]:
        value = message.value().decode()
        calls.append(value)
        if int(uow.key[1:]) % 2:
            await uow.connection.execute(INSERT, {"k": uow.key, "v": value})
        else:  # the ORM session of the unit of work, in the same transaction
            await uow.session.execute(INSERT, {"k": uow.key, "v": value})
        uow.publish("orders.accepted", {"key": uow.key}, key=uow.key)
        await asyncio.sleep(0)  # a handler may await anything
        return {"seen": value}

    records = [keyed(f"k{i}", f"v{i}", partition=i % 2) for i in range(40)]
    # The same keys again, on the other partition: duplicates that race their originals.
    records += [keyed(f"k{i}", f"dup{i}", partition=(i + 1) % 2) for i in range(0, 40, 4)]
    produce(kafka_bootstrap, topic, records)
    running = start(handle, topic)
    wait_for(
        lambda: committed(kafka_bootstrap, running.runner.config.group, topic)
        == end_offsets(records),
        30, "offsets of every message committed",
    )  # fmt: skip
    running.stop()

    got = rows(effects)
    assert sorted(k for k, _ in got) == sorted(f"k{i}" for i in range(40))
    assert len(calls) == 40
    assert metric(running, "outbox_consumer_replayed_total", topic=topic, status="completed") == 10
    assert metric(running, "outbox_consumer_processed_total", topic=topic) == 40
    with effects.connect() as conn:
        events = conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one()
        stored = conn.execute(
            sa.text("SELECT result FROM idempotency_keys WHERE key = 'k4'")
        ).scalar_one()
    assert events == 40
    # The original and its duplicate race (different partitions): the stored result is the
    # one of the message that was applied, whichever came first.
    assert stored == {"seen": dict(got)["k4"]}
    assert dict(got)["k4"] in {"v4", "dup4"}


def test_permanent_errors_and_missing_keys_are_dead_lettered(
    kafka_bootstrap: str, topic: str, effects: sa.Engine, start: Any
) -> None:
    async def handle(uow: Any, message: Any) -> None:
        value = message.value().decode()
        if value.startswith("poison"):
            raise PermanentError(f"cannot apply {value}")
        if value.startswith("flaky"):
            raise Boom("always down")
        await uow.connection.execute(INSERT, {"k": uow.key, "v": value})

    records = [
        keyed("a", "ok-a", 0),
        keyed("p1", "poison-1", 0),
        keyed(None, "keyless", 0),
        keyed("f1", "flaky-1", 1),
        keyed("b", "ok-b", 1),
        keyed("c", "ok-c", 0),
        keyed("p1", "poison-1-again", 0),  # a duplicate of a failed key: no second dead letter
    ]
    produce(kafka_bootstrap, topic, records)
    running = start(handle, topic, max_attempts=3, retry_backoff=0.02)
    wait_for(
        lambda: committed(kafka_bootstrap, running.runner.config.group, topic)
        == end_offsets(records),
        30, "offsets of every message committed", interval=0.1,
    )  # fmt: skip
    running.stop()

    letters = {m.value(): m for m in read_topic(kafka_bootstrap, topic + ".dlq", 3)}
    assert set(letters) == {b"poison-1", b"keyless", b"flaky-1"}
    infos = {value: DeadLetterInfo.from_headers(m.headers()) for value, m in letters.items()}
    assert (infos[b"poison-1"].reason, infos[b"poison-1"].idempotency_key) == (
        "permanent-error", "p1",
    )  # fmt: skip
    assert (infos[b"poison-1"].partition, infos[b"poison-1"].offset) == (0, 1)
    assert infos[b"keyless"].reason == "missing-key"
    assert (infos[b"flaky-1"].reason, infos[b"flaky-1"].attempts) == ("retries-exhausted", 3)
    assert sorted(rows(effects)) == [("a", "ok-a"), ("b", "ok-b"), ("c", "ok-c")]
    status = key_status(effects)
    assert status["p1"] == "failed" and "f1" not in status
    assert metric(running, "outbox_consumer_replayed_total", topic=topic, status="failed") == 1


def test_transient_errors_retry_the_same_message_in_order(
    kafka_bootstrap: str, topic: str, effects: sa.Engine, start: Any
) -> None:
    failures = {"k1": 2}
    order: list[str] = []

    async def handle(uow: Any, message: Any) -> None:
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "rolled back on failure"})
        if failures.get(uow.key, 0) > 0:
            failures[uow.key] -= 1
            raise Boom("database blip")
        order.append(uow.key)

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(5)])
    running = start(handle, topic, retry_backoff=0.05)
    wait_for(lambda: len(rows(effects)) == 5, 30, "five effects")
    running.stop()
    assert order == ["k0", "k1", "k2", "k3", "k4"]
    assert sorted(k for k, _ in rows(effects)) == ["k0", "k1", "k2", "k3", "k4"]
    assert metric(running, "outbox_consumer_failed_total", topic=topic, kind="error") == 2


def test_offsets_follow_committed_units_of_work_and_stop_finishes_the_message_in_hand(
    kafka_bootstrap: str, topic: str, effects: sa.Engine, start: Any
) -> None:
    in_handler = threading.Event()
    proceed = threading.Event()
    calls: list[str] = []

    async def handle(uow: Any, message: Any) -> None:
        calls.append(uow.key)
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if uow.key == "k3":
            in_handler.set()
            while not proceed.is_set():  # the event loop stays free meanwhile
                await asyncio.sleep(0.01)

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    running = start(handle, topic, commit_interval=0.05)
    group = running.runner.config.group
    try:
        assert in_handler.wait(30)
        time.sleep(0.3)  # several commit intervals
        # k3's unit of work is open (with those of k0..k2 when they share its batch): no offset
        # passes a message whose work is not visible.
        visible = sorted(k for k, _ in rows(effects))
        assert "k3" not in visible and visible == [f"k{i}" for i in range(len(visible))]
        assert committed(kafka_bootstrap, group, topic)[0] <= len(visible)
        running.runner.stop()  # arrives while k3 is in hand
    finally:
        proceed.set()
    running.stop()
    assert calls == ["k0", "k1", "k2", "k3"]
    assert committed(kafka_bootstrap, group, topic)[0] == 4
    again = start(handle, topic, group=group)
    wait_for(lambda: len(rows(effects)) == 10, 30, "the rest after a restart")
    again.stop()
    assert calls == [f"k{i}" for i in range(10)]


def test_key_in_progress_holds_its_partition_and_never_skips(
    kafka_bootstrap: str, topic: str, database_url: str, effects: sa.Engine, start: Any
) -> None:
    calls: list[str] = []
    group = f"g-{uuid.uuid4().hex[:8]}"

    async def handle(uow: Any, message: Any) -> str:
        calls.append(uow.key)
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "runner"})
        return "runner"

    release = threading.Event()
    held = threading.Event()
    holder_outbox = Outbox(database_url)

    def hold() -> None:  # another service holds the key: a sync unit of work on a thread
        with holder_outbox.unit_of_work("busy", scope=group) as uow:
            uow.connection.execute(INSERT, {"k": "busy", "v": "other"})
            uow.result = "other"
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        produce(kafka_bootstrap, topic, [keyed("busy", "x", 0), keyed("after", "x", 0),
                                         keyed("elsewhere", "x", 1)])  # fmt: skip
        running = start(handle, topic, group=group)
        wait_for(lambda: "elsewhere" in calls, 30, "the other partition keeps flowing")
        wait_for(
            lambda: metric(running, "outbox_consumer_failed_total",
                           topic=topic, kind="key_in_progress") >= 3,
            30, "the held key is retried",
        )  # fmt: skip
        assert "after" not in calls
        assert committed(kafka_bootstrap, group, topic)[0] < 0
    finally:
        release.set()
        holder.join(10)
        holder_outbox.close()
    wait_for(lambda: "after" in calls, 30, "the partition resumes once the key is released")
    running.stop()
    assert calls == ["elsewhere", "after"]  # "busy" replayed the holder's result
    assert committed(kafka_bootstrap, group, topic) == [2, 1]


def test_the_event_loop_is_never_blocked_by_the_kafka_client(
    kafka_bootstrap: str,
    topic: str,
    database_url: str,
    effects: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Polls (2 s each here), commits and closing run on the client's thread, never on the
    event loop's: each call records the thread it ran on, and a task sharing the runner's loop
    keeps ticking while an idle poll waits (a poll on the loop would leave no tick inside it)."""
    calls: list[tuple[str, threading.Thread, float, float]] = []
    ticks: list[float] = []

    def recorded(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                calls.append((name, threading.current_thread(), started, time.monotonic()))

        return call

    for name in ("consume", "commit", "close"):
        method = getattr(kafka_consumer.KafkaConsumer, name)
        monkeypatch.setattr(kafka_consumer.KafkaConsumer, name, recorded(name, method))

    async def handle(uow: Any, message: Any) -> None:
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})

    async def main() -> threading.Thread:
        ob = AsyncOutbox(database_url)
        runner = AsyncConsumerRunner(
            ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
            bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
            metrics_registry=CollectorRegistry(), poll_timeout=2.0, commit_interval=2.0,
        )  # fmt: skip

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())

        async def feed_and_stop() -> None:
            await asyncio.to_thread(produce, kafka_bootstrap, topic, [keyed("k1", "x", 0)])
            for _ in range(3000):
                if await asyncio.to_thread(rows, effects):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(4.5)  # idle polls
            runner.stop()

        ticker = asyncio.create_task(tick())
        try:
            await asyncio.gather(runner.run(), feed_and_stop())
        finally:
            ticker.cancel()
            await ob.close()
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert rows(effects) == [("k1", "x")]
    names = {name for name, *_ in calls}
    assert names == {"consume", "commit", "close"}, names
    on_the_loop = [name for name, thread, *_ in calls if thread is loop_thread]
    assert on_the_loop == [], f"ran on the event loop's thread: {on_the_loop}"
    idle = [
        (start, end) for name, _, start, end in calls if name == "consume" and end - start > 1.5
    ]
    assert idle, "no idle poll to watch"
    for start, end in idle:
        inside = sum(1 for t in ticks if start < t < end)
        assert inside >= 10, f"the loop ticked {inside} times during a {end - start:.1f}s poll"
