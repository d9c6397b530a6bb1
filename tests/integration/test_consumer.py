"""ConsumerRunner against real PostgreSQL, Redis and a Kafka-protocol broker (in-process runner),
one message per transaction and in micro-batches."""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import Outbox, OutboxConfig, PermanentError
from outbox._core.deadletter import HEADER_REASON, DeadLetterInfo
from outbox.consumer import ConsumerRunner, serve_metrics
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
def outbox(database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Outbox]:
    ob = Outbox(database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix))
    try:
        yield ob
    finally:
        ob.close()


@pytest.fixture(params=[1, 500], ids=["alone", "batches"])
def start(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Running]]:
    """Runners that take one message per transaction (``batch_size=1``: the runner before
    micro-batches) or batches of up to 500: every test holds for both."""
    running: list[Running] = []

    def make(outbox: Outbox, handler: Any, topic: str, **options: Any) -> Running:
        options.setdefault("group", f"g-{uuid.uuid4().hex[:8]}")
        options.setdefault("batch_size", request.param)
        registry = options.setdefault("metrics_registry", CollectorRegistry())
        runner = ConsumerRunner(
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


def end_offsets(records: list[dict[str, Any]], partitions: int = 2) -> list[int]:
    """Offsets after the last of ``records`` (produced to explicit partitions of a new topic).

    Counted rather than asked of the broker: Tansu's high watermarks are not reliable.
    """
    return [sum(1 for r in records if r["partition"] == p) for p in range(partitions)]


def test_duplicates_apply_once_and_offsets_follow(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: list[str] = []

    def handle(uow: Any, message: Any) -> dict[str, str]:
        value = message.value().decode()
        calls.append(value)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
            {"k": uow.key, "v": value},
        )
        return {"seen": value}

    records = [keyed(f"k{i}", f"v{i}", partition=i % 2) for i in range(40)]
    # The same keys again, on the other partition: duplicates that race their originals.
    records += [keyed(f"k{i}", f"dup{i}", partition=(i + 1) % 2) for i in range(0, 40, 4)]
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic)
    wait_for(
        lambda: committed(kafka_bootstrap, running.runner.config.group, topic)
        == end_offsets(records),
        30, "offsets of every message committed",
    )  # fmt: skip
    running.stop()

    got = rows(effects)
    assert sorted(k for k, _ in got) == sorted(f"k{i}" for i in range(40))
    assert len(calls) == 40
    replayed = metric(running, "outbox_consumer_replayed_total",
                      topic=topic, status="completed")  # fmt: skip
    assert replayed == 10


def test_dead_letters_carry_the_original_and_the_reason(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> None:
        value = message.value().decode()
        if value.startswith("poison"):
            raise PermanentError(f"cannot apply {value}")
        if value.startswith("flaky"):
            raise Boom("always down")
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
            {"k": uow.key, "v": value},
        )

    records = [
        keyed("a", "ok-a", 0),
        {"value": b"poison-1", "key": b"kafka-key", "partition": 0,
         "headers": [("X-Idempotency-Key", b"p1"), ("trace", b"\x00\xff")]},
        keyed(None, "keyless", 0),
        keyed("f1", "flaky-1", 1),
        keyed("b", "ok-b", 1),
        keyed("c", "ok-c", 0),
        # A duplicate of the failed key, after it in its partition (across partitions either
        # could come first): no second dead letter.
        keyed("p1", "poison-1-again", 0),
    ]  # fmt: skip
    produce(kafka_bootstrap, topic, records)
    running = start(outbox, handle, topic, max_attempts=3, retry_backoff=0.02)
    wait_for(
        lambda: committed(kafka_bootstrap, running.runner.config.group, topic)
        == end_offsets(records),
        30, "offsets of every message committed", interval=0.1,
    )  # fmt: skip
    running.stop()
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 3)
    assert len(letters) == 3

    by_value = {m.value(): m for m in letters}
    assert set(by_value) == {b"poison-1", b"keyless", b"flaky-1"}
    poison = DeadLetterInfo.from_headers(by_value[b"poison-1"].headers())
    assert (poison.reason, poison.error_type, poison.idempotency_key) == (
        "permanent-error", "PermanentError", "p1",
    )  # fmt: skip
    assert "cannot apply poison-1" in poison.error
    # The original key, value and headers, then ours.
    assert by_value[b"poison-1"].key() == b"kafka-key"
    assert by_value[b"poison-1"].headers()[:2] == [("X-Idempotency-Key", b"p1"),
                                                   ("trace", b"\x00\xff")]  # fmt: skip
    assert (HEADER_REASON, b"permanent-error") in by_value[b"poison-1"].headers()
    assert (poison.topic, poison.partition, poison.offset) == (topic, 0, 1)
    keyless = DeadLetterInfo.from_headers(by_value[b"keyless"].headers())
    assert keyless.reason == "missing-key" and keyless.idempotency_key is None
    assert (keyless.partition, keyless.offset) == (0, 2)
    flaky = DeadLetterInfo.from_headers(by_value[b"flaky-1"].headers())
    assert (flaky.reason, flaky.attempts, flaky.error_type) == ("retries-exhausted", 3, "Boom")
    assert flaky.group == running.runner.config.group
    assert sorted(rows(effects)) == [("a", "ok-a"), ("b", "ok-b"), ("c", "ok-c")]

    # The exhausted key stays free (a redrive can apply it); the permanent one is recorded.
    with outbox.engine.connect() as conn:
        status = dict(conn.execute(sa.text("SELECT key, status FROM idempotency_keys")).all())
    assert status["p1"] == "failed" and "f1" not in status


