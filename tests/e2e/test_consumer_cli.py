"""`outbox consume` as a user runs it: flags, metrics and health endpoints, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import Producer

from outbox import PermanentError
from outbox.consumer import DeadLetterInfo
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.consumer import committed, read_topic
from tests.fixtures.kafka import create_topic
from tests.fixtures.processes import die_with_parent
from tests.fixtures.redis import PrivateRedis

OUTBOX_BIN = str(Path(sys.executable).with_name("outbox"))
ROOT = Path(__file__).resolve().parents[2]


def handle(uow: Any, message: Any) -> str:
    """Handler loaded by the subprocess as tests.e2e.test_consumer_cli:handle."""
    uow.connection.execute(sa.text("INSERT INTO seen (key) VALUES (:k)"), {"k": uow.key})
    return "ok"


async def handle_async(uow: Any, message: Any) -> str:
    """A coroutine handler: `outbox consume` runs it on the asyncio runner."""
    await uow.connection.execute(sa.text("INSERT INTO seen (key) VALUES (:k)"), {"k": uow.key})
    return "ok"


# The guarded handlers' effects go outside PostgreSQL: to a Redis list named after the topic.
EFFECTS_URL = "GUARD_EFFECTS_REDIS_URL"


def guarded(claim: Any, message: Any) -> dict[str, Any]:
    """A handler for `outbox consume --guard-redis-url`: handler(claim, message)."""
    if message.value() == b"poison":
        raise PermanentError("cannot apply this one")
    client = redis.Redis.from_url(os.environ[EFFECTS_URL])
    try:
        client.rpush(f"effects:{message.topic()}", f"{claim.key}:{claim.fence}")
    finally:
        client.close()
    return {"fence": claim.fence}


async def guarded_async(claim: Any, message: Any) -> dict[str, Any]:
    """The same for the asyncio runner."""
    return guarded(claim, message)


def test_missing_group_is_a_usage_error() -> None:
    result = subprocess.run(
        [OUTBOX_BIN, "consume", "tests.e2e.test_consumer_cli:handle", "--topic", "t",
         "--database-url", "postgresql+psycopg://x@127.0.0.1:1/x",
         "--bootstrap-servers", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "--group is required (or set OUTBOX_CONSUMER_GROUP)" in result.stderr


@pytest.mark.parametrize(
    ("handler", "runner"),
    [("handle", "sync"), ("handle_async", "asyncio")],
    ids=["sync", "asyncio"],
)
def test_consume_serves_metrics_and_exits_0_on_sigterm(
    kafka_bootstrap: str,
    database_url: str,
    engine: sa.Engine,
    tmp_path: Path,
    handler: str,
    runner: str,
) -> None:
    topic = f"cli-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE seen (key text NOT NULL)"))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for key in ("a", "b", "a"):
        producer.produce(topic, value=b"{}", headers=[("X-Idempotency-Key", key.encode())])
    assert producer.flush(30) == 0

    port = free_port()
    log = (tmp_path / "consume.log").open("wb")
    proc = subprocess.Popen(
        [OUTBOX_BIN, "consume", f"tests.e2e.test_consumer_cli:{handler}", "--topic", topic,
         "--group", f"g-{uuid.uuid4().hex[:8]}", "--database-url", database_url,
         "--bootstrap-servers", kafka_bootstrap, "--kafka-config", "session.timeout.ms=2000",
         "--kafka-config", "heartbeat.interval.ms=200",
         "--metrics-port", str(port)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
    )  # fmt: skip
    log.close()

    def scrape(path: str = "/metrics") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return str(resp.read().decode())

    def line(text: str, prefix: str) -> str:
        return next((ln for ln in text.splitlines() if ln.startswith(prefix)), "")

    try:
        wait_for(lambda: line(scrape(), "outbox_consumer_replayed_total").endswith(" 1.0"), 60,
                 "the duplicate shows up in the metrics")  # fmt: skip
        text = scrape()
        assert line(text, "outbox_consumer_processed_total").endswith(" 2.0")
        assert line(text, "outbox_consumer_consumed_total").endswith(" 3.0")
        assert "outbox_consumer_processing_seconds_bucket" in text
        assert scrape("/healthz") == "ok\n"  # the same port answers the health check
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "consume.log").read_text()
        assert f", {runner} runner" in (tmp_path / "consume.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    with engine.connect() as conn:
        assert sorted(conn.execute(sa.text("SELECT key FROM seen")).scalars()) == ["a", "b"]


@pytest.mark.parametrize(
    ("handler", "runner"),
    [("guarded", "sync"), ("guarded_async", "asyncio")],
    ids=["sync", "asyncio"],
)
def test_consume_with_a_guard(
    kafka_bootstrap: str, redis_server: PrivateRedis, tmp_path: Path, handler: str, runner: str
) -> None:
    topic = f"cli-guard-{uuid.uuid4().hex[:10]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for key, value in (("a", b"{}"), ("b", b"{}"), ("a", b"{}"), ("p", b"poison"), ("p", b"{}")):
        producer.produce(topic, value=value, headers=[("X-Idempotency-Key", key.encode())])
    assert producer.flush(30) == 0

    port = free_port()
    log = (tmp_path / "consume.log").open("wb")
    proc = subprocess.Popen(
        [OUTBOX_BIN, "consume", f"tests.e2e.test_consumer_cli:{handler}", "--topic", topic,
         "--group", group, "--guard-redis-url", redis_server.url, "--guard-lease", "5",
         "--bootstrap-servers", kafka_bootstrap, "--kafka-config", "session.timeout.ms=2000",
         "--kafka-config", "heartbeat.interval.ms=200", "--metrics-port", str(port)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
        env={**os.environ, EFFECTS_URL: redis_server.url},
    )  # fmt: skip
    log.close()

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return str(resp.read().decode())

    def value(text: str, prefix: str) -> float:
        line = next((ln for ln in text.splitlines() if ln.startswith(prefix)), "x 0")
        return float(line.rsplit(" ", 1)[1])

    try:
        replayed = f'outbox_consumer_replayed_total{{group="{group}",status='
        seen: list[str] = [""]

        def settled() -> bool:
            seen[0] = text = scrape()
            return (
                value(text, replayed + '"completed"') == 1
                and value(text, "outbox_consumer_dead_lettered_total") == 1
                and value(text, replayed + '"failed"') == 1  # the last message: its key failed
            )

        try:
            wait_for(settled, 60, "the duplicate replayed, the poison dead-lettered, its repeat")
        except TimeoutError:
            raise AssertionError(seen[0]) from None
        text = scrape()
        assert value(text, "outbox_consumer_processed_total") == 2
        assert value(text, "outbox_consumer_consumed_total") == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "consume.log").read_text()
        said = (tmp_path / "consume.log").read_text()
        assert (
            f"guard on redis {redis_server.url} (lease 5s, on_redis_error closed), {runner}" in said
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    client = redis.Redis.from_url(redis_server.url)
    try:
        effects = [e.decode() for e in client.lrange(f"effects:{topic}", 0, -1)]
    finally:
        client.close()
    assert effects == ["a:1", "b:1"]  # one run each, by the first owner
    letters = read_topic(kafka_bootstrap, topic + ".dlq", 1)
    info = DeadLetterInfo.from_headers(letters[0].headers())
    assert (len(letters), info.idempotency_key, info.reason) == (1, "p", "permanent-error")
    assert committed(kafka_bootstrap, group, topic, partitions=1) == [5]
