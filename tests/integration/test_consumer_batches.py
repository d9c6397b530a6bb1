"""The consumer runner's micro-batches against real PostgreSQL, Redis and a Kafka-protocol broker.

Many messages run in one PostgreSQL transaction, each in a savepoint; the guarantees are those of
one transaction per message: offsets only behind committed work, per-partition order, a poison
message dead-lettered alone, a transient failure retried without losing the rest of its batch,
Redis written only after the commit, duplicates from Redis without a transaction, a key held
elsewhere never waited for -- and a batch handler that gets the batch at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox, OutboxConfig, PermanentError
from outbox.consumer import (
    AsyncConsumerRunner,
    ConsumerRunner,
    DeadLetterInfo,
    MessageBatch,
    batch_handler,
)
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    metric,
    produce,
    read_topic,
    topic_with_dead_letters,
)
from tests.fixtures.uow import watch

INSERT = sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)")


class Boom(Exception):
    """A transient failure raised by test handlers."""


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    return topic_with_dead_letters(kafka_bootstrap, "batches")


@pytest.fixture
def effects(engine: sa.Engine) -> sa.Engine:
    """Business rows in the order they were written (``seq``), without a unique key: a doubled
    effect shows up as a second row."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE effects (seq serial, key text NOT NULL, value text NOT NULL)")
        )
    return engine


def applied(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text("SELECT key FROM effects ORDER BY seq"))]


def statuses(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT key, status FROM idempotency_keys")).all())


@pytest.fixture
def outbox(database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Outbox]:
    ob = Outbox(database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix))
    try:
        yield ob
    finally:
        ob.close()


@pytest.fixture
def start(kafka_bootstrap: str) -> Iterator[Callable[..., Running]]:
    running: list[Running] = []

    def make(outbox: Any, handler: Any, topic: str, **options: Any) -> Running:
        options.setdefault("group", f"g-{uuid.uuid4().hex[:8]}")
        registry = options.setdefault("metrics_registry", CollectorRegistry())
        runner_class = AsyncConsumerRunner if isinstance(outbox, AsyncOutbox) else ConsumerRunner
        runner = runner_class(
            outbox, handler, topics=[topic], bootstrap_servers=kafka_bootstrap,
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


def all_committed(bootstrap: str, running: Running, topic: str, ends: list[int]) -> None:
    group = running.runner.config.group
    wait_for(lambda: committed(bootstrap, group, topic) == ends, 30,
             f"offsets {ends} committed", interval=0.1)  # fmt: skip


def test_a_batch_commits_once_and_offsets_and_redis_follow_its_commit(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    reached, release = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> str:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if uow.key == "k15":
            reached.set()
            release.wait(30)
        return uow.key

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(20)])
    with watch(outbox.engine) as db:
        running = start(outbox, handle, topic)
        try:
            assert reached.wait(30)
            time.sleep(0.3)  # several commit intervals of a runner that would commit early
            group = running.runner.config.group
            # k0..k14 ran in the batch of k15: nothing of it is visible, committed or cached.
            assert applied(effects) == []
            assert committed(kafka_bootstrap, group, topic)[0] < 0
            assert outbox.cache is not None
            assert outbox.cache.get(group, "k3") is None
        finally:
            release.set()
        all_committed(kafka_bootstrap, running, topic, [20, -1001])
    running.stop()
    assert applied(effects) == [f"k{i}" for i in range(20)]
    cached = outbox.cache.get(group, "k3")
    assert cached is not None and cached.result_json == '"k3"'
    assert db.checkouts <= 3  # a transaction per batch, not per message
    assert metric(running, "outbox_consumer_processed_total", topic=topic) == 20


def test_a_poison_message_goes_to_the_dead_letter_topic_alone_while_its_batch_commits(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: Counter[str] = Counter()

    def handle(uow: Any, message: Any) -> None:
        calls[uow.key] += 1
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        uow.publish("orders.accepted", {"key": uow.key})
        if uow.key == "k4":
            raise PermanentError("cannot apply k4")
        if uow.key == "k7":
            uow.publish("not a topic!", {"key": uow.key})  # refused input

    records = [keyed(f"k{i}", "x", 0) for i in range(10)] + [keyed("j0", "x", 1)]
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic)
    all_committed(kafka_bootstrap, running, topic, [10, 1])
    running.stop()

    assert calls == dict.fromkeys([f"k{i}" for i in range(10)] + ["j0"], 1)  # no retries
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 2)
    infos = sorted((DeadLetterInfo.from_headers(m.headers()) for m in letters),
                   key=lambda i: i.offset)  # fmt: skip
    assert [(i.idempotency_key, i.reason, i.offset) for i in infos] == [
        ("k4", "permanent-error", 4),
        ("k7", "invalid-input", 7),
    ]
    assert sorted(applied(effects)) == sorted(
        ["j0", *(f"k{i}" for i in range(10) if i not in (4, 7))]
    )
    keys = statuses(effects)
    assert keys["k4"] == "failed" and "k7" not in keys
    assert sum(1 for s in keys.values() if s == "completed") == 9
    with effects.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 9
    assert metric(running, "outbox_consumer_failed_total", topic=topic, kind="error") == 0


