"""Helpers shared by the relay's integration, end-to-end and fault tests (and a check of them).

Rows are inserted with SQLAlchemy Core exactly as the unit of work stores them, so large
backlogs (tens of thousands of rows) are built in a second; the records are read back with a
plain confluent-kafka consumer that assigns every partition and reads to the high watermark, so
duplicates are seen too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox._core import codec as _codec
from outbox.relay import Relay, RelayConfig
from outbox.schema import tables

REPO = Path(__file__).resolve().parents[2]


def insert_rows(
    engine: sa.Engine,
    topic: str,
    items: Iterable[tuple[str | bytes | None, bytes]],
    headers: dict[str, str | bytes] | None = None,
) -> list[uuid.UUID]:
    """Insert outbox rows (key, value) in one transaction, in order; returns their event ids."""
    table = tables(None).outbox
    stored = _codec.encode_headers(headers or {})
    rows: list[dict[str, Any]] = []
    for key, value in items:
        event_id = uuid.uuid4()
        key_bytes = key.encode() if isinstance(key, str) else key
        rows.append(
            {
                "event_id": event_id,
                "topic": topic,
                "key": key_bytes,
                "value": value,
                "headers": stored,
                "key_hash": _codec.key_hash(key_bytes, event_id.bytes),
            }
        )
    with engine.begin() as conn:
        for start in range(0, len(rows), 5000):
            conn.execute(sa.insert(table), rows[start : start + 5000])
    return [r["event_id"] for r in rows]


def outbox_count(engine: sa.Engine, parked: bool | None = None) -> int:
    where = ""
    if parked is True:
        where = " WHERE parked_at IS NOT NULL"
    elif parked is False:
        where = " WHERE parked_at IS NULL"
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM outbox{where}")).scalar_one())


@dataclass(frozen=True)
class Received:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]

    @property
    def event_id(self) -> str:
        return self.headers[_codec.IDEMPOTENCY_HEADER].decode()


def read_topic(bootstrap: str, topic: str, timeout: float = 30.0) -> list[Received]:
    """Every record of ``topic`` (all partitions, from the start to the current end)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"relay-test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 50,
        }
    )
    out: list[Received] = []
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        ends: dict[int, int] = {}
        for p in partitions:
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        positions = {p: 0 for p in partitions}
        deadline = time.monotonic() + timeout
        while any(positions[p] < ends[p] for p in partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"read {len(out)} records of {topic!r}; ends {ends}")
            for msg in consumer.consume(num_messages=5000, timeout=0.5):
                if msg.error() is not None:
                    raise RuntimeError(str(msg.error()))
                positions[msg.partition()] = msg.offset() + 1
                out.append(
                    Received(
                        msg.topic(),
                        msg.partition(),
                        msg.offset(),
                        msg.key(),
                        msg.value(),
                        {k: bytes(v) for k, v in (msg.headers() or [])},
                    )
                )
    finally:
        consumer.close()
    out.sort(key=lambda r: (r.partition, r.offset))
    return out


def wait_for_records(
    bootstrap: str, topic: str, event_ids: Iterable[uuid.UUID | str], timeout: float = 30.0
) -> list[Received]:
    """Poll the topic until every event id arrived; returns everything read."""
    wanted = {str(e) for e in event_ids}
    deadline = time.monotonic() + timeout
    while True:
        records = read_topic(bootstrap, topic)
        if wanted <= {r.event_id for r in records}:
            return records
        if time.monotonic() > deadline:
            missing = wanted - {r.event_id for r in records}
            raise TimeoutError(f"{len(missing)} of {len(wanted)} events never reached {topic!r}")
        time.sleep(0.2)


def check_key_order(records: Sequence[Received], committed: dict[bytes, list[str]]) -> None:
    """Per-key order: for every key, the first occurrences of its event ids appear in commit
    order (and every committed event appears)."""
    seen: set[str] = set()
    firsts: dict[bytes, list[str]] = {}
    for r in records:  # sorted by (partition, offset); one key lives in one partition
        if r.event_id in seen or r.key is None:
            continue
        seen.add(r.event_id)
        firsts.setdefault(r.key, []).append(r.event_id)
    for key, ids in committed.items():
        assert firsts.get(key) == ids, f"key {key!r}: order or content differs from commit order"


class RelayThread:
    """An in-process relay on a thread (integration tests; the CLI tests use processes)."""

    def __init__(self, config: RelayConfig) -> None:
        self.relay = Relay(config)
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.exit_code = self.relay.run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> RelayThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.relay.stop()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "relay did not stop"
        if self.error is not None:
            raise self.error


def relay_command(database_url: str, bootstrap: str, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "outbox.cli.relay",
        "--database-url", database_url, "--bootstrap-servers", bootstrap, *args,
    ]  # fmt: skip


def start_relay(
    database_url: str, bootstrap: str, *args: str, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """``python -m outbox.cli.relay`` as a subprocess, output to ``log_path`` (or a pipe)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    out: Any = log_path.open("ab") if log_path is not None else subprocess.PIPE
    return subprocess.Popen(
        relay_command(database_url, bootstrap, *args),
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )


def relay_pids(engine: sa.Engine) -> list[int]:
    """Backend pids of live relays' sessions (application_name outbox-relay) on this database."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay' "
                "AND datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
        return [int(r.pid) for r in rows]


def test_helpers_round_trip(engine: sa.Engine, kafka_bootstrap: str) -> None:
    """The helpers themselves: rows inserted here are what the relay and reader agree on."""
    topic = f"relay-support-{uuid.uuid4().hex[:8]}"
    ids = insert_rows(engine, topic, [("k", b"v1"), ("k", b"v2"), (None, b"v3")])
    assert outbox_count(engine) == 3
    config = RelayConfig(engine.url.render_as_string(hide_password=False), kafka_bootstrap)
    assert Relay(config).run(once=True) == 0
    assert outbox_count(engine) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    assert sorted(r.value for r in records) == [b"v1", b"v2", b"v3"]
    check_key_order(records, {b"k": [str(ids[0]), str(ids[1])]})
