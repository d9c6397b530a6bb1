"""The relay while a long transaction pins the xmin horizon: every row it deletes stays behind
as a dead tuple that VACUUM may not remove. Its claims must not walk them (docs/concepts.md I14)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import admin
from outbox.relay import RelayConfig, _claims as relay_loop
from tests.fixtures.common import wait_for
from tests.fixtures.relay import RelayThread, insert_rows, wait_for_records

# Bursts go through the relay under the pin (each row leaving a dead tuple behind), then one
# more whose claims are watched: each must start above the dead tuples, not at the index's low
# end. (How fast it drains under the pin, against unpinned: benchmarks/relay.py --pinned.)
BURST = 40_000
PINNED_ROWS = 240_000
BATCH = 1000

INSERT = sa.text(
    """
INSERT INTO outbox (event_id, topic, key, value, key_hash)
SELECT gen_random_uuid(), :topic, convert_to('customer-' || (g % 1000), 'UTF8'),
       convert_to(repeat('x', 100), 'UTF8'), g % 1000
FROM generate_series(1, :rows) g
"""
)


def _burst(engine: sa.Engine, relay: RelayThread, topic: str, rows: int) -> None:
    """Commit ``rows`` rows at once and wait until the relay sent them."""
    before = relay.relay.totals.confirmed
    with engine.begin() as conn:
        conn.execute(INSERT, {"topic": topic, "rows": rows})
    relay.relay.kick.set()
    wait_for(lambda: relay.relay.totals.confirmed >= before + rows, 120, "the burst to drain")


def _last_id(engine: sa.Engine) -> int:
    """The last outbox id handed out."""
    with engine.connect() as conn:
        return int(
            conn.exec_driver_sql(
                "SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id'))"
            ).scalar_one()
        )


def _pin(engine: sa.Engine, holder: str) -> sa.Connection:
    """A transaction holding the horizon on its own session: a REPEATABLE READ snapshot (a
    report, ``pg_dump``), or a transaction with an id of its own that writes elsewhere."""
    conn = engine.connect()
    conn.exec_driver_sql("SET application_name = 'horizon-pin'")
    conn.commit()
    if holder == "snapshot":
        conn.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.exec_driver_sql("SELECT count(*) FROM outbox").scalar_one()
    else:
        conn.exec_driver_sql("BEGIN")
        conn.exec_driver_sql("SELECT pg_current_xact_id()").scalar_one()
    return conn


def _dead_tuples_kept(engine: sa.Engine) -> int:
    """Dead outbox tuples a VACUUM now finds but may not remove."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM outbox")
        conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        return int(
            conn.exec_driver_sql(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'"
            ).scalar_one()
        )


def _status(engine: sa.Engine) -> admin.Status:
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        status = admin.read_status(conn, horizon_warning_seconds=0)
        conn.rollback()
    return status


