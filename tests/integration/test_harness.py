"""The test harness against the real services: database isolation, Redis clean-up, broker, and
the relay helpers."""

from __future__ import annotations

import uuid

import pytest
import redis
import sqlalchemy as sa
from confluent_kafka import KafkaError, Producer

from outbox import migrate
from outbox.relay import Relay, RelayConfig
from tests.fixtures.kafka import consume_all, create_topic
from tests.fixtures.postgres import DatabaseFactory
from tests.fixtures.redis import delete_keys_matching
from tests.fixtures.relay import (
    assert_delivered,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
    wait_for_records,
)


def _database_exists(admin_url: str, name: str) -> bool:
    eng = sa.create_engine(admin_url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            found = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).scalar()
    finally:
        eng.dispose()
    return found == 1


def test_database_url_is_migrated_to_head(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar() == 0


def test_databases_are_isolated_and_dropped(
    _database_factory: DatabaseFactory, pg_admin_url: str
) -> None:
    first, second = _database_factory.create(), _database_factory.create()
    assert first != second
    try:
        one = sa.create_engine(_database_factory.url_for(first), poolclass=sa.pool.NullPool)
        two = sa.create_engine(_database_factory.url_for(second), poolclass=sa.pool.NullPool)
        with one.begin() as conn:
            conn.execute(sa.text("CREATE TABLE business (id int)"))
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (event_id, topic, value, headers, key_hash) "
                    "VALUES (gen_random_uuid(), 't', '\\x00', '{}'::jsonb, 1)"
                )
            )
        with two.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0
            assert conn.execute(sa.text("SELECT to_regclass('business')")).scalar() is None
        # A connection left open must not stop the drop (WITH (FORCE)).
        leaked = one.connect()
        _database_factory.drop(first)
        leaked.invalidate()
        one.dispose()
        two.dispose()
        assert not _database_exists(pg_admin_url, first)
        assert _database_exists(pg_admin_url, second)
    finally:
        _database_factory.drop(first)
        _database_factory.drop(second)
    assert not _database_exists(pg_admin_url, second)


def test_leftovers_of_dead_sessions_are_dropped_and_live_ones_kept(
    _database_factory: DatabaseFactory, pg_admin_url: str
) -> None:
    import subprocess
    import sys

    from tests.fixtures.postgres import DB_PREFIX, HOST_TAG

    # A pid that certainly belonged to a process that has exited.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{DB_PREFIX}_db_{HOST_TAG}_{dead.pid}_zzzzzz_1"
    other_host = f"{DB_PREFIX}_db_zzzz_{dead.pid}_zzzzzz_1"
    live = _database_factory.create()
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for name in (stale, other_host):
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        dropped = _database_factory.drop_leftovers()
        # Another test session on this host (same code) may have dropped it a moment earlier;
        # either way it is gone, and nothing but dead sessions' databases was dropped.
        assert not _database_exists(pg_admin_url, stale)
        assert other_host not in dropped and live not in dropped
        assert _database_exists(pg_admin_url, other_host)
        assert _database_exists(pg_admin_url, live)
        assert _database_factory.template is not None
        assert _database_exists(pg_admin_url, _database_factory.template)
    finally:
        with admin.connect() as conn:
            for name in (stale, other_host):
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        _database_factory.drop(live)


def test_redis_prefix_clean_up_deletes_only_its_keys(redis_url: str, redis_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    other = f"outbox-test-other-{uuid.uuid4().hex}"
    try:
        ours = [f"{redis_prefix}:a", f"{redis_prefix}:b", f"{{{redis_prefix}}}:tagged"]
        for key in [*ours, other]:
            client.set(key, b"1", ex=60)
        assert delete_keys_matching(redis_url, f"*{redis_prefix}*") == len(ours)
        assert client.exists(*ours) == 0
        assert client.exists(other) == 1
    finally:
        client.delete(other)
        client.close()


def test_relay_helpers_round_trip(engine: sa.Engine, kafka_bootstrap: str) -> None:
    """The relay helpers: rows inserted here are what the relay and reader agree on."""
    topic = f"relay-support-{uuid.uuid4().hex[:8]}"
    ids = insert_rows(engine, topic, [("k", b"v1"), ("k", b"v2"), (None, b"v3")])
    assert outbox_count(engine) == 3
    config = RelayConfig(engine.url.render_as_string(hide_password=False), kafka_bootstrap)
    assert Relay(config).run(once=True) == 0
    assert outbox_count(engine) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    assert sorted(r.value for r in records) == [b"v1", b"v2", b"v3"]
    check_key_order(records, {b"k": [str(ids[0]), str(ids[1])]})


def test_read_topic_reads_to_the_end_of_every_partition(kafka_bootstrap: str) -> None:
    """Tens of thousands of records from one idempotent producer, all read back: the reader
    stops at end-of-partition, not at a ``ListOffsets`` watermark (Tansu's is too low)."""
    topic = f"harness-read-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=4)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    total = 20_000
    for i in range(total):
        producer.produce(
            topic,
            value=b"v",
            key=f"k{i % 50}".encode(),
            headers=[("X-Idempotency-Key", f"e{i}".encode())],
        )
        if i % 1000 == 999:
            producer.poll(0)
    assert producer.flush(30) == 0
    records = read_topic(kafka_bootstrap, topic)
    assert_delivered(records, [f"e{i}" for i in range(total)])
    assert len(records) == total and {r.partition for r in records} == {0, 1, 2, 3}
    with pytest.raises(AssertionError, match=r"1 missing \(first: \['absent'\]\), 0 unexpected"):
        assert_delivered(records, [*(f"e{i}" for i in range(total)), "absent"])


@pytest.mark.slow
def test_create_topic_and_consume_all_round_trip_headers(kafka_bootstrap: str) -> None:
    topic = f"harness-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=3)
    create_topic(kafka_bootstrap, topic, partitions=3)  # existing with that count: accepted
    with pytest.raises(AssertionError, match="3 partitions"):
        create_topic(kafka_bootstrap, topic, partitions=2)

    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"}
    )
    errors: list[KafkaError] = []
    for i in range(30):
        producer.produce(
            topic,
            value=f"v{i}".encode(),
            key=f"k{i % 5}".encode(),
            headers=[("X-Idempotency-Key", f"e{i}".encode()), ("bin", b"\x00\xff")],
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
    assert producer.flush(15) == 0
    assert errors == []

    messages = consume_all(kafka_bootstrap, topic, 30, timeout=30)
    assert sorted(m.value() for m in messages) == sorted(f"v{i}".encode() for i in range(30))
    assert {m.partition() for m in messages} <= {0, 1, 2}
    by_value = {m.value(): m for m in messages}
    assert by_value[b"v7"].headers() == [("X-Idempotency-Key", b"e7"), ("bin", b"\x00\xff")]
    with pytest.raises(TimeoutError, match="consumed 30 of 31"):
        consume_all(kafka_bootstrap, topic, 31, timeout=8)
