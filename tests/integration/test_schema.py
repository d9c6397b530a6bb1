"""The whole pipeline in a schema of its own, with Unicode keys: a unit of work, the relay, the
consumer runner and the operator commands (status, parked, gc) find the tables in that schema
and leave the default one alone."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox import Outbox, OutboxConfig, cli, migrate
from outbox.consumer import ConsumerRunner
from outbox.relay import Relay, RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA, Running, keyed, produce, topic_with_dead_letters
from tests.fixtures.relay import read_topic

SCHEMA = "ledger"
IDEMPOTENCY_KEY = "заказ-42-ü-🦆"  # the unit of work's key
MESSAGE_KEY = "ключ-é"  # the event's Kafka key
CONSUMED_KEY = "コンシューマー-ß"  # an idempotency key that arrives in a record's header


def _count(engine: sa.Engine, table: str, schema: str = "public") -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f'SELECT count(*) FROM "{schema}".{table}')).scalar_one())


def _status(database_url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    code = cli.main(["status", "--database-url", database_url, "--schema", SCHEMA, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return dict(json.loads(out))


def test_a_schema_of_its_own_end_to_end_with_unicode_keys(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    migrate.upgrade(engine, schema=SCHEMA)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text PRIMARY KEY, value text NOT NULL)"))
    topic = topic_with_dead_letters(kafka_bootstrap, "schema", partitions=1)
    ob = Outbox(engine, config=OutboxConfig(schema=SCHEMA))
    try:
        with ob.unit_of_work(IDEMPOTENCY_KEY, scope="orders") as uow:
            event_id = uow.publish(topic, {"order": "ü"}, key=MESSAGE_KEY)
            uow.result = {"placed": IDEMPOTENCY_KEY}
        assert _count(engine, "outbox", SCHEMA) == 1
        assert _count(engine, "outbox") == 0  # the default schema's tables stay empty
        assert _count(engine, "idempotency_keys") == 0
        status = _status(database_url, capsys)
        assert status["schema"] == SCHEMA and status["outbox"]["pending"] == 1

        # The relay delivers from the schema's outbox, key and idempotency header intact.
        relay = Relay(RelayConfig(database_url, kafka_bootstrap, schema=SCHEMA))
        try:
            relay.run(once=True)
        finally:
            relay.engine.dispose()
        (record,) = read_topic(kafka_bootstrap, topic)
        assert record.key == MESSAGE_KEY.encode()
        assert record.event_id == str(event_id)
        assert _status(database_url, capsys)["outbox"]["pending"] == 0

        # The consumer runner applies the relayed event and a record keyed by a Unicode header
        # (sent twice) once each, with its keys in the schema's table.
        produce(
            kafka_bootstrap,
            topic,
            [keyed(CONSUMED_KEY, "from-header"), keyed(CONSUMED_KEY, "from-header")],
        )

        def handle(uow: Any, message: Any) -> None:
            uow.connection.execute(
                sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"),
                {"k": uow.key, "v": message.value().decode()},
            )

        registry = CollectorRegistry()
        running = Running(
            ConsumerRunner(
                ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
                bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA, metrics_registry=registry,
            ),
            registry,
        )  # fmt: skip
        try:
            wait_for(lambda: _count(engine, "effects") == 2, 60, "the consumer's two effects")

            def replayed() -> bool:
                sample = registry.get_sample_value(
                    "outbox_consumer_replayed_total",
                    {"group": running.runner.config.group, "topic": topic, "status": "completed"},
                )
                return (sample or 0.0) >= 1

            wait_for(replayed, 30, "the duplicate answered as a replay")
        finally:
            running.stop()
        with engine.connect() as conn:
            effects = dict(conn.execute(sa.text("SELECT key, value FROM effects")).all())
            keys = {
                r[0] for r in conn.execute(sa.text(f"SELECT key FROM {SCHEMA}.idempotency_keys"))
            }
        assert effects == {str(event_id): '{"order":"ü"}', CONSUMED_KEY: "from-header"}
        assert keys == {IDEMPOTENCY_KEY, str(event_id), CONSUMED_KEY}
        assert _count(engine, "idempotency_keys") == 0

        # A Unicode key replays from the schema's table.
        with ob.unit_of_work(IDEMPOTENCY_KEY, scope="orders") as uow:
            assert uow.replayed and uow.result == {"placed": IDEMPOTENCY_KEY}
    finally:
        ob.close()

    # The operator commands read the same schema (and refuse nothing about it).
    for argv in (
        ["parked", "list", "--schema", SCHEMA],
        ["gc", "--schema", SCHEMA, "--dry-run", "--older-than", "30d"],
    ):
        capsys.readouterr()
        assert cli.main([*argv, "--database-url", database_url]) == 0, capsys.readouterr()
    status = _status(database_url, capsys)
    assert status["idempotency_keys"]["total"] == 3
