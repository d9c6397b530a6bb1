"""What the relay's low-water mark rests on is checked on every claim, not assumed (docs/concepts.md
I15): the session's isolation, the sequence's cache and direction, the URL's options, the role's
privileges. Whatever a database, a DBA or a role sets, no committed row is stranded."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.relay import RelayConfig, _claims as relay_loop
from tests.fixtures.common import wait_for
from tests.fixtures.relay import RelayThread, insert_rows, outbox_count, wait_for_records

BATCH = 10
SEQUENCE = "outbox_id_seq"


def _drained(engine: sa.Engine, relay: RelayThread, timeout: float = 10.0) -> None:
    """Every row left the outbox (sent and deleted) within ``timeout``."""
    relay.relay.kick.set()
    wait_for(lambda: outbox_count(engine) == 0, timeout, "the relay to send every row")


def _idle_after_claim(relay: RelayThread) -> None:
    """Wait until the relay claimed again (after a kick) and waits for work."""
    wait_for(relay.relay.idle.is_set, 30, "the relay to wait for work")
    relay.relay.idle.clear()
    relay.relay.kick.set()
    wait_for(relay.relay.idle.is_set, 30, "the relay to claim and wait again")


def _commit_during_the_first_batch(
    engine: sa.Engine, topic: str, monkeypatch: pytest.MonkeyPatch
) -> list[uuid.UUID]:
    """While the relay's first full batch is open (its rows deleted in a savepoint, the claim
    ahead about to read the mark), another transaction commits five rows; returns their ids."""
    committed: list[uuid.UUID] = []
    delete = relay_loop.outbox_delete_between_savepoints

    def delete_then_commit(*args: Any) -> None:
        delete(*args)
        if not committed:
            committed.extend(insert_rows(engine, topic, [(f"late-{i}", b"v") for i in range(5)]))

    monkeypatch.setattr(relay_loop, "outbox_delete_between_savepoints", delete_then_commit)
    return committed


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_a_database_defaulting_to_another_isolation_strands_nothing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    isolation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(
            f'ALTER DATABASE "{engine.url.database}" SET default_transaction_isolation = '
            f"'{isolation}'"
        )
    topic = f"relay-iso-{uuid.uuid4().hex[:8]}"
    late = _commit_during_the_first_batch(engine, topic, monkeypatch)
    first = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(BATCH)])  # a full batch
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH)).start()
    try:
        _drained(engine, relay)
        assert late, "the batch never overlapped with its claim ahead"
        wait_for_records(kafka_bootstrap, topic, first + late)
    finally:
        relay.stop()


def test_a_session_whose_isolation_is_overridden_claims_from_the_low_end_and_says_so_once(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Something between the relay and PostgreSQL (a driver hook here) overrides the pinned
    isolation: the readings notice it in the claim that would have stranded the rows."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    topic = f"relay-iso-override-{uuid.uuid4().hex[:8]}"
    late = _commit_during_the_first_batch(engine, topic, monkeypatch)
    first = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(BATCH)])
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH))

    @sa.event.listens_for(relay.relay.engine, "connect")
    def repeatable_read(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("SET default_transaction_isolation = 'repeatable read'")
        dbapi_connection.commit()

    relay.start()
    try:
        _drained(engine, relay)
        wait_for_records(kafka_bootstrap, topic, first + late)
    finally:
        relay.stop()
    off = [r.getMessage() for r in caplog.records if "event=low_water_off" in r.getMessage()]
    assert len(off) == 1, off
    assert "reason=isolation" in off[0] and "repeatable read" in off[0]


def _alter_sequence(engine: sa.Engine, clause: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER SEQUENCE {SEQUENCE} {clause}")


@pytest.fixture
def writer(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A long-lived writer session (a pooled application connection)."""
    conn = engine.connect()
    yield conn
    conn.close()


def _write(conn: sa.Connection, topic: str, key: str) -> str:
    event = conn.execute(
        sa.text(
            "INSERT INTO outbox (event_id, topic, key, value, key_hash) "
            "VALUES (gen_random_uuid(), :topic, :key, 'v', 3) RETURNING event_id"
        ),
        {"topic": topic, "key": key.encode()},
    ).scalar_one()
    conn.commit()
    return str(event)


