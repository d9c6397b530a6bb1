"""A fleet's relays share a few producers: each borrows one while it sends and gives it back
when it waits for work, so an idle fleet holds the pool's warm producers, not one per database,
and events still reach Kafka from every database."""

from __future__ import annotations

import threading
import uuid

import sqlalchemy as sa

from outbox._pg.wakeup import channel
from outbox.config import FleetConfig, RelayConfig
from outbox.relay._fleet import Fleet
from outbox.relay._producers import KEEP
from tests.faults.test_relay_fleet import Databases, databases
from tests.fixtures.common import wait_for
from tests.fixtures.relay import assert_delivered, insert_rows, outbox_count, read_topic

__all__ = ["databases"]  # the fixture, imported for this module's tests


def test_relays_of_a_fleet_borrow_the_pools_producers_one_at_a_time(
    databases: Databases, kafka_bootstrap: str
) -> None:
    names = [databases.create() for _ in range(4)]
    urls = [databases.factory.url_for(name) for name in names]
    config = FleetConfig(
        RelayConfig(database_url=urls[0], bootstrap_servers=kafka_bootstrap, poll_interval=30.0),
        database_urls=tuple(urls),
        member_id="producers",
    )
    fleet = Fleet(config)
    runner = threading.Thread(target=fleet.run, daemon=True)
    runner.start()
    topic = f"fleet-producers-{uuid.uuid4().hex[:8]}"
    sent = []
    try:
        wait_for(lambda: len(fleet.served) == len(names), 30, "not every database served")

        def waiting_without_producers() -> bool:
            relays = fleet.served.values()
            return all(r.idle.is_set() and r.producing.producer is None for r in relays)

        wait_for(waiting_without_producers, 30, "a relay kept its producer while waiting")
        # Relays that start together may each borrow one at once (their first broker check):
        # the spare ones are closed once idle for the pool's linger.
        fleet.producers.linger = 0.0
        wait_for(lambda: fleet.producers.idle == KEEP, 10, "spare producers never closed")
        built = fleet.producers.built
        for name in names:
            engine = databases.engines[name]
            sent += insert_rows(engine, topic, [(f"key-{name}", b"v")])
            with engine.begin() as conn:  # the wake-up a unit of work sends after its commit
                conn.execute(sa.text("SELECT pg_notify(:channel, '')"), {"channel": channel(None)})
            # Delivered (deleted after Kafka confirmed it) before the next database writes.
            wait_for(lambda e=engine: outbox_count(e) == 0, 30, f"{name}: not delivered")
            wait_for(waiting_without_producers, 30, f"{name}: its relay kept the producer")
        assert_delivered(read_topic(kafka_bootstrap, topic), sent)
        # One relay sent at a time: each borrowed an idle, warm producer of the pool (which
        # built one ahead, once, to keep KEEP idle while the first was lent).
        assert fleet.producers.built - built <= 1, (built, fleet.producers.built)
        assert fleet.producers.lent == 0 and fleet.producers.idle >= KEEP
    finally:
        fleet.stop()
        runner.join(30)
    assert not runner.is_alive()
    assert fleet.producers.idle == 0  # closed at shutdown
