"""``outbox_consumer_replayed_from_total{store}`` read from a runner's ``/metrics`` over HTTP:
a duplicate the Redis fast path answers counts as ``redis``, one whose stored result only the
claim's row in PostgreSQL holds (the cache emptied) as ``postgres``; alone and in batches."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from outbox import Outbox, OutboxConfig
from outbox.consumer import ConsumerRunner, serve_metrics
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    produce,
    topic_with_dead_letters,
)
from tests.fixtures.redis import delete_keys_matching


@pytest.fixture
def outbox(database_url: str, redis_url: str, redis_prefix: str) -> Iterator[Outbox]:
    ob = Outbox(database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix))
    try:
        yield ob
    finally:
        ob.close()


def answered(port: int, topic: str) -> dict[str, float]:
    """``store -> count`` of the runner's replayed-from counter, from its /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.labels["store"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "outbox_consumer_replayed_from"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("topic") == topic
    }


@pytest.mark.parametrize("batch_size", [1, 500], ids=["alone", "batches"])
def test_duplicates_are_counted_by_who_answered_them(
    kafka_bootstrap: str, outbox: Outbox, redis_url: str, redis_prefix: str, batch_size: int
) -> None:
    calls: list[str] = []

    def handle(uow: Any, message: Any) -> dict[str, str]:
        calls.append(message.value().decode())
        return {"seen": uow.key}

    topic = topic_with_dead_letters(kafka_bootstrap, "replays")
    group = f"g-{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    runner = ConsumerRunner(
        outbox, handle, topics=[topic], group=group, bootstrap_servers=kafka_bootstrap,
        kafka_config=KAFKA, metrics_registry=registry, batch_size=batch_size,
    )  # fmt: skip
    server = serve_metrics(runner, 0, host="127.0.0.1")
    running = Running(runner, registry)
    try:

        def through(offset: int) -> None:
            wait_for(
                lambda: committed(kafka_bootstrap, group, topic)[0] == offset,
                30, f"offsets committed through {offset}",
            )  # fmt: skip

        produce(kafka_bootstrap, topic, [keyed("order-1", "first", 0)])
        through(1)  # committed; a batch caches its result after the commit
        warm = 0
        if batch_size == 1:
            # A message alone is an owned unit of work, which leaves Redis to the key's first
            # duplicate: PostgreSQL answers it and caches the result.
            produce(kafka_bootstrap, topic, [keyed("order-1", "warming", 0)])
            through(2)
            warm = 1
        produce(kafka_bootstrap, topic, [keyed("order-1", "again", 0)])
        through(2 + warm)
        assert answered(server.port, topic) == {"redis": 1, "postgres": warm}
        # The cache emptied: only the key's row can answer the next duplicate.
        assert delete_keys_matching(redis_url, f"*{redis_prefix}*") > 0
        produce(kafka_bootstrap, topic, [keyed("order-1", "once more", 0)])
        through(3 + warm)
        assert answered(server.port, topic) == {"redis": 1, "postgres": 1 + warm}
    finally:
        running.stop()
        server.close()
    assert calls == ["first"]
    sample = registry.get_sample_value(
        "outbox_consumer_replayed_total", {"group": group, "topic": topic, "status": "completed"}
    )
    assert sample == 2 + (batch_size == 1)
