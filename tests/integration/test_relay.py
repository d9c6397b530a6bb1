"""The relay against real PostgreSQL and a real broker (relays run in-process here)."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox import Outbox
from outbox._pg.relay import outbox_delete_confirmed
from outbox.admin import discard_parked, list_parked, relay_ownership, retry_parked
from outbox.errors import ConfigurationError
from outbox.relay import Relay, RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.relay import (
    RelayThread,
    check_key_order,
    insert_rows,
    outbox_count,
    wait_for_records,
)


def _topic(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


# The relay's engines (outbox-relay --engine): the contract tests run against both.
ENGINES = pytest.mark.parametrize("relay_engine", ["claim", "window"])


@ENGINES
def test_records_carry_topic_key_value_and_headers(
    database_url: str, kafka_bootstrap: str, relay_engine: str
) -> None:
    topic = _topic("relay-headers")
    ob = Outbox(database_url)
    try:
        with ob.unit_of_work("req-1") as uow:
            plain = uow.publish(topic, {"n": 1}, key="order-1", headers={"source": "api"})
            own = uow.publish(
                topic, b"raw", key=b"\x00bin", headers={"X-Idempotency-Key": "mine", "b": b"\xff"}
            )
        config = RelayConfig(database_url, kafka_bootstrap, engine=relay_engine)
        assert Relay(config).run(once=True) == 0
    finally:
        ob.close()
    records = {r.value: r for r in wait_for_records(kafka_bootstrap, topic, [plain, "mine"])}
    assert len(records) == 2
    first = records[b'{"n": 1}'] if b'{"n": 1}' in records else records[b'{"n":1}']
    assert first.key == b"order-1"
    assert first.headers["source"] == b"api"
    assert first.headers["X-Idempotency-Key"] == str(plain).encode()
    assert first.headers["content-type"] == b"application/json"
    second = records[b"raw"]
    assert second.key == b"\x00bin"
    assert second.headers["X-Idempotency-Key"] == b"mine"  # the publisher's own value wins
    assert second.headers["b"] == b"\xff"
    assert own != plain


@ENGINES
def test_oversized_row_is_parked_while_other_keys_flow(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, relay_engine: str
) -> None:
    topic = _topic("relay-poison")
    big = b"x" * 300_000  # above the producer's message.max.bytes set below
    ids = insert_rows(
        engine, topic, [("poison", b"p1"), ("poison", big), ("poison", b"p3"), ("other", b"o1")]
    )
    ids += insert_rows(engine, topic, [("other", b"o2"), (None, b"free")])
    config = RelayConfig(
        database_url,
        kafka_bootstrap,
        kafka_config={"message.max.bytes": "100000"},
        engine=relay_engine,
    )
    assert Relay(config).run(once=True) == 0
    # p1 went out; the oversized row is parked at once; p3 waits behind it; other keys flowed.
    with engine.connect() as conn:
        parked = list_parked(conn)
    assert [p.event_id for p in parked] == [ids[1]]
    assert parked[0].attempts == 1
    assert "MSG_SIZE_TOO_LARGE" in (parked[0].error or "")
    assert parked[0].key_text() == "poison"
    assert outbox_count(engine) == 2  # the parked row and p3 behind it
    records = wait_for_records(kafka_bootstrap, topic, [ids[0], ids[3], ids[4], ids[5]])
    assert str(ids[2]) not in {r.event_id for r in records}

    # Retried with the same limit it parks again; p3 still waits.
    with engine.begin() as conn:
        assert retry_parked(conn, event_ids=[ids[1]]) == 1
    assert Relay(config).run(once=True) == 0
    assert outbox_count(engine, parked=True) == 1
    # Discarding it lets p3 through, after p1.
    with engine.begin() as conn:
        assert discard_parked(conn, event_ids=[ids[1]]) == 1
    assert Relay(config).run(once=True) == 0
    assert outbox_count(engine) == 0
    records = wait_for_records(kafka_bootstrap, topic, [ids[2]])
    check_key_order(records, {b"poison": [str(ids[0]), str(ids[2])]})


def test_a_batch_claimed_ahead_is_given_up_when_the_batch_in_hand_fails(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Full batches of two: the next batch is claimed while Kafka confirms the one in hand.
    When a row of the batch in hand fails, the delete in its savepoint and the batch claimed
    ahead are rolled back; the failed row parks and its key's later rows wait behind it."""
    topic = _topic("relay-ahead")
    big = b"x" * 300_000
    items = [("a", b"a1"), ("a", big), ("a", b"a3"), ("b", b"b1"), ("b", b"b2"), ("a", b"a4")]
    ids = insert_rows(engine, topic, items)
    config = RelayConfig(
        database_url, kafka_bootstrap, batch_size=2, kafka_config={"message.max.bytes": "100000"}
    )
    assert Relay(config).run(once=True) == 0
    with engine.connect() as conn:
        assert [p.event_id for p in list_parked(conn)] == [ids[1]]
    assert outbox_count(engine) == 3  # the parked row, a3 and a4 behind it
    records = wait_for_records(kafka_bootstrap, topic, [ids[0], ids[3], ids[4]])
    assert {r.event_id for r in records} == {str(ids[0]), str(ids[3]), str(ids[4])}
    check_key_order(records, {b"a": [str(ids[0])], b"b": [str(ids[3]), str(ids[4])]})


