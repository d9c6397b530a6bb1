"""Per-key order (docs/concepts.md I7) the hard way: writers that share no business row, commits
slowed down at COMMIT time, relays draining while they write, and the commit order taken from
PostgreSQL itself.

Ground truth: a deferred constraint trigger on the outbox runs inside each writer's COMMIT. It
sleeps a random few milliseconds (a slow disk, synchronous replication), then takes a
transaction-scoped lock of its own and appends the event to a ledger. That lock is released
only after the transaction is committed and visible, so the ledger's sequence numbers follow
the order in which the transactions became visible: their commit order, as PostgreSQL saw it.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import KeyInProgress, Outbox
from outbox.relay import RelayConfig
from tests.fixtures.relay import RelayThread, assert_delivered, outbox_count, read_topic

KEYS = [f"account-{i}" for i in range(4)]

SLOW_COMMIT_DDL = [
    "CREATE TABLE commit_ledger (seq bigserial PRIMARY KEY, event_id uuid NOT NULL)",
    "CREATE TABLE payments (id bigserial PRIMARY KEY, account text NOT NULL, n integer NOT NULL)",
    "CREATE TABLE accounts (account text PRIMARY KEY, payments integer NOT NULL DEFAULT 0)",
    # Runs at COMMIT: sleep 0-15 ms, then record the commit under a lock that the committing
    # transaction holds until it is visible to everyone (the two-integer lock space, apart
    # from the toolkit's single-bigint locks).
    """
    CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_sleep(random() * 0.015);
        PERFORM pg_advisory_xact_lock(7007, 1);
        INSERT INTO commit_ledger (event_id) VALUES (NEW.event_id);
        RETURN NULL;
    END $$
    """,
    """
    CREATE CONSTRAINT TRIGGER outbox_slow_commit AFTER INSERT ON outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()
    """,
]


@pytest.fixture
def slow_commits(engine: sa.Engine) -> Iterator[sa.Engine]:
    with engine.begin() as conn:
        for statement in SLOW_COMMIT_DDL:
            conn.execute(sa.text(statement))
        conn.execute(
            sa.text("INSERT INTO accounts (account) SELECT unnest(CAST(:keys AS text[]))"),
            {"keys": KEYS},
        )
    yield engine


def _write(
    ob: Outbox, topic: str, seconds: float, writers: int, shared_row: bool
) -> dict[str, str]:
    """Units of work from ``writers`` threads for ``seconds``: each writes a payment row of its
    own and publishes one event under one of a few shared keys. With ``shared_row`` they also
    update the key's account row (the case that was always ordered). Returns event id -> key."""
    published: dict[str, str] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def writer(wid: int) -> None:
        rng = random.Random(wid)
        n = 0
        try:
            while time.monotonic() < deadline:
                key = rng.choice(KEYS)
                n += 1
                with ob.unit_of_work(f"w{wid}-{n}", scope="order-test") as uow:
                    uow.connection.execute(
                        sa.text("INSERT INTO payments (account, n) VALUES (:a, :n)"),
                        {"a": key, "n": n},
                    )
                    if shared_row:
                        uow.connection.execute(
                            sa.text(
                                "UPDATE accounts SET payments = payments + 1 WHERE account = :a"
                            ),
                            {"a": key},
                        )
                    event = uow.publish(topic, f"{wid}:{n}".encode(), key=key)
                with lock:
                    published[str(event)] = key
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    assert not errors, errors[0]
    return published