def test_transient_errors_retry_the_same_message_in_order(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    failures = {"k1": 2}
    order: list[str] = []

    def handle(uow: Any, message: Any) -> None:
        if failures.get(uow.key, 0) > 0:
            failures[uow.key] -= 1
            raise Boom("database blip")
        order.append(uow.key)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, 'x')"), {"k": uow.key}
        )

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(5)])
    running = start(outbox, handle, topic, retry_backoff=0.05)
    wait_for(lambda: len(rows(effects)) == 5, 30, "five effects")
    running.stop()
    assert order == ["k0", "k1", "k2", "k3", "k4"]
    assert metric(running, "outbox_consumer_failed_total", topic=topic, kind="error") == 2


def test_key_in_progress_holds_its_partition_and_never_skips(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    """A key held by another attempt blocks only its own partition, and the message is retried
    (not skipped) until that attempt finishes -- then it replays the attempt's result."""
    calls: list[str] = []
    group = f"g-{uuid.uuid4().hex[:8]}"

    def handle(uow: Any, message: Any) -> str:
        calls.append(uow.key)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, 'runner')"), {"k": uow.key}
        )
        return "runner"

    release = threading.Event()
    held = threading.Event()

    def hold() -> None:
        with outbox.unit_of_work("busy", scope=group) as uow:
            uow.connection.execute(
                sa.text("INSERT INTO effects (key, value) VALUES ('busy', 'other')")
            )
            uow.result = "other"
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        produce(kafka_bootstrap, topic, [keyed("busy", "x", 0), keyed("after", "x", 0),
                                         keyed("elsewhere", "x", 1)])  # fmt: skip
        running = start(outbox, handle, topic, group=group)
        wait_for(lambda: "elsewhere" in calls, 30, "the other partition keeps flowing")
        wait_for(
            lambda: metric(running, "outbox_consumer_failed_total",
                           topic=topic, kind="key_in_progress") >= 3,
            30, "the held key is retried",
        )  # fmt: skip
        assert "after" not in calls  # per-partition order: nothing overtakes the held key
        assert committed(kafka_bootstrap, group, topic)[0] < 0  # nothing committed there
    finally:
        release.set()
        holder.join(10)
    wait_for(lambda: "after" in calls, 30, "the partition resumes once the key is released")
    running.stop()
    assert calls == ["elsewhere", "after"]  # "busy" replayed the holder's result
    assert sorted(rows(effects)) == [("after", "runner"), ("busy", "other"),
                                     ("elsewhere", "runner")]  # fmt: skip
    assert committed(kafka_bootstrap, group, topic) == [2, 1]


def test_stop_finishes_commits_and_a_restart_replays_nothing(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    in_handler = threading.Event()
    proceed = threading.Event()
    calls: list[str] = []

    def handle(uow: Any, message: Any) -> None:
        calls.append(uow.key)
        if uow.key == "k3":
            in_handler.set()
            proceed.wait(30)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, 'x')"), {"k": uow.key}
        )

    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(10)])
    running = start(outbox, handle, topic)
    assert in_handler.wait(30)
    running.runner.stop()  # arrives while k3 is in hand
    proceed.set()
    running.stop()
    # The message in hand finished and its offset was committed; nothing after it ran.
    assert calls == ["k0", "k1", "k2", "k3"]
    assert committed(kafka_bootstrap, running.runner.config.group, topic)[0] == 4
    again = start(outbox, handle, topic, group=running.runner.config.group)
    wait_for(lambda: len(rows(effects)) == 10, 30, "the rest after a restart")
    again.stop()
    assert calls == [f"k{i}" for i in range(10)]


