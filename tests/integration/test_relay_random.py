"""A seeded random schedule of writers, two relays and a DBA changing what the low-water mark
rests on (the sequence's cache, a restart of the sequence, the isolation the database and the
relays' role default to, the relays' privilege on the sequence, their sessions killed), checked
for no loss and per-key order (docs/concepts.md I15).

Bounded for CI; ``OUTBOX_RANDOM_RELAY_STEPS`` runs more steps by hand and
``OUTBOX_RANDOM_RELAY_SEED`` replays a schedule (the seed is in the failure message).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
import sqlalchemy as sa

from outbox._core import codec
from outbox.relay import RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.relay import (
    RelayThread,
    assert_delivered,
    check_key_order,
    outbox_count,
    read_topic,
)

STEPS = int(os.environ.get("OUTBOX_RANDOM_RELAY_STEPS", "150"))
WRITERS = 3
KEYS_PER_WRITER = 4
ISOLATIONS = ("read committed", "repeatable read", "serializable")

INSERT = sa.text(
    "INSERT INTO outbox (event_id, topic, key, value, key_hash) "
    "VALUES (:event_id, :topic, :key, 'v', :key_hash)"
)


@dataclass
class Writer:
    """A long-lived application session; its keys are its own, so that its commit order is
    each of its keys' order."""

    engine: sa.Engine
    keys: list[bytes]
    conn: sa.Connection | None = None
    pending: list[tuple[bytes, str]] = field(default_factory=list)

    def insert(self, topic: str, rng: random.Random) -> None:
        if self.conn is None:
            self.conn = self.engine.connect()
        for _ in range(rng.randint(1, 8)):
            key = rng.choice(self.keys)
            event_id = uuid.uuid4()
            self.conn.execute(
                INSERT,
                {
                    "event_id": event_id,
                    "topic": topic,
                    "key": key,
                    "key_hash": codec.key_hash(key, event_id.bytes),
                },
            )
            self.pending.append((key, str(event_id)))

    def commit(self, committed: dict[bytes, list[str]]) -> None:
        if self.conn is None or not self.pending:
            return
        self.conn.commit()
        for key, event_id in self.pending:
            committed.setdefault(key, []).append(event_id)
        self.pending.clear()

    def close(self, committed: dict[bytes, list[str]]) -> None:
        self.commit(committed)
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def test_random_writers_relays_and_dba_changes_lose_nothing_and_keep_each_keys_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, relay_role: str
) -> None:
    seed = int(os.environ.get("OUTBOX_RANDOM_RELAY_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    topic = f"relay-random-{uuid.uuid4().hex[:8]}"
    database = engine.url.database
    relay_url = sa.make_url(database_url).set(username=relay_role)
    config = RelayConfig(
        relay_url.render_as_string(hide_password=False),
        kafka_bootstrap,
        batch_size=rng.choice([3, 5, 10]),
        rebalance_interval=0.3,
        stats_interval=0.5,
        poll_interval=0.2,
    )
    # A session of its own per writer, new at each reconnection: its ids grow in commit order
    # even under a cache (a new session draws past every value handed out), which is what
    # per-key order needs of the writers (a pooled session could bring back values it cached,
    # below ids committed earlier: then ids, hence the relay's order, differ from commit order
    # whatever the relay does).
    sessions = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    writers = [
        Writer(sessions, [f"w{w}-k{k}".encode() for k in range(KEYS_PER_WRITER)])
        for w in range(WRITERS)
    ]
    committed: dict[bytes, list[str]] = {}
    relays = [RelayThread(config).start() for _ in range(2)]
    log: list[str] = []

    def dba(sql: str) -> None:
        # ALTER SEQUENCE waits for the writers' open transactions (their nextval holds a lock
        # on the sequence), and this thread holds them open: give up after a moment, as a DBA
        # would, and try another step.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("SET lock_timeout = '300ms'")
            try:
                conn.exec_driver_sql(sql)
            except sa.exc.OperationalError as exc:
                if not isinstance(exc.orig, psycopg.errors.LockNotAvailable):
                    raise
                log.append("(waited)")

    def write() -> None:
        rng.choice(writers).insert(topic, rng)

    def commit() -> None:
        rng.choice(writers).commit(committed)

    def reconnect_writer() -> None:
        rng.choice(writers).close(committed)

    def cache() -> None:
        dba(f"ALTER SEQUENCE outbox_id_seq CACHE {rng.choice([1, 1, 5, 20])}")

    def restart_sequence() -> None:
        # A DBA restarts the sequence of an empty outbox (ids below would clash otherwise),
        # with the writers' sessions (and any values they cached) gone.
        for w in writers:
            w.close(committed)
        for r in relays:
            r.relay.kick.set()
        wait_for(lambda: outbox_count(engine) == 0, 30, "the outbox to drain")
        dba(f"ALTER SEQUENCE outbox_id_seq RESTART WITH {rng.randint(1, 50)}")

    def isolation() -> None:
        level = rng.choice(ISOLATIONS)
        target = rng.choice(
            [f'DATABASE "{database}"', f'ROLE {relay_role} IN DATABASE "{database}"']
        )
        dba(f"ALTER {target} SET default_transaction_isolation = '{level}'")

    def privilege() -> None:
        verb = rng.choice(["GRANT SELECT ON SEQUENCE outbox_id_seq TO",
                           "REVOKE SELECT ON SEQUENCE outbox_id_seq FROM"])  # fmt: skip
        dba(f"{verb} outbox_relay")

    def kill_relay_session() -> None:
        dba(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE usename = '{relay_role}' AND pid = ("
            f"SELECT min(pid) FROM pg_stat_activity WHERE usename = '{relay_role}')"
        )

    actions: list[tuple[Callable[[], None], int]] = [
        (write, 30),
        (commit, 20),
        (reconnect_writer, 5),
        (cache, 8),
        (restart_sequence, 2),
        (isolation, 6),
        (privilege, 6),
        (kill_relay_session, 3),
    ]
    try:
        for _ in range(STEPS):
            action = rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            log.append(action.__name__)
            action()
            if rng.random() < 0.3:
                rng.choice(relays).relay.kick.set()
        for w in writers:
            w.close(committed)
        dba("GRANT SELECT ON SEQUENCE outbox_id_seq TO outbox_relay")
        for r in relays:
            r.relay.kick.set()
        wait_for(lambda: outbox_count(engine) == 0, 60, "the relays to send every row")
    except BaseException as exc:
        exc.add_note(f"seed {seed} (OUTBOX_RANDOM_RELAY_SEED); steps: {' '.join(log)}")
        raise
    finally:
        for w in writers:
            if w.conn is not None:
                w.conn.close()
        for r in relays:
            r.stop()
        sessions.dispose()
    events = [e for ids in committed.values() for e in ids]
    records = read_topic(kafka_bootstrap, topic)
    context = f"seed {seed}, {len(events)} events, steps: {' '.join(log)}"
    try:
        assert_delivered(records, events)
        check_key_order(records, committed)
    except AssertionError as exc:
        exc.add_note(context)
        raise
    print(f"\nrandom relay schedule: {context.split(', steps')[0]}, {STEPS} steps")
