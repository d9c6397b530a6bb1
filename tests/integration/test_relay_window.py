"""The window engine (``outbox-relay --engine window``) against real PostgreSQL and a broker."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from outbox.relay import Relay, RelayConfig
from tests.fixtures.relay import check_key_order, insert_rows, outbox_count, wait_for_records


def _topic(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _config(database_url: str, bootstrap: str, **kw: object) -> RelayConfig:
    return RelayConfig(database_url, bootstrap, engine="window", **kw)  # type: ignore[arg-type]


def test_window_delivers_in_key_order_and_leaves_the_outbox_empty(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = _topic("window-basic")
    ids = insert_rows(engine, topic, [(f"k{i % 3}", b"v%d" % i) for i in range(30)])
    ids += insert_rows(engine, topic, [(None, b"free")])
    assert Relay(_config(database_url, kafka_bootstrap, batch_size=7)).run(once=True) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    check_key_order(
        records, {f"k{k}".encode(): [str(ids[i]) for i in range(30) if i % 3 == k] for k in range(3)}
    )
    assert len(records) == len(ids)
    assert outbox_count(engine) == 0
