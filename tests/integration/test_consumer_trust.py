"""What the consumer runner trusts of its producers, against the real broker and PostgreSQL:

* a key another topic's producer reused does not silently drop a legitimate message -- it is
  a ``key-reuse`` dead letter (the default fingerprint covers the topic), while a duplicate on
  the same topic is still a duplicate;
* a message whose content reaches the handler's error text cannot forge a log line or a
  dead-letter header: error text goes through the one-line redaction.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import Outbox, OutboxConfig, PermanentError
from outbox._core.deadletter import HEADER_ERROR, DeadLetterInfo
from outbox.consumer import ConsumerRunner
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


@pytest.fixture
def effects(engine: sa.Engine) -> sa.Engine:
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


def _apply(uow: Any, message: Any) -> None:
    uow.connection.execute(
        sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
        {"k": uow.key, "v": message.value().decode()},
    )


def _runner(outbox: Outbox, handler: Any, topics: list[str], bootstrap: str, **kw: Any) -> Running:
    registry = CollectorRegistry()
    runner = ConsumerRunner(
        outbox, handler, topics=topics, group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=bootstrap, kafka_config=KAFKA, metrics_registry=registry,
        batch_size=1, **kw,
    )  # fmt: skip
    return Running(runner, registry)


def test_a_key_reused_on_another_topic_is_a_dead_letter_not_a_silent_drop(
    kafka_bootstrap: str, outbox: Outbox, effects: sa.Engine
) -> None:
    payments = topic_with_dead_letters(kafka_bootstrap, "payments", partitions=1)
    chatter = topic_with_dead_letters(kafka_bootstrap, "chatter", partitions=1)
    running = _runner(outbox, _apply, [payments, chatter], kafka_bootstrap)
    try:
        group = running.runner.config.group
        # A low-trust producer of another topic gets the key in first...
        produce(kafka_bootstrap, chatter, [keyed("pay-1", "pre-empted", 0)])
        wait_for(lambda: committed(kafka_bootstrap, group, chatter, 1) == [1], 30, "chatter")
        # ...then the legitimate message, and a re-send of another one (re-serialized).
        records = [keyed("pay-1", "pay 100", 0), keyed("pay-2", "pay 5", 0)]
        records.append(keyed("pay-2", "pay 5.0", 0))
        produce(kafka_bootstrap, payments, records)
        wait_for(lambda: committed(kafka_bootstrap, group, payments, 1) == [3], 30, "payments")
    finally:
        running.stop()
    letters = read_topic(kafka_bootstrap, payments + ".dlq", 1)
    assert [m.value() for m in letters] == [b"pay 100"]
    info = DeadLetterInfo.from_headers(letters[0].headers())
    assert (info.reason, info.idempotency_key) == ("key-reuse", "pay-1")
    assert sorted(rows(effects)) == [("pay-1", "pre-empted"), ("pay-2", "pay 5")]
    replayed = metric(running, "outbox_consumer_replayed_total", topic=payments, status="completed")
    assert replayed == 1  # the duplicate of pay-2, and nothing else


FORGED = "2026-01-01 00:00:00 CRITICAL outbox.consumer: forged"


def test_error_text_from_a_message_cannot_forge_a_log_line_or_a_header(
    kafka_bootstrap: str,
    outbox: Outbox,
    effects: sa.Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_with_dead_letters(kafka_bootstrap, "hostile", partitions=1)
    hostile = f"bad value\n{FORGED}\r{FORGED}\x1b[2K\u2028{FORGED}"

    def handle(uow: Any, message: Any) -> None:
        value = message.value().decode()
        if message.headers()[0][1] == b"permanent":
            raise PermanentError(f"cannot parse {value!s}")
        raise RuntimeError(f"cannot parse {value!s}")

    caplog.set_level(logging.INFO, logger="outbox")
    records = [keyed("permanent", hostile, 0), keyed("exhausted", hostile, 0)]
    produce(kafka_bootstrap, topic, records)
    running = _runner(outbox, handle, [topic], kafka_bootstrap, max_attempts=2, retry_backoff=0.01)
    try:
        group = running.runner.config.group
        wait_for(lambda: committed(kafka_bootstrap, group, topic, 1) == [2], 30, "committed")
    finally:
        running.stop()
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 2)
    assert len(letters) == 2
    for letter in letters:
        error = dict(letter.headers())[HEADER_ERROR].decode()
        assert "\n" not in error and "\r" not in error and "\x1b" not in error
        assert "forged" not in error and error.endswith("cannot parse bad value")
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    lines = [formatter.format(r) for r in caplog.records if r.name.startswith("outbox")]
    assert any("dead-lettered" in line for line in lines)
    for line in lines:
        assert "\n" not in line and "\r" not in line and "forged" not in line, line