def test_results_are_stored_and_replayed_from_the_fast_path(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    def handle(uow: Any, message: Any) -> dict[str, Any]:
        return {"value": json.loads(message.value())}

    produce(kafka_bootstrap, topic, [keyed("r1", json.dumps([1, 2]), 0)] * 3)
    running = start(outbox, handle, topic)
    wait_for(
        lambda: metric(running, "outbox_consumer_replayed_total",
                       topic=topic, status="completed") == 2,
        30, "two duplicates replayed",
    )  # fmt: skip
    running.stop()
    with outbox.engine.connect() as conn:
        result = conn.execute(
            sa.text("SELECT result FROM idempotency_keys WHERE key = 'r1'")
        ).scalar_one()
    assert result == {"value": [1, 2]}
    assert metric(running, "outbox_consumer_processed_total", topic=topic) == 1


def key_status(outbox: Outbox) -> dict[str, str]:
    with outbox.engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT key, status FROM idempotency_keys")).all())


def outbox_topics(outbox: Outbox) -> list[str]:
    with outbox.engine.connect() as conn:
        return sorted(conn.execute(sa.text("SELECT topic FROM outbox")).scalars())


def test_same_key_with_another_fingerprint_is_dead_lettered_as_key_reuse(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine, start: Any
) -> None:
    calls: list[bytes] = []

    def handle(uow: Any, message: Any) -> str:
        calls.append(message.value())
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
            {"k": uow.key, "v": message.value().decode()},
        )
        return "applied"

    records = [
        keyed("k1", "order-1", 0),
        keyed("k1", "order-1", 0),  # a true duplicate: same request, replayed
        keyed("k1", "order-2", 0),  # the key reused for another request
        keyed("k2", "order-3", 1),
    ]
    produce(kafka_bootstrap, topic, records)
    running = start(
        outbox, handle, topic,
        fingerprint_func=lambda m: hashlib.sha256(m.value()).hexdigest(),
    )  # fmt: skip
    group = running.runner.config.group
    wait_for(
        lambda: committed(kafka_bootstrap, group, topic) == end_offsets(records),
        30, "offsets of every message committed", interval=0.1,
    )  # fmt: skip
    running.stop()

    assert sorted(calls) == [b"order-1", b"order-3"]
    assert sorted(rows(effects)) == [("k1", "order-1"), ("k2", "order-3")]
    [letter] = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    info = DeadLetterInfo.from_headers(letter.headers())
    assert letter.value() == b"order-2"
    assert (info.reason, info.error_type, info.idempotency_key) == (
        "key-reuse", "KeyReuseError", "k1",
    )  # fmt: skip
    assert (info.partition, info.offset, info.attempts) == (0, 2, 1)
    assert metric(running, "outbox_consumer_replayed_total", topic=topic, status="completed") == 1
    # The first request's outcome stands.
    assert key_status(outbox) == {"k1": "completed", "k2": "completed"}