def test_a_sequence_cache_changed_under_a_running_relay_strands_nothing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    writer: sa.Connection,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    topic = f"relay-cache-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH)).start()
    other = engine.connect()
    sent: list[str] = []
    try:
        sent += [str(e) for e in insert_rows(engine, topic, [("warm", b"v")])]
        _drained(engine, relay)
        _alter_sequence(engine, "CACHE 20")  # a DBA tunes a busy sequence
        sent.append(_write(writer, topic, "a"))  # draws 20 values, uses the first
        sent.append(_write(other, topic, "b"))  # draws the next 20: the sequence moved by 40
        _drained(engine, relay)
        _idle_after_claim(relay)  # one more claim: nothing left below the last value drawn
        for i in range(3):  # the writer's cached values, far below the sequence's last one
            sent.append(_write(writer, topic, f"a{i}"))
        _drained(engine, relay)
        _alter_sequence(engine, "CACHE 1")  # and back: the writer keeps its cached values
        _idle_after_claim(relay)
        for i in range(3):
            sent.append(_write(writer, topic, f"a-after-{i}"))
        _drained(engine, relay)
        # Every session connected when the cache went back to 1 ends (the engine's pool too).
        writer.close()
        other.close()
        engine.dispose()
        _idle_after_claim(relay)
        sent += [str(e) for e in insert_rows(engine, topic, [("end", b"v")])]
        _drained(engine, relay)
        wait_for_records(kafka_bootstrap, topic, sent)
    finally:
        other.close()
        relay.stop()
    lines = [r.getMessage() for r in caplog.records if "event=low_water_" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == [
        "event=low_water_off reason=cache",
        "event=low_water_off reason=cached_values",
        "event=low_water_on",
    ], lines


@pytest.mark.parametrize("how", ["setval", "restart"])
def test_a_sequence_moved_back_under_a_running_relay_strands_nothing(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, how: str
) -> None:
    topic = f"relay-setval-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH)).start()
    try:
        sent = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(30)])
        _drained(engine, relay)
        _idle_after_claim(relay)  # the mark is past every id drawn
        with engine.begin() as conn:
            if how == "setval":
                conn.exec_driver_sql(f"SELECT setval('{SEQUENCE}', 1)")
            else:
                conn.exec_driver_sql(f"ALTER SEQUENCE {SEQUENCE} RESTART WITH 2")
        sent += insert_rows(engine, topic, [(f"again-{i}", b"v") for i in range(3)])
        _drained(engine, relay)
        wait_for_records(kafka_bootstrap, topic, sent)
    finally:
        relay.stop()


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of the relay loop's ``name`` (one element per call)."""
    calls: list[int] = []
    original = getattr(relay_loop, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(relay_loop, name, counting)
    return calls


def test_an_idle_relays_polls_ask_whether_anything_is_pending_and_claim_only_then(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a claim found nothing, the fallback polls (no wake-up: these inserts send none)
    check the mark in one statement instead of claiming, and still find a committed row."""
    topic = f"relay-idle-poll-{uuid.uuid4().hex[:8]}"
    checks = _counted(monkeypatch, "outbox_pending")
    claims = _counted(monkeypatch, "outbox_claim_batch")
    config = RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH, poll_interval=0.05)
    relay = RelayThread(config).start()
    try:
        sent = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(15)])
        wait_for(lambda: outbox_count(engine) == 0, 30, "the relay to send every row")
        wait_for(lambda: len(checks) >= 1, 30, "an idle poll")
        claimed, checked = len(claims), len(checks)
        wait_for(lambda: len(checks) >= checked + 5, 30, "five more idle polls")
        assert len(claims) == claimed, "an idle relay's poll claimed"
        sent += insert_rows(engine, topic, [(f"later-{i}", b"v") for i in range(3)])
        wait_for(lambda: outbox_count(engine) == 0, 30, "a poll to find the later rows")
        assert len(claims) > claimed
        wait_for_records(kafka_bootstrap, topic, sent)
    finally:
        relay.stop()


@pytest.mark.parametrize("how", ["setval", "restart"])
def test_a_sequence_moved_back_under_an_idle_relay_is_noticed_by_its_poll(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:  # fmt: skip
    """The poll that finds nothing pending checks the mark's facts as a claim does: after a
    setval or RESTART, rows with ids below the mark are found without a wake-up."""
    topic = f"relay-idle-setval-{uuid.uuid4().hex[:8]}"
    checks = _counted(monkeypatch, "outbox_pending")
    config = RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH, poll_interval=0.05)
    relay = RelayThread(config).start()
    try:
        sent = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(30)])
        wait_for(lambda: outbox_count(engine) == 0, 30, "the relay to send every row")
        checked = len(checks)
        wait_for(lambda: len(checks) > checked + 1, 30, "idle polls past every id drawn")
        with engine.begin() as conn:
            if how == "setval":
                conn.exec_driver_sql(f"SELECT setval('{SEQUENCE}', 1)")
            else:
                conn.exec_driver_sql(f"ALTER SEQUENCE {SEQUENCE} RESTART WITH 2")
        sent += insert_rows(engine, topic, [(f"again-{i}", b"v") for i in range(3)])
        wait_for(lambda: outbox_count(engine) == 0, 30, "a poll to find the rows below the mark")
        wait_for_records(kafka_bootstrap, topic, sent)
    finally:
        relay.stop()
