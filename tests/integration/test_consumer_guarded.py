"""The consumer runner under the Redis guard, against a real redis-server and a Kafka-protocol
broker, in both flavours (``ConsumerRunner(RedisGuard, ...)``, ``AsyncConsumerRunner(
AsyncRedisGuard, ...)``): no PostgreSQL anywhere.

Each handler's effects are kept in the test process (outside PostgreSQL, as the guard is for),
so a second run of a handler shows up as a second entry. Checked: duplicates replayed without
the handler, permanent failures dead-lettered once (later duplicates only acknowledged),
transient failures retried in order, a key held by another owner retried (never waited on) and
then replayed, a message without a key dead-lettered, and a Redis that stops: under
``on_redis_error="closed"`` the message waits (offset not committed, attempts not counted) and
runs once Redis is back; under ``"open"`` it runs unguarded.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from outbox import PermanentError
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, DeadLetterInfo
from outbox.errors import PreviouslyFailed
from outbox.guard import AsyncRedisGuard, RedisGuard
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
from tests.fixtures.guard import new_prefix
from tests.fixtures.redis import PrivateRedis


class Boom(Exception):
    """A transient failure raised by test handlers."""


class Unfit(Exception):
    """A failure the guard is told is permanent (``permanent_errors``)."""


@dataclass
class Effects:
    """What the handlers did, in order: (key, value, fence), kept outside PostgreSQL."""

    done: list[tuple[str, str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, claim: Any, message: Any) -> str:
        value = message.value().decode()
        with self.lock:
            self.done.append((claim.key, value, claim.fence))
        return value

    def applied(self) -> list[str]:
        with self.lock:
            return [k for k, _, _ in self.done]


@dataclass
class Guarded:
    """A running guarded consumer, and a sync guard on the same records to look at them."""

    running: Running
    inspect: RedisGuard

    @property
    def group(self) -> str:
        return self.running.runner.config.group


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    return topic_with_dead_letters(kafka_bootstrap, "guarded")


@pytest.fixture(params=["sync", "asyncio"])
def start(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Guarded]]:
    """``start(redis_url, handler, topic, guard={...}, **runner_options)``: a guarded runner on a
    thread; ``handler(claim, message)`` is a plain function, wrapped in a coroutine function for
    the asyncio runner."""
    flavour = request.param
    made: list[Guarded] = []
    sync_guards: list[RedisGuard] = []

    def make(redis_url: str, handler: Callable[..., Any], topic: str, **options: Any) -> Guarded:
        settings = {"prefix": new_prefix(), **options.pop("guard", {})}
        options.setdefault("group", f"g-{uuid.uuid4().hex[:8]}")
        registry = options.setdefault("metrics_registry", CollectorRegistry())
        common = {"topics": [topic], "bootstrap_servers": kafka_bootstrap, "kafka_config": KAFKA}
        runner: ConsumerRunner | AsyncConsumerRunner
        if flavour == "sync":
            guard = RedisGuard(redis_url, **settings)
            sync_guards.append(guard)
            runner = ConsumerRunner(guard, handler, **common, **options)
        else:

            async def handle(claim: Any, message: Any) -> Any:
                return handler(claim, message)

            runner = AsyncConsumerRunner(
                AsyncRedisGuard(redis_url, **settings), handle, **common, **options
            )
        inspect = RedisGuard(redis_url, prefix=settings["prefix"])
        sync_guards.append(inspect)
        made.append(Guarded(Running(runner, registry), inspect))
        return made[-1]

    try:
        yield make
    finally:
        for g in made:
            g.running.runner.stop()
        for g in made:
            g.running.thread.join(30)
        for guard in sync_guards:
            guard.close()


def end_offsets(records: list[dict[str, Any]], partitions: int = 2) -> list[int]:
    """Offsets after the last of ``records`` (produced to explicit partitions of a new topic)."""
    return [sum(1 for r in records if r["partition"] == p) for p in range(partitions)]


def all_committed(kafka_bootstrap: str, g: Guarded, topic: str, want: list[int]) -> None:
    wait_for(
        lambda: committed(kafka_bootstrap, g.group, topic) == want,
        30, f"offsets {want} committed", interval=0.1,
    )  # fmt: skip


def test_duplicates_are_replayed_without_the_handler(
    kafka_bootstrap: str, topic: str, redis_server: PrivateRedis, start: Any
) -> None:
    effects = Effects()

    def handle(claim: Any, message: Any) -> dict[str, Any]:
        return {"seen": effects.add(claim, message), "fence": claim.fence}

    records = [keyed(f"k{i}", f"v{i}", partition=i % 2) for i in range(20)]
    # The same keys again, on the other partition: duplicates that race their originals.
    records += [keyed(f"k{i}", f"dup{i}", partition=(i + 1) % 2) for i in range(0, 20, 4)]
    produce(kafka_bootstrap, topic, records)
    g = start(redis_server.url, handle, topic)
    all_committed(kafka_bootstrap, g, topic, end_offsets(records))
    g.running.stop()

    assert sorted(effects.applied()) == sorted(f"k{i}" for i in range(20))  # once each
    assert {fence for _, _, fence in effects.done} == {1}
    assert metric(g.running, "outbox_consumer_replayed_total", topic=topic, status="completed") == 5
    # The guard keeps its outcomes in Redis: Redis answered every duplicate.
    assert metric(g.running, "outbox_consumer_replayed_from_total", topic=topic, store="redis") == 5
    assert metric(g.running, "outbox_consumer_processed_total", topic=topic) == 20
    # The handler's return value is the claim's stored result, in the runner's scope.
    seen = {key: value for key, value, _ in effects.done}
    with g.inspect.claim("k4", scope=g.group) as claim:
        assert claim.replayed
        assert claim.result == {"seen": seen["k4"], "fence": 1}


def test_dead_letters_once_and_failed_keys_are_only_acknowledged(
    kafka_bootstrap: str, topic: str, redis_server: PrivateRedis, start: Any
) -> None:
    effects = Effects()

    def handle(claim: Any, message: Any) -> str:
        value = message.value().decode()
        if value.startswith("poison"):
            raise PermanentError(f"cannot apply {value}")
        if value.startswith("unfit"):
            raise Unfit(value)
        if value.startswith("flaky"):
            raise Boom("always down")
        return effects.add(claim, message)

    records = [
        keyed("a", "ok-a", 0),
        keyed("p1", "poison-1", 0),
        keyed(None, "keyless", 0),
        keyed("f1", "flaky-1", 1),
        keyed("u1", "unfit-1", 1),
        keyed("p1", "poison-1-again", 1),  # a duplicate of a failed key: no second dead letter
        keyed("u1", "unfit-1-again", 0),
        keyed("b", "ok-b", 1),
    ]
    produce(kafka_bootstrap, topic, records)
    g = start(
        redis_server.url, handle, topic, guard={"permanent_errors": (Unfit,)},
        max_attempts=3, retry_backoff=0.02,
    )  # fmt: skip
    all_committed(kafka_bootstrap, g, topic, end_offsets(records))
    g.running.stop()

    letters = read_topic(kafka_bootstrap, topic + ".dlq", 4)
    infos = {(i.idempotency_key, i.reason, i.error_type) for i in
             (DeadLetterInfo.from_headers(m.headers()) for m in letters)}  # fmt: skip
    assert len(letters) == 4
    assert infos == {
        ("p1", "permanent-error", "PermanentError"),
        ("u1", "permanent-error", "Unfit"),
        (None, "missing-key", "MissingIdempotencyKey"),
        ("f1", "retries-exhausted", "Boom"),
    }
    assert sorted(effects.applied()) == ["a", "b"]
    replayed_failed = metric(
        g.running, "outbox_consumer_replayed_total", topic=topic, status="failed"
    )
    assert replayed_failed == 2
    # The permanent failures are recorded in the guard; the exhausted key stays free, so a
    # redrive of its dead letter runs it.
    for key in ("p1", "u1"):
        with pytest.raises(PreviouslyFailed), g.inspect.claim(key, scope=g.group):
            pass
    with g.inspect.claim("f1", scope=g.group) as claim:
        assert not claim.replayed and claim.fence > 1  # released by each failed attempt


def test_transient_failures_retry_the_same_message_in_order(
    kafka_bootstrap: str, topic: str, redis_server: PrivateRedis, start: Any
) -> None:
    effects = Effects()
    failures = {"k1": 2}
    tried: list[str] = []

    def handle(claim: Any, message: Any) -> str:
        tried.append(claim.key)
        if failures.get(claim.key, 0) > 0:
            failures[claim.key] -= 1
            raise Boom(f"{claim.key} not yet")
        return effects.add(claim, message)

    records = [keyed("k1", "one", 0), keyed("k2", "two", 0), keyed("k3", "three", 0),
               keyed("j1", "other", 1)]  # fmt: skip
    produce(kafka_bootstrap, topic, records)
    g = start(redis_server.url, handle, topic, retry_backoff=0.02)
    all_committed(kafka_bootstrap, g, topic, end_offsets(records))
    g.running.stop()

    assert tried.count("k1") == 3
    assert [k for k in effects.applied() if k.startswith("k")] == ["k1", "k2", "k3"]
    assert sorted(effects.applied()) == ["j1", "k1", "k2", "k3"]
    # The key was released after each failure: the successful run is its third owner.
    assert [fence for key, _, fence in effects.done if key == "k1"] == [3]
    assert metric(g.running, "outbox_consumer_failed_total", topic=topic, kind="error") == 2


def test_a_key_held_elsewhere_is_retried_then_replayed(
    kafka_bootstrap: str, topic: str, redis_server: PrivateRedis, start: Any
) -> None:
    effects = Effects()
    records = [keyed("busy", "held", 0), keyed("after", "behind it", 0), keyed("free", "x", 1)]
    group = f"g-{uuid.uuid4().hex[:8]}"
    prefix = new_prefix()
    owner = RedisGuard(redis_server.url, prefix=prefix, lease=60)
    try:
        with owner.claim("busy", scope=group) as held:
            produce(kafka_bootstrap, topic, records)
            g = start(redis_server.url, effects.add, topic, group=group,
                      guard={"prefix": prefix}, in_progress_backoff=0.02,
                      in_progress_backoff_max=0.1)  # fmt: skip

            def retried() -> bool:
                kind = "key_in_progress"
                return metric(g.running, "outbox_consumer_failed_total", topic=topic,
                              kind=kind) >= 3  # fmt: skip

            wait_for(retried, 30, "the busy key retried while the runner goes on")
            wait_for(lambda: "free" in effects.applied(), 30, "the other partition flows")
            # Nothing passed the held message: its partition waits, its offset stays.
            assert effects.applied() == ["free"]
            assert committed(kafka_bootstrap, group, topic)[0] < 1
            held.result = {"by": "another owner"}
        all_committed(kafka_bootstrap, g, topic, end_offsets(records))
    finally:
        owner.close()
    g.running.stop()
    assert sorted(effects.applied()) == ["after", "free"]  # "busy" was replayed, not run
    assert metric(g.running, "outbox_consumer_replayed_total", topic=topic, status="completed") == 1


@pytest.mark.parametrize("policy", ["closed", "open"])
def test_redis_stopped(
    kafka_bootstrap: str, topic: str, private_redis: Callable[..., PrivateRedis], start: Any,
    policy: str,
) -> None:  # fmt: skip
    effects = Effects()
    server = private_redis()
    first = [keyed("k1", "before", 0)]
    produce(kafka_bootstrap, topic, first)
    # One attempt only: a Redis outage that counted as an attempt would dead-letter at once.
    g = start(
        server.url, effects.add, topic, guard={"on_redis_error": policy},
        max_attempts=1, retry_backoff=0.05, retry_backoff_max=0.3,
    )  # fmt: skip
    all_committed(kafka_bootstrap, g, topic, [1, -1001])

    server.shutdown()
    produce(kafka_bootstrap, topic, [keyed("k2", "while down", 0)])
    if policy == "closed":
        wait_for(
            lambda: metric(g.running, "outbox_consumer_failed_total", topic=topic,
                           kind="guard_unavailable") >= 3,
            30, "the message retried while Redis is down",
        )  # fmt: skip
        assert effects.applied() == ["k1"]  # not run
        assert committed(kafka_bootstrap, g.group, topic)[0] == 1  # and not acknowledged
        server.start()  # an empty Redis on the same port (nothing was persisted)
    all_committed(kafka_bootstrap, g, topic, [2, -1001])
    g.running.stop()
    assert effects.applied() == ["k1", "k2"]
    assert metric(g.running, "outbox_consumer_dead_lettered_total", topic=topic,
                  reason="retries-exhausted") == 0  # fmt: skip
    if policy == "open":  # run without the guard: no claim, so no fence
        assert effects.done[1][2] == 0