@pytest.mark.parametrize("permanent_errors", [(), (ValueError,)], ids=["default", "ValueError"])
def test_invalid_input_from_the_handler_is_dead_lettered_at_once_and_rolled_back(
    kafka_bootstrap: str,
    topic: str,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    effects: sa.Engine,
    start: Any,
    permanent_errors: tuple[type[Exception], ...],
) -> None:
    """A publish to an invalid topic name and a result that is not JSON are both refused input:
    dead-lettered on the first attempt as ``invalid-input``, the business row rolled back, the
    key left free (a redrive after the fix applies it).

    With ``permanent_errors=(ValueError,)`` -- ValidationError is a ValueError -- nothing
    changes: the toolkit's own refusals are never the key's failure, so neither the
    InvalidTopicError the handler met nor a result the runner cannot store is dead-lettered as
    ``permanent-error`` or recorded as failed.
    """
    calls: list[str] = []

    def handle(uow: Any, message: Any) -> Any:
        kind = message.value().decode()
        calls.append(uow.key)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"), {"k": uow.key, "v": kind}
        )
        if kind == "bad-topic":
            uow.publish("orders accepted!", {"id": uow.key})  # not a Kafka topic name
        elif kind == "not-json":
            uow.publish("orders.accepted", {"id": uow.key})
            return {"at": datetime.datetime.now(datetime.UTC)}  # json cannot encode a datetime
        else:
            uow.publish("orders.accepted", {"id": uow.key})
        return {"ok": uow.key}

    records = [
        keyed("a", "ok", 0),
        keyed("t1", "bad-topic", 0),
        keyed("j1", "not-json", 0),
        keyed("b", "ok", 0),
        keyed("c", "ok", 1),
    ]
    produce(kafka_bootstrap, topic, records)
    config = OutboxConfig(cache_prefix=redis_prefix, permanent_errors=permanent_errors)
    outbox = Outbox(database_url, redis_url=redis_url, config=config)
    try:
        running = start(outbox, handle, topic, max_attempts=5, retry_backoff=0.02)
        group = running.runner.config.group
        wait_for(
            lambda: committed(kafka_bootstrap, group, topic) == end_offsets(records),
            30, "offsets of every message committed", interval=0.1,
        )  # fmt: skip
        running.stop()
        statuses = key_status(outbox)
        published = outbox_topics(outbox)
    finally:
        outbox.close()

    # One attempt each (retrying cannot fix input), in partition order.
    assert [k for k in calls if k != "c"] == ["a", "t1", "j1", "b"] and calls.count("c") == 1
    assert sorted(rows(effects)) == [("a", "ok"), ("b", "ok"), ("c", "ok")]
    assert published == ["orders.accepted"] * 3  # a's, b's and c's only
    letters = {m.value(): m for m in read_topic(kafka_bootstrap, topic + ".dlq", 2)}
    assert set(letters) == {b"bad-topic", b"not-json"}
    bad_topic = DeadLetterInfo.from_headers(letters[b"bad-topic"].headers())
    not_json = DeadLetterInfo.from_headers(letters[b"not-json"].headers())
    assert (not_json.reason, not_json.error_type, not_json.attempts) == (
        "invalid-input", "SerializationError", 1,
    )  # fmt: skip
    assert "return JSON-compatible data" in not_json.error
    assert "datetime" in not_json.error
    assert "j1" not in statuses
    assert (bad_topic.error_type, bad_topic.attempts) == ("InvalidTopicError", 1)
    assert "invalid topic name 'orders accepted!'" in bad_topic.error
    assert bad_topic.reason == "invalid-input"
    assert "t1" not in statuses
    assert [statuses[k] for k in ("a", "b", "c")] == ["completed"] * 3


def test_healthz_follows_the_poll_loop(
    kafka_bootstrap: str, topic: str, outbox: Outbox, effects: sa.Engine
) -> None:
    """/healthz: 503 before run(), 200 while the loop turns, 503 while one message holds the
    loop longer than max_silence, 200 again once it moves, 503 after stop()."""
    entered, release = threading.Event(), threading.Event()

    def handle(uow: Any, message: Any) -> None:
        if message.value() == b"slow":
            entered.set()
            release.wait(30)
        uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, 'x')"), {"k": uow.key}
        )

    registry = CollectorRegistry()
    runner = ConsumerRunner(
        outbox, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA, metrics_registry=registry,
    )  # fmt: skip
    server = serve_metrics(runner, 0, host="127.0.0.1", max_silence=1.0)

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()

    running: Running | None = None
    try:
        assert get("/healthz") == (503, "unhealthy\n")  # not consuming yet
        running = Running(runner, registry)
        wait_for(lambda: get("/healthz")[0] == 200, 30, "healthy once the loop turns")
        produce(kafka_bootstrap, topic, [keyed("k1", "fast", 0), keyed("k2", "slow", 0)])
        assert entered.wait(30)
        wait_for(lambda: get("/healthz")[0] == 503, 10, "unhealthy while the loop is stuck")
        release.set()
        wait_for(lambda: get("/healthz")[0] == 200, 10, "healthy again once the loop moves")
        wait_for(lambda: len(rows(effects)) == 2, 10, "both messages applied")
        status, text = get("/metrics")
        assert status == 200
        assert f'outbox_consumer_processed_total{{group="{runner.config.group}"' in text
        running.stop()
        assert get("/healthz")[0] == 503  # closed
    finally:
        release.set()
        if running is not None:
            running.runner.stop()
            running.thread.join(30)
        server.close()