@pytest.mark.parametrize("holder", ["snapshot", "writer elsewhere"])
def test_claims_start_above_the_dead_tuples_a_pinned_horizon_keeps_and_status_names_the_holder(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    holder: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    claims_from: list[int] = []  # where each claim's walk of the primary key starts

    def recorded(*args: Any, **kwargs: Any) -> Any:
        claims_from.append(kwargs.get("low", 0))
        return claim_batch(*args, **kwargs)

    claim_batch = relay_loop.outbox_claim_batch
    monkeypatch.setattr(relay_loop, "outbox_claim_batch", recorded)
    topic = f"relay-horizon-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(
        RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH, stats_interval=0.5)
    ).start()
    pin = None
    try:
        _burst(engine, relay, topic, BURST // 4)  # warm-up: topic metadata, first claims
        pin = _pin(engine, holder)
        for _ in range(PINNED_ROWS // BURST):
            _burst(engine, relay, topic, BURST)
        below = _last_id(engine)  # every row up to here was sent, and deleted under the pin
        claims_from.clear()
        _burst(engine, relay, topic, BURST)
        watched = list(claims_from)
        kept = _dead_tuples_kept(engine)
        pin_pid = int(pin.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        # The relay's /metrics name the holder (refreshed with its backlog figures).
        wait_for(
            lambda: f'pid="{pin_pid}"' in relay.relay.metrics.render().decode(),
            30,
            "the relay's metrics to name the holder of the horizon",
        )
        metrics = relay.relay.metrics.render().decode()
        status = _status(engine)
    finally:
        if pin is not None:
            pin.close()
        relay.stop()
    # The pin did its work: what the relay deleted under it is still there.
    assert kept >= PINNED_ROWS
    assert 'application_name="horizon-pin"' in metrics
    assert 'outbox_table_dead_tuples{table="outbox"}' in metrics
    # `outbox status` names it too, with a warning line, in text and JSON.
    text = admin.render_status(status)
    assert f"pid {pin_pid} (horizon-pin, idle in transaction" in text
    assert any(f"pid {pin_pid} (horizon-pin" in w for w in status.warnings)
    doc = admin.status_to_json(status)
    assert doc["horizon"]["pid"] == pin_pid
    assert doc["horizon"]["application_name"] == "horizon-pin"
    assert doc["horizon"]["kind"] == "transaction" and doc["horizon"]["started"]
    assert "query" not in doc["horizon"]
    outbox_table = next(t for t in doc["tables"] if t["table"] == "outbox")
    assert outbox_table["dead_tuples"] >= PINNED_ROWS
    # docs/concepts.md I14: the last burst's claims started above the dead tuples (at most one batch
    # below the last id sent before it), not at the index's low end, which would walk all of them.
    assert len(watched) >= BURST // BATCH, watched
    assert min(watched) >= below - BATCH, (
        f"a claim started at id {min(watched):,}, below {below - BATCH:,}: it walked up to "
        f"{below - min(watched):,} dead tuples of the {kept:,} the horizon keeps"
    )


def test_a_row_whose_transaction_commits_after_later_ids_went_out_is_still_sent(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Ids are drawn at INSERT and become visible at COMMIT: the claim's low-water mark must
    stay below the id of a writer that is still open while later ids are sent (no loss)."""
    topic = f"relay-late-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, batch_size=10)).start()
    late = engine.connect()
    try:
        late.begin()
        late_event = late.execute(
            sa.text(
                "INSERT INTO outbox (event_id, topic, key, value, key_hash) "
                "VALUES (gen_random_uuid(), :topic, 'late', 'v', 7) RETURNING event_id"
            ),
            {"topic": topic},
        ).scalar_one()
        later = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(50)])
        relay.relay.kick.set()
        wait_for_records(kafka_bootstrap, topic, later)
        # Every later row went out (several claims, each moving the mark) before this commit.
        wait_for(lambda: relay.relay.idle.is_set(), 30, "the relay to wait for work")
        late.commit()
        relay.relay.kick.set()
        wait_for_records(kafka_bootstrap, topic, [late_event])
    finally:
        late.close()
        relay.stop()


def test_one_row_at_a_time_moves_the_mark_every_advance_rows_without_reading_the_locks_each_claim(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay woken for every single row (a fleet's databases, a quiet service) reads the
    writers from pg_locks, a copy of every lock of the server, once per ADVANCE_ROWS rows, not
    on every claim; in between its claims start from the mark in force (facts checked), and the
    mark still moves, so a pinned horizon's dead tuples stay behind it."""
    readings = {"writers": 0, "facts": 0}
    claims_from: list[int] = []

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            readings[name] += 1
            return real(*args, **kwargs)

        return call

    def recorded(*args: Any, **kwargs: Any) -> Any:
        claims_from.append(kwargs.get("low", 0))
        return claim_batch(*args, **kwargs)

    claim_batch = relay_loop.outbox_claim_batch
    monkeypatch.setattr(relay_loop, "outbox_claim_batch", recorded)
    monkeypatch.setattr(
        relay_loop, "outbox_low_water", counted("writers", relay_loop.outbox_low_water)
    )
    monkeypatch.setattr(
        relay_loop,
        "outbox_low_water_facts",
        counted("facts", relay_loop.outbox_low_water_facts),
    )
    topic = f"relay-sparse-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, poll_interval=30.0)).start()
    pin = _pin(engine, "snapshot")
    rows = 3 * relay_loop.ADVANCE_ROWS
    sent = []
    try:
        first = None
        for i in range(rows):
            sent += insert_rows(engine, topic, [(f"k{i}", b"v")])
            relay.relay.kick.set()
            wait_for(
                lambda: _count(engine) == 0 and relay.relay.idle.is_set(),
                30,
                f"row {i} not sent",
            )
            if first is None:
                first = _last_id(engine)
                readings.update(writers=0, facts=0)
                claims_from.clear()
        wait_for_records(kafka_bootstrap, topic, sent)
    finally:
        pin.close()
        relay.stop()
    assert first is not None
    claims = readings["writers"] + readings["facts"]
    assert claims >= rows - 1, readings
    # The writers' reading once per ADVANCE_ROWS rows (and the odd claim that found nothing).
    assert readings["writers"] <= rows // relay_loop.ADVANCE_ROWS + 3, readings
    # The mark moved with the rows: the last claims start within ADVANCE_ROWS of the last id,
    # above the ids deleted under the pin since the first row.
    last = _last_id(engine)
    assert min(claims_from[-5:]) >= last - relay_loop.ADVANCE_ROWS - 2, (claims_from[-5:], last)
    assert min(claims_from[-5:]) > first


def _count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one())