def test_a_transient_failure_retries_without_losing_the_work_of_its_batch(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: Counter[str] = Counter()
    failures = {"k5": 1}

    def handle(uow: Any, message: Any) -> None:
        calls[uow.key] += 1
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if failures.get(uow.key, 0):
            failures[uow.key] -= 1
            raise Boom("database blip")

    records = [keyed(f"k{i}", "x", 0) for i in range(10)]
    records += [keyed(f"j{i}", "x", 1) for i in range(5)]
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic, retry_backoff=0.05)
    all_committed(kafka_bootstrap, running, topic, [10, 5])
    running.stop()

    # Only k5 ran twice; what its batch did before and around it stayed done.
    assert calls == {**dict.fromkeys([f"k{i}" for i in range(10)], 1), "k5": 2,
                     **dict.fromkeys([f"j{i}" for i in range(5)], 1)}  # fmt: skip
    order = applied(effects)
    assert [k for k in order if k.startswith("k")] == [f"k{i}" for i in range(10)]
    assert sorted(k for k in order if k.startswith("j")) == [f"j{i}" for i in range(5)]
    assert metric(running, "outbox_consumer_failed_total", topic=topic, kind="error") == 1


def test_per_partition_order_holds_across_batches_and_retries(
    kafka_bootstrap: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    name = topic_with_dead_letters(kafka_bootstrap, "order", partitions=4)
    flaky = {f"m{i}" for i in range(400) if i % 7 == 3}
    failed: set[str] = set()

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": str(message.partition())})
        if uow.key in flaky and uow.key not in failed:
            failed.add(uow.key)
            raise Boom("once")

    records = [keyed(f"m{i}", "x", i % 4) for i in range(400)]
    produce(kafka_bootstrap, name, records)
    running = start(outbox, handle, name, retry_backoff=0.01, retry_backoff_max=0.02,
                    batch_size=64)  # fmt: skip
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


def test_a_key_held_elsewhere_is_not_waited_for_and_its_partition_stops_there(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    held, release = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> str:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "runner"})
        return "runner"

    def hold() -> None:
        with outbox.unit_of_work("busy", scope=group) as uow:
            uow.connection.execute(INSERT, {"k": "busy", "v": "other"})
            uow.result = "other"
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        produce(kafka_bootstrap, topic, [keyed("a", "x", 0), keyed("busy", "x", 0),
                                         keyed("after", "x", 0), keyed("x", "x", 1),
                                         keyed("y", "x", 1)])  # fmt: skip
        running = start(outbox, handle, topic, group=group)
        wait_for(lambda: {"a", "x", "y"} <= set(applied(effects)), 30,
                 "the rest of the batch commits without waiting")  # fmt: skip
        wait_for(
            lambda: metric(running, "outbox_consumer_failed_total",
                           topic=topic, kind="key_in_progress") >= 2,
            30, "the held key is tried again, never waited for",
        )  # fmt: skip
        assert "after" not in applied(effects)
        all_committed(kafka_bootstrap, running, topic, [1, 2])  # not past the held key
    finally:
        release.set()
        holder.join(10)
    all_committed(kafka_bootstrap, running, topic, [3, 2])
    running.stop()
    assert sorted(applied(effects)) == ["a", "after", "busy", "x", "y"]
    replayed = metric(running, "outbox_consumer_replayed_total", topic=topic, status="completed")
    assert replayed == 1  # "busy" got the holder's result


