"""Key-ordered concurrency inside a partition (``concurrency=N``), against real PostgreSQL, Redis
and a Kafka-protocol broker.

A partition's messages of different Kafka keys run at the same time, each in a unit of work of
its own; those of one key run in offset order, and a message that must be tried again holds up
only its key's later messages. The committed offset of a partition is the watermark below which
every message is finished: it never passes a message still being retried, however many messages
behind it are done.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import AsyncOutbox, Outbox, OutboxConfig
from outbox.config import ConsumerConfig
from outbox.consumer import batch_handler
from outbox.errors import ConfigurationError
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import committed, produce, topic_with_dead_letters
from tests.integration import test_consumer_batches as batches

effects = batches.effects
outbox = batches.outbox
start = batches.start
INSERT, Boom = batches.INSERT, batches.Boom

KEYS = "abcdef"  # Kafka message keys; message i has key KEYS[i % 6] and goes to partition i % 2
COUNT = 120
STUCK = 15  # a message of key "d" in partition 1, at offset 7: failing until released


def record(i: int) -> dict[str, Any]:
    return {
        "key": KEYS[i % len(KEYS)].encode(),
        "value": str(i).encode(),
        "headers": [("X-Idempotency-Key", f"m{i}".encode())],
        "partition": i % 2,
    }


class Lanes:
    """What a test handler saw: messages in flight at once, and each message's calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0
        self.calls: Counter[int] = Counter()
        self.release = threading.Event()

    def enter(self, i: int) -> None:
        with self.lock:
            self.calls[i] += 1
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        if i == STUCK and not self.release.is_set():
            with self.lock:
                self.in_flight -= 1
            raise Boom("not yet")

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_keys_run_concurrently_in_order_and_offsets_stop_at_the_first_unfinished(
    kafka_bootstrap: str,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    effects: sa.Engine,
    start: Any,
    flavour: str,
) -> None:
    name = topic_with_dead_letters(kafka_bootstrap, "lanes")
    seen = Lanes()

    def handle(uow: Any, message: Any) -> None:
        i = int(message.value())
        seen.enter(i)
        try:
            time.sleep(0.005)  # waits on I/O: the other keys run meanwhile
            uow.connection.execute(INSERT, {"k": uow.key, "v": f"{message.key().decode()}:{i}"})
        finally:
            seen.leave()

    async def handle_async(uow: Any, message: Any) -> None:
        i = int(message.value())
        seen.enter(i)
        try:
            await asyncio.sleep(0.005)
            await uow.connection.execute(
                INSERT, {"k": uow.key, "v": f"{message.key().decode()}:{i}"}
            )
        finally:
            seen.leave()

    produce(kafka_bootstrap, name, [record(i) for i in range(COUNT)])
    config = OutboxConfig(cache_prefix=redis_prefix)
    store: Any
    if flavour == "sync":
        store, handler = Outbox(database_url, redis_url=redis_url, config=config), handle
    else:  # closed in its runner's loop
        store, handler = AsyncOutbox(database_url, redis_url=redis_url, config=config), handle_async
    try:
        running = start(
            store, handler, name, concurrency=8, max_attempts=1000,
            retry_backoff=0.02, retry_backoff_max=0.05, commit_interval=0.05,
        )  # fmt: skip
        group = running.runner.config.group

        def later_done_but_held() -> bool:
            with effects.connect() as conn:
                done = {int(v.split(":")[1]) for v in conn.execute(
                    sa.text("SELECT value FROM effects")).scalars()}  # fmt: skip
            # Messages of other keys behind the stuck one in its partition finished, and the
            # partition's committed offset waits at the stuck message (offset 7).
            behind = [i for i in done if i % 2 == 1 and i > STUCK and i % 6 != STUCK % 6]
            return bool(behind) and committed(kafka_bootstrap, group, name)[1] == STUCK // 2

        wait_for(later_done_but_held, 30, "later keys done, the offset held at the stuck one")
        with effects.connect() as conn:
            stuck_key = {int(v.split(":")[1]) for v in conn.execute(
                sa.text("SELECT value FROM effects WHERE value LIKE 'd:%'")).scalars()}  # fmt: skip
        assert all(i < STUCK for i in stuck_key)  # its key's later messages waited for it
        seen.release.set()
        wait_for(lambda: committed(kafka_bootstrap, group, name) == [COUNT // 2] * 2, 30,
                 "every offset committed", interval=0.05)  # fmt: skip
        running.stop()
    finally:
        if flavour == "sync":
            store.close()

    with effects.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, value FROM effects ORDER BY seq")).all()
    assert sorted(k for k, _ in rows) == sorted(f"m{i}" for i in range(COUNT))  # each once
    for key in KEYS:
        order = [int(v.split(":")[1]) for _, v in rows if v.startswith(f"{key}:")]
        assert order == sorted(order), f"key {key} out of order: {order}"
    assert seen.most > 1  # messages did run at the same time
    assert seen.calls[STUCK] > 1


def test_concurrency_takes_no_batch_handler_and_a_bad_value_is_refused(outbox: Outbox) -> None:
    @batch_handler
    def handle(batch: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"^concurrency=4 runs each message in a unit"):
        batches_runner(outbox, handle, concurrency=4)
    for bad in (0, -1, 257, True, 1.5, "4"):
        with pytest.raises(ConfigurationError, match="concurrency"):
            ConsumerConfig(
                topics=("t",), group="g", bootstrap_servers="127.0.0.1:9092", concurrency=bad
            ).validate()


def batches_runner(outbox: Outbox, handler: Any, **options: Any) -> Any:
    from outbox.consumer import ConsumerRunner

    return ConsumerRunner(outbox, handler, topics=["t"], group="g",
                          bootstrap_servers="127.0.0.1:9092", **options)  # fmt: skip
