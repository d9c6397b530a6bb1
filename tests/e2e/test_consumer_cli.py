"""`outbox consume` as a user runs it: flags, metrics and health endpoints, SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer

from tests.fixtures.common import free_port, wait_for
from tests.fixtures.kafka import create_topic
from tests.fixtures.processes import die_with_parent

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