def test_duplicates_answered_from_redis_open_no_transaction(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})

    keys = [f"k{i}" for i in range(60)]
    produce(kafka_bootstrap, topic, [keyed(k, "x", i % 2) for i, k in enumerate(keys)])
    running = start(outbox, handle, topic)
    all_committed(kafka_bootstrap, running, topic, [30, 30])
    with watch(outbox.engine) as db:
        produce(kafka_bootstrap, topic, [keyed(k, "again", i % 2) for i, k in enumerate(keys)])
        all_committed(kafka_bootstrap, running, topic, [60, 60])
    running.stop()
    assert (db.checkouts, db.connects, db.statements) == (0, 0, [])
    assert len(applied(effects)) == 60
    assert metric(running, "outbox_consumer_replayed_total", topic=topic, status="completed") == 60


def test_a_batch_that_fails_at_its_commit_is_tried_one_message_at_a_time(
    kafka_bootstrap: str, topic: str, outbox: Outbox, engine: sa.Engine, start: Any
) -> None:
    """A deferred constraint fails the whole batch at COMMIT: which message broke it is not
    known, so each is tried alone; the one that breaks it alone is retried, then dead-lettered."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE TABLE effects (seq serial, key text NOT NULL, value text NOT NULL, "
            "CONSTRAINT one_value UNIQUE (value) DEFERRABLE INITIALLY DEFERRED)"
        ))  # fmt: skip
    calls: Counter[str] = Counter()

    def handle(uow: Any, message: Any) -> None:
        calls[uow.key] += 1
        uow.connection.execute(INSERT, {"k": uow.key, "v": message.value().decode()})

    values = ["v0", "v1", "clash", "v3", "clash", "v5"]
    produce(kafka_bootstrap, topic, [keyed(f"k{i}", v, 0) for i, v in enumerate(values)])
    running = start(outbox, handle, topic, max_attempts=2, retry_backoff=0.02)
    all_committed(kafka_bootstrap, running, topic, [6, -1001])
    running.stop()

    assert applied(engine) == ["k0", "k1", "k2", "k3", "k5"]
    [letter] = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    info = DeadLetterInfo.from_headers(letter.headers())
    assert (info.idempotency_key, info.reason, info.attempts) == ("k4", "retries-exhausted", 2)
    assert calls["k4"] == 3  # in the batch, then twice alone
    assert "k4" not in statuses(engine)


def test_a_batch_handler_gets_the_messages_whose_work_must_run_at_once(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    sizes: list[int] = []

    @batch_handler
    def handle(batch: MessageBatch) -> list[dict[str, str]]:
        sizes.append(len(batch))
        # One statement for the whole batch, in its transaction.
        batch.connection.execute(INSERT, [{"k": uow.key, "v": "bulk"} for uow, _ in batch])
        for uow, _message in batch:
            uow.publish("orders.accepted", {"key": uow.key}, key=uow.key)
        return [{"done": uow.key} for uow, _ in batch]

    first = [keyed(f"k{i}", "x", 0) for i in range(20)]
    produce(kafka_bootstrap, topic, first)
    running = start(outbox, handle, topic)
    all_committed(kafka_bootstrap, running, topic, [20, -1001])
    # Duplicates never reach the handler; the new keys among them do, together.
    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10, 30)])
    all_committed(kafka_bootstrap, running, topic, [40, -1001])
    running.stop()

    assert sorted(applied(effects)) == sorted(f"k{i}" for i in range(30))
    assert sum(sizes) == 30 and max(sizes) > 1
    with effects.connect() as conn:
        result = conn.execute(
            sa.text("SELECT result FROM idempotency_keys WHERE key = 'k25'")
        ).scalar_one()
        events = conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one()
    assert result == {"done": "k25"} and events == 30


def test_a_failing_batch_handler_is_given_its_messages_one_at_a_time(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    sizes: list[int] = []

    @batch_handler
    def handle(batch: MessageBatch) -> None:
        sizes.append(len(batch))
        batch.connection.execute(INSERT, [{"k": uow.key, "v": "bulk"} for uow, _ in batch])
        for uow, message in batch:
            if message.value() == b"poison":
                raise PermanentError(f"{uow.key} cannot be applied")
            uow.result = "ok"

    records = [keyed(f"k{i}", "poison" if i == 6 else "x", 0) for i in range(10)]
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic)
    all_committed(kafka_bootstrap, running, topic, [10, -1001])
    running.stop()

    assert sizes[0] == 10 and sizes[1:] == [1] * 10  # all at once, then each alone
    assert applied(effects) == [f"k{i}" for i in range(10) if i != 6]
    [letter] = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    info = DeadLetterInfo.from_headers(letter.headers())
    assert (info.idempotency_key, info.reason) == ("k6", "permanent-error")
    assert statuses(effects)["k6"] == "failed"


def test_the_asyncio_runner_in_batches(
    kafka_bootstrap: str,
    topic: str,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    effects: sa.Engine,
    start: Any,
) -> None:
    calls: Counter[str] = Counter()
    failures = {"k3": 1}

    async def handle(uow: Any, message: Any) -> str:
        calls[uow.key] += 1
        await uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if uow.key == "k6":
            raise PermanentError("k6 cannot be applied")
        if failures.get(uow.key, 0):
            failures[uow.key] -= 1
            raise Boom("once")
        await asyncio.sleep(0)
        return uow.key

    @batch_handler
    async def handle_batch(batch: Any) -> None:
        await batch.connection.execute(INSERT, [{"k": u.key, "v": "bulk"} for u, _ in batch])
        for uow, _ in batch:
            uow.result = uow.key

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    aob = AsyncOutbox(database_url, redis_url=redis_url,
                      config=OutboxConfig(cache_prefix=redis_prefix))  # fmt: skip
    running = start(aob, handle, topic, retry_backoff=0.05)  # closed in its loop
    all_committed(kafka_bootstrap, running, topic, [10, -1001])
    running.stop()
    assert calls == {**{f"k{i}": 1 for i in range(10)}, "k3": 2}
    assert applied(effects) == [f"k{i}" for i in range(10) if i != 6]
    assert statuses(effects)["k6"] == "failed"

    produce(kafka_bootstrap, topic, [keyed(f"b{i}", "x", 1) for i in range(10)])
    aob = AsyncOutbox(database_url, redis_url=redis_url,
                      config=OutboxConfig(cache_prefix=redis_prefix))  # fmt: skip
    running = start(aob, handle_batch, topic)
    all_committed(kafka_bootstrap, running, topic, [10, 10])
    running.stop()
    bulk = [k for k in applied(effects) if k.startswith("b")]
    assert sorted(bulk) == sorted(f"b{i}" for i in range(10))


def test_batch_size_1_is_one_transaction_per_message(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(12)])
    with watch(outbox.engine) as db:
        running = start(outbox, handle, topic, batch_size=1)
        all_committed(kafka_bootstrap, running, topic, [12, -1001])
    running.stop()
    assert applied(effects) == [f"k{i}" for i in range(12)]
    # One checkout per message, and one more when the cache reads its signing secret (once).
    secret_reads = sum("outbox_cache_secret" in s for s in db.statements)
    assert db.checkouts == 12 + secret_reads


def test_batch_size_and_duration_are_observed_per_micro_batch(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(40)])
    running = start(outbox, handle, topic, batch_size=10)
    all_committed(kafka_bootstrap, running, topic, [40, -1001])
    running.stop()
    batches = metric(running, "outbox_consumer_batch_size_count")
    assert 4 <= batches <= 40  # at most 10 messages a batch
    assert metric(running, "outbox_consumer_batch_size_sum") == 40
    assert metric(running, "outbox_consumer_batch_seconds_count") == batches
    assert metric(running, "outbox_consumer_batch_seconds_sum") > 0
    assert metric(running, "outbox_consumer_batch_size_bucket", le="10.0") == batches


def test_lag_per_partition_counts_the_messages_not_finished(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    reached, release = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(INSERT, {"k": uow.key, "v": "x"})
        if uow.key == "k6":
            reached.set()
            release.wait(30)
        else:
            time.sleep(0.03)  # longer than the commit interval: the lag is reported between

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    running = start(outbox, handle, topic, batch_size=1, commit_interval=0.01)
    try:
        assert reached.wait(30)
        # k0..k5 finished, k6 is in hand: 10 - 6 messages are not finished on partition 0.
        wait_for(
            lambda: metric(running, "outbox_consumer_lag", topic=topic, partition="0") == 4,
            10, "lag 4 reported while k6 is in hand", interval=0.05,
        )  # fmt: skip
    finally:
        release.set()
    all_committed(kafka_bootstrap, running, topic, [10, -1001])
    wait_for(
        lambda: metric(running, "outbox_consumer_lag", topic=topic, partition="0") == 0,
        10, "lag 0 once every message finished", interval=0.05,
    )  # fmt: skip
    running.stop()
    assert applied(effects) == [f"k{i}" for i in range(10)]
    # batch_size=1: every message is a micro-batch of one (tried alone), counted all the same
    assert metric(running, "outbox_consumer_batch_size_sum") == 10
    assert metric(running, "outbox_consumer_batch_size_count") == 10
