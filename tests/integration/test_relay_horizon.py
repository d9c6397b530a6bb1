"""The relay while a long transaction pins the xmin horizon: every row it deletes stays behind
as a dead tuple that VACUUM may not remove. Its claims must not walk them (DESIGN.md I14)."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from outbox import admin
from outbox.relay import RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.relay import RelayThread, insert_rows, wait_for_records

# One burst is timed unpinned and once more after this many rows went through the relay under
# the pin (each leaving a dead tuple behind). A small batch makes each claim's share of a row's
# cost large, so that a claim that walked the dead tuples would show at a few hundred thousand.
BURST = 40_000
PINNED_ROWS = 240_000
BATCH = 1000
# The pinned burst's drain rate over the unpinned one. A claim that walks the dead tuples drains
# at ~0.2x here; the low-water claim at ~1x. The bound leaves room for a loaded 2-core machine.
MIN_RATIO = 0.6

INSERT = sa.text(
    """
INSERT INTO outbox (event_id, topic, key, value, key_hash)
SELECT gen_random_uuid(), :topic, convert_to('customer-' || (g % 1000), 'UTF8'),
       convert_to(repeat('x', 100), 'UTF8'), g % 1000
FROM generate_series(1, :rows) g
"""
)


def _burst(engine: sa.Engine, relay: RelayThread, topic: str, rows: int) -> float:
    """Commit ``rows`` rows at once and return how many the relay sent per second."""
    before = relay.relay.totals.confirmed
    with engine.begin() as conn:
        conn.execute(INSERT, {"topic": topic, "rows": rows})
    relay.relay.kick.set()
    started = time.perf_counter()
    wait_for(lambda: relay.relay.totals.confirmed >= before + rows, 120, "the burst to drain")
    return rows / (time.perf_counter() - started)


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
def test_drain_holds_its_speed_while_the_horizon_is_pinned_and_status_names_the_holder(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, holder: str
) -> None:
    topic = f"relay-horizon-{uuid.uuid4().hex[:8]}"
    relay = RelayThread(
        RelayConfig(database_url, kafka_bootstrap, batch_size=BATCH, stats_interval=0.5)
    ).start()
    pin = None
    try:
        _burst(engine, relay, topic, BURST // 4)  # warm-up: topic metadata, first claims
        unpinned = _burst(engine, relay, topic, BURST)
        pin = _pin(engine, holder)
        for _ in range(PINNED_ROWS // BURST):
            _burst(engine, relay, topic, BURST)
        pinned = _burst(engine, relay, topic, BURST)
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
    assert pinned / unpinned >= MIN_RATIO, (
        f"drain under a pinned horizon {pinned:,.0f} rows/s, unpinned {unpinned:,.0f} rows/s "
        f"({pinned / unpinned:.2f}x) with {kept:,} dead tuples"
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