def _ledger(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT event_id, seq FROM commit_ledger")).all()
    return {str(r.event_id): int(r.seq) for r in rows}


def _inversions(firsts: list[str], seq: dict[str, int]) -> int:
    return sum(1 for a, b in itertools.pairwise(firsts) if seq[a] > seq[b])


@pytest.mark.parametrize(
    ("relays", "shared_row"),
    [(1, False), (3, False), (1, True)],
    ids=["one-relay", "three-relays-with-a-restart", "shared-row"],
)
def test_each_key_reaches_kafka_in_commit_order_under_slow_commits(
    slow_commits: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    relays: int,
    shared_row: bool,
) -> None:
    engine = slow_commits
    topic = f"order-{uuid.uuid4().hex[:8]}"
    # Small batches and lanes shared by several relays: many claims race the commits.
    config = RelayConfig(
        database_url,
        kafka_bootstrap,
        batch_size=20,
        lanes=8,
        rebalance_interval=0.2,
        poll_interval=0.05,
    )
    running = [RelayThread(config).start() for _ in range(relays)]
    ob = Outbox(database_url, engine_options={"pool_size": 8})
    restart: threading.Timer | None = None
    try:
        if relays > 1:
            # One relay stops half-way through the writes and a new one takes its place.
            def replace() -> None:
                running[0].stop()
                running[0] = RelayThread(config).start()

            restart = threading.Timer(1.5, replace)
            restart.start()
        published = _write(ob, topic, seconds=3.0, writers=8, shared_row=shared_row)
        if restart is not None:
            restart.join()
        deadline = time.monotonic() + 60
        while outbox_count(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert outbox_count(engine) == 0, "the relays did not drain the outbox"
    finally:
        ob.close()
        for relay in running:
            relay.stop()

    seq = _ledger(engine)
    assert set(seq) == set(published)
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, published)
    firsts: dict[str, list[str]] = {key: [] for key in KEYS}
    seen: set[str] = set()
    for record in records:  # in (partition, offset) order; one key lives in one partition
        if record.event_id not in seen:
            seen.add(record.event_id)
            firsts[record.key.decode() if record.key else ""].append(record.event_id)
    committed: dict[str, list[str]] = {key: [] for key in KEYS}
    for event_id in sorted(published, key=seq.__getitem__):
        committed[published[event_id]].append(event_id)
    bad: dict[str, Any] = {
        key: _inversions(firsts[key], seq) for key in KEYS if firsts[key] != committed[key]
    }
    assert not bad, f"adjacent pairs out of commit order per key ({len(seq)} events): {bad}"
    assert len(seq) > 200  # enough commits raced each other to make the check meaningful


def lock_waiters(engine: sa.Engine) -> list[tuple[str, str]]:
    """The backends of this test's database that wait on a lock right now."""
    with engine.connect() as conn:
        return [
            (row[0], row[1])
            for row in conn.execute(
                sa.text(
                    "SELECT wait_event_type, wait_event FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                    "AND pid <> pg_backend_pid()"
                )
            )
        ]


def wait_for_lock_waiter(engine: sa.Engine, timeout: float = 30.0) -> list[tuple[str, str]]:
    """Wait until a backend of this database waits on a lock (polling pg_stat_activity)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if waiters := lock_waiters(engine):
            return waiters
        time.sleep(0.02)
    return []


def test_only_writers_of_the_same_message_key_wait_for_each_other(
    engine: sa.Engine, database_url: str
) -> None:
    """The order lock: a writer of key k waits for an uncommitted writer of k (so ids follow
    commit order), a writer of another key does not wait, and a second attempt at a busy
    idempotency key still fails at once (docs/concepts.md I3)."""
    topic = f"order-wait-{uuid.uuid4().hex[:8]}"
    ob = Outbox(database_url)
    second_done = threading.Event()
    second: list[uuid.UUID] = []

    def same_key_writer() -> None:
        with ob.unit_of_work("second", scope="wait") as uow:
            second.append(uow.publish(topic, b"2", key="k"))
        second_done.set()

    try:
        with engine.connect() as holder:
            # Joined to a transaction that stays open: its order lock on "k" is held until
            # the caller commits.
            with ob.unit_of_work("first", scope="wait", connection=holder) as uow:
                first = uow.publish(topic, b"1", key="k")
            # The holder commits only at the end of this block: a call below that waited on
            # its locks would never return (and pytest-timeout would fail the test).
            with ob.unit_of_work("other", scope="wait") as uow:
                uow.publish(topic, b"x", key="another-key")
            thread = threading.Thread(target=same_key_writer)
            thread.start()
            waiting = wait_for_lock_waiter(engine)
            assert not second_done.is_set(), "a writer of the same key did not wait"
            assert waiting, "the writer of the same key waits on a lock"
            with pytest.raises(KeyInProgress), ob.unit_of_work("first", scope="wait"):
                pass
            holder.commit()
        assert second_done.wait(10)
        thread.join(10)
    finally:
        ob.close()
    with engine.connect() as conn:
        order = conn.execute(
            sa.text("SELECT event_id FROM outbox WHERE key = 'k' ORDER BY id")
        ).scalars()
        assert [str(e) for e in order] == [str(first), str(second[0])]