@ENGINES
def test_row_with_malformed_headers_is_parked_not_a_crash(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, relay_engine: str
) -> None:
    """A row written by hand with headers the relay cannot read parks with the reason, and is no
    crash: the row of its key before it still goes out (in the same batch, which is all that
    ``--once`` gets here), the row after it waits."""
    topic = _topic("relay-malformed")
    ids = insert_rows(engine, topic, [("m", b"m1"), ("m", b"m2"), ("m", b"m3")])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET headers = CAST(:h AS jsonb) WHERE event_id = :e"),
            {"h": '{"h": {"not": "base64"}}', "e": ids[1]},
        )
    assert (
        Relay(RelayConfig(database_url, kafka_bootstrap, engine=relay_engine)).run(once=True) == 0
    )
    with engine.connect() as conn:
        parked = list_parked(conn)
    assert [p.event_id for p in parked] == [ids[1]]
    assert (parked[0].error or "").startswith("row cannot be turned into a record: ")
    assert outbox_count(engine) == 2  # the parked m2 and m3 behind it
    records = wait_for_records(kafka_bootstrap, topic, [ids[0]])
    assert {r.event_id for r in records} == {str(ids[0])}


def test_rows_behind_a_parked_row_are_neither_claimed_nor_sent_back_as_skipped(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """A queue behind a parked row costs the claim no transfer: only the other key's row comes
    back, claimed, and nothing is reported skipped."""
    topic = _topic("relay-parked-queue")
    ids = insert_rows(engine, topic, [("k", b"head")] + [("k", b"x")] * 50 + [("o", b"o1")])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET parked_at = now() WHERE event_id = :e"), {"e": ids[0]}
        )
    relay = Relay(RelayConfig(database_url, kafka_bootstrap, lanes=1))
    try:
        with relay.engine.connect() as conn:
            driver: Any = conn.connection.driver_connection
            with driver.cursor(binary=True) as cur:
                cur.execute(
                    relay.sql.claim, {"lanes": 1, "owned": [0], "batch_size": 100, "low": 0}
                )
                fetched = cur.fetchall()
            conn.rollback()
    finally:
        relay.engine.dispose()
    assert [(bytes(r[3]), r[7]) for r in fetched] == [(b"o", False)]
    assert fetched[0][6] == str(ids[-1]).encode()


def test_a_row_held_by_another_transaction_blocks_later_rows_of_its_key(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """The claim rule: even if lane ownership failed, a key's later row never overtakes an
    earlier one that someone else has claimed."""
    topic = _topic("relay-claim-rule")
    ids = insert_rows(engine, topic, [("a", b"a1"), ("a", b"a2"), ("b", b"b1")])
    with engine.connect() as holder:
        holder.execute(
            sa.text("SELECT id FROM outbox WHERE event_id = :e FOR UPDATE"), {"e": ids[0]}
        )
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
        assert outbox_count(engine) == 2  # a1 (locked by us) and a2 (behind it) remain
        holder.rollback()
    assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    check_key_order(records, {b"a": [str(ids[0]), str(ids[1])], b"b": [str(ids[2])]})


@ENGINES
def test_relays_split_lanes_and_survivor_takes_over(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, relay_engine: str
) -> None:
    config = RelayConfig(
        database_url, kafka_bootstrap, lanes=8, rebalance_interval=0.1, engine=relay_engine
    )
    first = RelayThread(config).start()
    second = RelayThread(config).start()
    try:

        def split_evenly() -> bool:
            with engine.connect() as conn:
                relays = relay_ownership(conn, None)
            held = [lane for r in relays for lane in r.lanes]
            return (
                len(relays) == 2
                and sorted(held) == list(range(8))
                and all(len(r.lanes) == 4 for r in relays)
                and all(r.application_name == "outbox-relay" for r in relays)
            )

        wait_for(split_evenly, 20, "two relays did not split 8 lanes 4/4")
        second.stop()

        def first_owns_all() -> bool:
            with engine.connect() as conn:
                relays = relay_ownership(conn, None)
            return len(relays) == 1 and relays[0].lanes == tuple(range(8))

        wait_for(first_owns_all, 20, "the surviving relay did not take every lane")
        topic = _topic("relay-lanes")
        ids = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(50)])
        wait_for_records(kafka_bootstrap, topic, ids)
    finally:
        first.stop()


