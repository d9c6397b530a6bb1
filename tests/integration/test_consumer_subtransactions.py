"""The consumer's micro-batches stay below PostgreSQL's cache of subtransactions.

Each message of a micro-batch runs in a savepoint; a released savepoint that wrote keeps its
subtransaction id until the commit, and a backend caches 64. Past that, every snapshot that meets
the transaction's rows reads ``pg_subtrans`` (``pg_stat_slru``, name ``Subtrans``): the cliff
that slows every session of the server. The test runs on a cluster of its own, so that only its
own reads are counted, with a session that commits and scans the business table after every
message -- the one that would pay for an overflowed transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import Outbox, migrate
from outbox.consumer import ConsumerRunner
from outbox.uow._batch import MAX_SAVEPOINTS
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import (
    KAFKA,
    Running,
    committed,
    keyed,
    produce,
    topic_with_dead_letters,
)
from tests.fixtures.pg_cluster import Clusters

MESSAGES = 400


@pytest.fixture
def private_url(clusters: Clusters) -> str:
    port = clusters.start(clusters.initdb("subtrans"))
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    migrate.upgrade(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL)"))
        conn.execute(sa.text("CREATE TABLE ticks (n serial)"))
    engine.dispose()
    return url


@pytest.fixture
def reader(private_url: str) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(sa.make_url(private_url).set(drivername="postgresql").render_as_string(),
                           autocommit=True)  # fmt: skip
    conn.execute("SET stats_fetch_consistency = none")
    try:
        yield conn
    finally:
        conn.close()


def subtrans_reads(conn: psycopg.Connection[Any]) -> int:
    """The cluster's pg_subtrans page reads so far (hits and misses), this session's included."""
    # Pending counts are flushed when a session goes idle after this call.
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(
        "SELECT blks_hit + blks_read FROM pg_stat_slru WHERE name = 'Subtrans'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def consume_all(
    kafka_bootstrap: str, url: str, reader: psycopg.Connection[Any], **options: Any
) -> int:
    """Run a per-message consumer over MESSAGES messages (all of them there before it starts,
    so that its first micro-batch is long) while another session commits and scans after every
    message; the pg_subtrans reads it cost."""
    topic = topic_with_dead_letters(kafka_bootstrap, "subtrans", partitions=1)
    produce(kafka_bootstrap, topic, [keyed(f"k{i}", "x", 0) for i in range(MESSAGES)])
    insert = sa.text("INSERT INTO effects (key) VALUES (:k)")
    seen: list[int] = []

    def handle(uow: Any, message: Any) -> None:
        uow.connection.execute(insert, {"k": uow.key})
        # Another session commits work of its own (so that the micro-batch's subtransaction
        # ids fall inside its snapshots), then meets the micro-batch's uncommitted rows: with
        # more than 64 subtransactions in the batch, each row is looked up in pg_subtrans.
        reader.execute("INSERT INTO ticks DEFAULT VALUES")
        row = reader.execute("SELECT count(*) FROM effects").fetchone()
        assert row is not None
        seen.append(int(row[0]))

    before = subtrans_reads(reader)
    outbox = Outbox(url)
    registry = CollectorRegistry()
    runner = ConsumerRunner(
        outbox, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA, batch_size=500,
        metrics_registry=registry, **options,
    )  # fmt: skip
    running = Running(runner, registry)
    try:
        wait_for(lambda: committed(kafka_bootstrap, runner.config.group, topic, 1) == [MESSAGES],
                 60, f"{MESSAGES} offsets committed", interval=0.1)  # fmt: skip
    finally:
        running.stop()
        outbox.close()
    assert len(seen) == MESSAGES
    with psycopg.connect(reader.info.dsn, autocommit=True) as conn:
        keys = conn.execute("SELECT count(*), count(DISTINCT key) FROM effects").fetchone()
        conn.execute("TRUNCATE effects")
    assert keys == (MESSAGES, MESSAGES)
    return subtrans_reads(reader) - before


def test_a_long_micro_batch_never_overflows_the_subtransaction_cache(
    kafka_bootstrap: str, private_url: str, reader: psycopg.Connection[Any]
) -> None:
    reads = consume_all(kafka_bootstrap, private_url, reader)
    # Each savepoint that writes records its parent in pg_subtrans once (a page read): one
    # per message. Past 64 in a transaction, every row the reader met would cost another.
    assert MESSAGES > 64 > MAX_SAVEPOINTS
    assert reads <= MESSAGES + 20


def test_a_chunk_of_messages_takes_one_subtransaction(
    kafka_bootstrap: str, private_url: str, reader: psycopg.Connection[Any]
) -> None:
    reads = consume_all(kafka_bootstrap, private_url, reader, savepoint_chunk=50)
    # One savepoint, so one subtransaction id and one pg_subtrans read, per 50 messages.
    assert reads <= MESSAGES // 50 + 20
