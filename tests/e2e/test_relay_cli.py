"""``outbox-relay`` and ``outbox parked`` as a user runs them: subprocesses, real services."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
import uuid

import sqlalchemy as sa

from outbox import migrate
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.relay import (
    REPO,
    assert_delivered,
    insert_rows,
    outbox_count,
    relay_command,
    start_relay,
    wait_for_records,
)


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout)


def _with_password(url: str, password: str) -> str:
    # Local PostgreSQL trusts loopback connections, so any password works -- and must not leak.
    return url.replace("postgres@", f"postgres:{password}@", 1)


def test_check_passes_on_a_migrated_database_and_live_broker(
    database_url: str, kafka_bootstrap: str
) -> None:
    url = _with_password(database_url, "s3cr3t-pw")
    done = _run(relay_command(url, kafka_bootstrap, "--check"))
    assert done.returncode == 0, done.stderr
    assert "check passed" in done.stdout
    assert "s3cr3t-pw" not in done.stdout + done.stderr


def test_check_fails_clearly_on_unmigrated_schema_and_dead_broker(database_url: str) -> None:
    migrate.downgrade(database_url, "base")
    dead = f"127.0.0.1:{free_port()}"
    url = _with_password(database_url, "s3cr3t-pw")
    done = _run(relay_command(url, dead, "--check", "--kafka-config", "socket.timeout.ms=1000"))
    assert done.returncode == 1
    assert "outbox migrate" in done.stderr
    assert "did not answer" in done.stderr and dead in done.stderr
    assert "s3cr3t-pw" not in done.stdout + done.stderr


def test_missing_flags_name_the_environment_variable() -> None:
    done = _run([sys.executable, "-m", "outbox.cli.relay"])
    assert done.returncode == 2
    assert "OUTBOX_DATABASE_URL" in done.stderr


def test_once_drains_and_a_plain_consumer_reads_records_and_headers(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"relay-e2e-{uuid.uuid4().hex[:8]}"
    ids = insert_rows(
        engine, topic, [(f"k{i % 7}", f"v{i}".encode()) for i in range(300)], {"source": "e2e"}
    )
    done = _run(relay_command(database_url, kafka_bootstrap, "--once", "--batch-size", "64"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "event=relay_stopped confirmed=300" in done.stderr
    assert outbox_count(engine) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    assert len(records) == 300
    assert {r.headers["source"] for r in records} == {b"e2e"}
    assert_delivered(records, ids)


def test_sigterm_stops_a_running_relay_with_exit_0_and_metrics_are_served(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    port = free_port()
    proc = start_relay(database_url, kafka_bootstrap, "--metrics-port", str(port))
    try:

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, ""

        wait_for(lambda: get("/healthz")[0] == 200, 30, "relay never became healthy")
        topic = f"relay-metrics-{uuid.uuid4().hex[:8]}"
        ids = insert_rows(engine, topic, [("m", b"1"), ("m", b"2")])
        wait_for_records(kafka_bootstrap, topic, ids)

        def published() -> bool:
            body = get("/metrics")[1]
            return "outbox_relay_published_total 2.0" in body

        wait_for(published, 20, "metrics never showed 2 published records")
        body = get("/metrics")[1]
        for name in (
            "outbox_relay_lanes_owned 32.0",
            "outbox_relay_backlog_rows",
            "outbox_relay_oldest_pending_age_seconds",
            "outbox_relay_batch_duration_seconds_bucket",
            "outbox_relay_parked_total",
        ):
            assert name in body, name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "event=stop_requested signal=SIGTERM" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_parked_list_retry_discard(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"relay-parked-{uuid.uuid4().hex[:8]}"
    ids = insert_rows(engine, topic, [("p", b"x" * 5000), ("p", b"after"), ("q", b"y" * 5000)])
    small = ["--kafka-config", "message.max.bytes=2000"]
    assert _run(relay_command(database_url, kafka_bootstrap, "--once", *small)).returncode == 0
    outbox = [sys.executable, "-m", "outbox.cli", "parked"]
    listed = _run([*outbox, "list", "--database-url", database_url])
    assert listed.returncode == 0, listed.stderr
    for event_id in (ids[0], ids[2]):
        assert str(event_id) in listed.stdout
    assert topic[:24] in listed.stdout and "MSG_SIZE_TOO_LARGE" in listed.stdout
    as_json = json.loads(_run([*outbox, "list", "--json", "--database-url", database_url]).stdout)
    assert [row["key"] for row in as_json] == ["p", "q"]

    refused = _run([*outbox, "retry", "--database-url", database_url])
    assert refused.returncode == 2 and "--event-id" in refused.stderr
    retried = _run([*outbox, "retry", "--event-id", str(ids[2]), "--database-url", database_url])
    assert retried.returncode == 0 and "1 parked row back in line" in retried.stdout
    assert outbox_count(engine, parked=True) == 1
    discarded = _run(
        [*outbox, "discard", "--all", "--topic", topic, "--database-url", database_url]
    )
    assert discarded.returncode == 0 and "1 parked row discarded" in discarded.stdout
    # With the parked head gone, "after" flows; the retried row goes out with a bigger limit.
    assert _run(relay_command(database_url, kafka_bootstrap, "--once")).returncode == 0
    wait_for_records(kafka_bootstrap, topic, [ids[1], ids[2]])
    assert outbox_count(engine) == 0