def test_rebalance_says_whether_the_relay_gave_a_lane_up(
    database_url: str, kafka_bootstrap: str
) -> None:
    """A relay keeps the batch it claimed ahead across a rebalance that took no lane from it
    and drops it after giving one back (another relay may claim those rows then): the
    rebalance's answer decides."""
    config = RelayConfig(database_url, kafka_bootstrap, lanes=8)
    first, second = Relay(config), Relay(config)
    try:
        with first.engine.connect() as a, second.engine.connect() as b:
            first.lanes.register(a)
            assert first.lanes.rebalance(a) is False  # took all eight, gave none back
            assert first.owned == set(range(8))
            assert first.lanes.rebalance(a) is False  # nothing moves
            second.lanes.register(b)
            assert second.lanes.rebalance(b) is False  # every lane is held: takes none yet
            assert not second.owned
            assert first.lanes.rebalance(a) is True  # gives four back for the newcomer
            assert len(first.owned) == 4
            assert second.lanes.rebalance(b) is False  # takes them
            assert second.owned == set(range(8)) - first.owned
            assert first.lanes.rebalance(a) is False
    finally:
        first.engine.dispose()
        second.engine.dispose()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.sets(st.integers(0, 199), min_size=1))
def test_the_confirmed_delete_takes_exactly_the_rows_listed(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, chosen: set[int]
) -> None:
    """Whatever the spread of the ids (one run, gaps, two far apart: the range walk or the
    per-id probe), the delete removes the rows listed and no other."""
    if outbox_count(engine) == 0:
        insert_rows(engine, _topic("relay-delete"), [(f"k{i}", b"v") for i in range(200)])
    relay = Relay(RelayConfig(database_url, kafka_bootstrap))
    try:
        with relay.engine.connect() as conn:
            ids = sorted(conn.execute(sa.text("SELECT id FROM outbox")).scalars())
            gone = [ids[i] for i in sorted(chosen)]
            outbox_delete_confirmed(conn, relay.sql, gone)
            left = set(conn.execute(sa.text("SELECT id FROM outbox")).scalars())
            conn.rollback()
    finally:
        relay.engine.dispose()
    assert left == set(ids) - set(gone)


def test_relay_refuses_a_different_lane_count(database_url: str, kafka_bootstrap: str) -> None:
    running = RelayThread(RelayConfig(database_url, kafka_bootstrap, lanes=8)).start()
    try:
        wait_for(lambda: running.relay.owned, 20, "first relay took no lanes")
        other = Relay(RelayConfig(database_url, kafka_bootstrap, lanes=16))
        with pytest.raises(ConfigurationError) as refused:
            other.run(once=True)
        assert "--lanes" in str(refused.value) and "[8]" in str(refused.value)
    finally:
        running.stop()


def test_idle_relay_wakes_on_commit_without_waiting_for_the_poll(
    database_url: str, kafka_bootstrap: str
) -> None:
    # 60 s poll and rebalance intervals (an idle relay wakes for either): only the wake-up
    # signal can bring the row out within the 20 s deadline.
    relay = RelayThread(
        RelayConfig(database_url, kafka_bootstrap, poll_interval=60, rebalance_interval=60)
    ).start()
    ob = Outbox(database_url)
    topic = _topic("relay-wakeup")
    try:
        # Idle: it has claimed once, found nothing, and now waits on the long timer.
        wait_for(relay.relay.idle.is_set, 20, "relay never went idle")
        with ob.unit_of_work(f"w-{uuid.uuid4()}") as uow:
            event = uow.publish(topic, b"ping", key="w")
        wait_for_records(kafka_bootstrap, topic, [event], timeout=20)
    finally:
        ob.close()
        relay.stop()


def test_a_failing_statement_keeps_the_session_and_its_lanes(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A statement error on a live session (here: the table is gone for a while) is not a
    database outage: the relay rolls back, backs off and retries on the same session, keeping
    its lanes; only a lost connection makes it reconnect."""
    caplog.set_level(logging.INFO, logger="outbox.relay")
    relay = RelayThread(
        RelayConfig(
            database_url,
            kafka_bootstrap,
            lanes=4,
            poll_interval=0.05,
            backoff_initial=0.05,
            backoff_max=0.2,
        )
    ).start()
    try:
        wait_for(lambda: len(relay.relay.owned) == 4, 20, "relay took no lanes")
        pid = relay.relay.pid
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE outbox RENAME TO outbox_away"))
        try:
            wait_for(lambda: "event=batch_failed" in caplog.text, 20, "no failed batch logged")
        finally:
            with engine.begin() as conn:
                conn.execute(sa.text("ALTER TABLE outbox_away RENAME TO outbox"))
        topic = _topic("relay-statement-error")
        ids = insert_rows(engine, topic, [("s", b"1"), ("s", b"2")])
        wait_for_records(kafka_bootstrap, topic, ids)
        assert relay.relay.pid == pid and len(relay.relay.owned) == 4
        assert "event=database_lost" not in caplog.text
    finally:
        relay.stop()
