"""The window engine (``outbox-relay --engine window``) against real PostgreSQL and a broker:
what only it has to prove (the contract tests shared with the claim engine are parametrized over
both in test_relay.py and tests/faults/)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox._core import codec
from outbox._core.lanes import KIND_LANE, KIND_MEMBER, namespace
from outbox._pg import window as pg_window
from outbox._pg.window import Cursor, WindowStatements
from outbox.admin import discard_parked, list_parked, retry_parked
from outbox.errors import ConfigurationError
from outbox.relay import Relay, RelayConfig
from outbox.relay._engine import Reset
from outbox.relay._window import WindowEngine
from tests.fixtures.common import wait_for
from tests.fixtures.relay import (
    RelayThread,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
    wait_for_records,
)


def _topic(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _config(database_url: str, bootstrap: str, **kw: object) -> RelayConfig:
    return RelayConfig(database_url, bootstrap, engine="window", **kw)  # type: ignore[arg-type]


def _once(database_url: str, bootstrap: str, **kw: object) -> None:
    assert Relay(_config(database_url, bootstrap, **kw)).run(once=True) == 0


def _dead_tuples(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        return int(
            conn.exec_driver_sql(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'"
            ).scalar_one()
        )


INSERT_ONE = (
    "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
    "VALUES (%(e)s, %(t)s, %(k)s, %(v)s, '{}'::jsonb, %(h)s)"
)


def _row(topic: str, key: bytes, value: bytes) -> dict[str, object]:
    event_id = uuid.uuid4()
    return {"e": event_id, "t": topic, "k": key, "v": value, "h": codec.key_hash(key, b"")}


@pytest.fixture
def sessions(engine: sa.Engine) -> Iterator[tuple[sa.Connection, sa.Connection]]:
    a, b = engine.connect(), engine.connect()
    try:
        yield a, b
    finally:
        for conn in (a, b):
            conn.rollback()
            conn.close()


def test_window_delivers_in_key_order_and_gives_the_space_back_by_truncate(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = _topic("window-basic")
    ids = insert_rows(engine, topic, [(f"k{i % 3}", b"v%d" % i) for i in range(30)])
    ids += insert_rows(engine, topic, [(None, b"free")])
    before = _dead_tuples(engine)
    _once(database_url, kafka_bootstrap, batch_size=7)  # pages of 7 through one window
    records = wait_for_records(kafka_bootstrap, topic, ids)
    check_key_order(
        records,
        {f"k{k}".encode(): [str(ids[i]) for i in range(30) if i % 3 == k] for k in range(3)},
    )
    assert len(records) == len(ids)
    assert outbox_count(engine) == 0
    assert _dead_tuples(engine) <= before  # TRUNCATE: no dead tuple per row


@pytest.mark.parametrize("same_window", [False, True])
def test_a_later_commit_with_a_smaller_xid_goes_after_the_earlier_commit(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    sessions: tuple[sa.Connection, sa.Connection],
    same_window: bool,
) -> None:
    """The ordering hazard of transaction ids: B draws its xid first, then waits for the key's
    order lock that A holds; A writes its row and commits; B writes its row (a larger id) and
    commits. Ordered by xid B would go first; the window engine sends A first, whether the
    relay reads between the two commits or after both."""
    topic = _topic("window-xid-order")
    a, b = sessions
    lock = "SELECT pg_advisory_xact_lock(4242)"
    b.exec_driver_sql("SELECT pg_current_xact_id()")  # B's xid, drawn first
    a.exec_driver_sql(lock)
    row_a, row_b = _row(topic, b"k", b"A"), _row(topic, b"k", b"B")
    a.exec_driver_sql(INSERT_ONE, row_a)
    waiting = threading.Thread(target=lambda: b.exec_driver_sql(lock))
    waiting.start()
    a.commit()
    waiting.join(10)
    if not same_window:
        _once(database_url, kafka_bootstrap)  # B is still open: a window with A only
    b.exec_driver_sql(INSERT_ONE, row_b)
    b.commit()
    _once(database_url, kafka_bootstrap)
    records = wait_for_records(kafka_bootstrap, topic, [row_a["e"], row_b["e"]])
    assert [r.value for r in records] == [b"A", b"B"]


def test_a_long_writer_holds_back_neither_delivery_nor_its_own_row(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    sessions: tuple[sa.Connection, sa.Connection],
) -> None:
    """A transaction that wrote a row (it holds an xid, and the table's lock) stays open while
    others commit: their rows go out at once; its own goes out when it commits, with a smaller id
    than rows already sent; the space comes back only after it ended (TRUNCATE never waits)."""
    topic = _topic("window-long-writer")
    long, reader = sessions
    reader.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
    reader.exec_driver_sql("SELECT count(*) FROM outbox")  # a snapshot held, ACCESS SHARE too
    late = _row(topic, b"late", b"late")
    long.exec_driver_sql(INSERT_ONE, late)
    relay = RelayThread(_config(database_url, kafka_bootstrap, poll_interval=0.1)).start()
    try:
        early = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(20)])
        wait_for_records(kafka_bootstrap, topic, early)
        long.commit()
        wait_for_records(kafka_bootstrap, topic, [late["e"]])
        assert outbox_count(engine) > 0  # the reader's lock: no TRUNCATE, nothing waits
        reader.rollback()
        wait_for(lambda: outbox_count(engine) == 0, 20, "the space never came back")
    finally:
        relay.stop()
    records = read_topic(kafka_bootstrap, topic)
    assert len(records) == 21


def test_a_poison_row_holds_only_its_key_until_retried_or_discarded(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Across windows: the parked row's key waits (its rows in later windows too), the other keys
    flow; `outbox parked retry` sends it again, `discard` lets the rows behind it go, in order."""
    topic = _topic("window-poison")
    big = b"x" * 300_000
    kw = {"kafka_config": {"message.max.bytes": "100000"}}
    ids = insert_rows(engine, topic, [("p", b"p1"), ("p", big), ("o", b"o1")])
    _once(database_url, kafka_bootstrap, **kw)
    ids += insert_rows(engine, topic, [("p", b"p3"), ("o", b"o2")])  # a later window
    _once(database_url, kafka_bootstrap, **kw)
    with engine.connect() as conn:
        assert [p.event_id for p in list_parked(conn)] == [ids[1]]
    records = wait_for_records(kafka_bootstrap, topic, [ids[0], ids[2], ids[4]])
    assert str(ids[3]) not in {r.event_id for r in records}
    assert outbox_count(engine) == 2  # the parked row and p3 behind it
    with engine.begin() as conn:
        assert retry_parked(conn, event_ids=[ids[1]]) == 1
    _once(database_url, kafka_bootstrap, **kw)
    assert outbox_count(engine, parked=True) == 1  # parked again, p3 still waits
    with engine.begin() as conn:
        assert discard_parked(conn, event_ids=[ids[1]]) == 1
    _once(database_url, kafka_bootstrap, **kw)
    records = wait_for_records(kafka_bootstrap, topic, [ids[3]])
    check_key_order(records, {b"p": [str(ids[0]), str(ids[3])]})
    assert outbox_count(engine) == 0


def test_switching_from_the_claim_engine_keeps_its_parked_rows_parked(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """Rows the claim engine parked, and the rows waiting behind them, stay where they are when
    the window engine takes over; a retry then sends them in order."""
    topic = _topic("window-switch")
    ids = insert_rows(engine, topic, [("k", b"k1"), ("k", b"k2"), ("o", b"o1")])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET parked_at = now(), attempts = 10 WHERE event_id = :e"),
            {"e": ids[0]},
        )
    _once(database_url, kafka_bootstrap)
    wait_for_records(kafka_bootstrap, topic, [ids[2]])
    assert outbox_count(engine) == 2
    with engine.begin() as conn:
        assert retry_parked(conn) == 1
    _once(database_url, kafka_bootstrap)
    records = wait_for_records(kafka_bootstrap, topic, ids)
    check_key_order(records, {b"k": [str(ids[0]), str(ids[1])]})
    assert len(records) == 3


def test_switching_engines_back_and_forth_loses_nothing(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """claim -> window -> claim -> window on one outbox, rows written in between: every row
    reaches Kafka, in key order, and none twice (each switch as docs/relay.md says: stop the
    relays of one engine, then start the other's; leaving windows, a last --once run)."""
    topic = _topic("window-switch-back")
    ids: list[uuid.UUID] = []
    for step, engine_name in enumerate(["claim", "window", "claim", "window"]):
        ids += insert_rows(engine, topic, [(f"k{i % 4}", b"%d" % step) for i in range(12)])
        config = RelayConfig(database_url, kafka_bootstrap, engine=engine_name)
        assert Relay(config).run(once=True) == 0
        assert outbox_count(engine) == 0
    records = wait_for_records(kafka_bootstrap, topic, ids)
    assert len(records) == len(ids)
    check_key_order(
        records,
        {f"k{k}".encode(): [str(ids[i]) for i in range(48) if i % 4 == k] for k in range(4)},
    )


def test_a_cursor_ahead_of_the_server_is_refused(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """After a restore into another cluster the cursor may lie beyond the server's transaction
    ids: no row committed there would ever be sent, so the relay stops and says so."""
    insert_rows(engine, _topic("window-restore"), [("k", b"v")])
    _once(database_url, kafka_bootstrap)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_relay_windows SET delivered = '9000000000:9000000000:'")
    with pytest.raises(ConfigurationError, match="transaction ids went backwards"):
        _once(database_url, kafka_bootstrap)


def test_rows_from_another_cluster_are_refused(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    insert_rows(engine, _topic("window-future"), [("k", b"v")])
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox SET txid = '9000000000'::xid8")
    with pytest.raises(ConfigurationError, match="beyond the server"):
        _once(database_url, kafka_bootstrap)


def test_cursors_made_for_another_lane_count_are_refused(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    _once(database_url, kafka_bootstrap, lanes=4)
    with pytest.raises(ConfigurationError, match="made for 4 lanes"):
        _once(database_url, kafka_bootstrap, lanes=8)


def test_the_relay_role_of_the_deploy_script_runs_the_window_engine(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, relay_role: str
) -> None:
    """deploy/sql/relay-role.sql grants what the window engine needs (its cursors, held keys)."""
    relay_url = sa.make_url(database_url).set(username=relay_role)
    topic = _topic("window-role")
    ids = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(10)])
    _once(relay_url.render_as_string(hide_password=False), kafka_bootstrap)
    wait_for_records(kafka_bootstrap, topic, ids)
    assert outbox_count(engine) == 0


def test_metrics_show_the_window_backlog(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """/metrics: the rows not yet past the cursors (the table also holds delivered rows)."""
    topic = _topic("window-metrics")
    _once(database_url, kafka_bootstrap)  # cursors made, nothing pending

    def stats() -> dict[str, tuple[int, int, float]]:
        relay = Relay(_config(database_url, kafka_bootstrap))
        relay.lanes.owned = set(range(relay.config.lanes))
        assert isinstance(relay.batches, WindowEngine)
        try:
            with relay.engine.connect() as conn:
                return relay.batches.stats(conn)
        finally:
            relay.engine.dispose()

    insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(7)])
    assert stats() == {topic: (7, 0, pytest.approx(0.0, abs=60))}
    with engine.begin() as conn:  # delivered, not given back: no longer pending
        conn.exec_driver_sql("UPDATE outbox_relay_windows SET delivered = pg_current_snapshot()")
    assert stats() == {}
    assert outbox_count(engine) == 7


def test_a_page_read_ahead_is_dropped_when_lanes_are_given_away(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """The next page of a window is read while Kafka confirms the page before, for the lanes
    owned then. After a rebalance gave lanes away, that page is not sent: the lanes' new owner
    delivers them from the same cursor."""
    topic = _topic("window-rebalance")
    lanes = 4
    keys = [f"k{i}" for i in range(60)]
    _once(database_url, kafka_bootstrap, lanes=lanes)  # cursors made, nothing pending
    insert_rows(engine, topic, [(k, b"v") for k in keys])
    lane_of = {k.encode(): codec.key_hash(k.encode(), b"") % lanes for k in keys}
    relay = Relay(_config(database_url, kafka_bootstrap, batch_size=10, lanes=lanes))
    assert isinstance(relay.batches, WindowEngine)
    try:
        conn = relay.session.connect()
        relay.lanes.rebalance(conn)  # alone: it takes every lane
        assert relay.lanes.owned == set(range(lanes))
        assert relay.process_batch(conn).claimed == 10
        assert relay.batches._ahead is not None  # the window's next page, read ahead
        first = {r.key for r in read_topic(kafka_bootstrap, topic)}  # confirmed by now
        assert len(first) == 10
        relay.lanes.owned = {0, 1}  # what a rebalance leaves this relay
        relay.batches.reset(Reset.REBALANCE)
        assert relay.process_batch(conn).claimed > 0
    finally:
        relay.producing.close()
        relay.session.drop()
        relay.engine.dispose()
    later = [r.key for r in read_topic(kafka_bootstrap, topic) if r.key not in first]
    assert later, "the second batch sent nothing"
    assert {lane_of[key] for key in later} <= {0, 1}, "a given-away lane's row was sent"


@pytest.mark.parametrize(("running", "starting"), [("window", "claim"), ("claim", "window")])
def test_a_relay_of_the_other_engine_is_refused_and_the_running_one_keeps_serving(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, running: str, starting: str
) -> None:
    """Relays of both engines on one outbox would both send its rows: the second one refuses
    to start, naming the engine that runs, and the first one goes on delivering."""
    first = RelayThread(
        RelayConfig(database_url, kafka_bootstrap, engine=running, rebalance_interval=0.1)
    ).start()
    try:
        wait_for(lambda: first.relay.owned, 20, "first relay took no lanes")
        second = Relay(RelayConfig(database_url, kafka_bootstrap, engine=starting))
        with pytest.raises(ConfigurationError) as refused:
            second.run(once=True)
        message = str(refused.value)
        assert f"run --engine {running} (backend pid {first.relay.pid})" in message
        assert f"this one --engine {starting}" in message
        topic = _topic("window-mixed")
        ids = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(5)])
        assert len(wait_for_records(kafka_bootstrap, topic, ids)) == 5
        assert first.error is None and first.exit_code is None
    finally:
        first.stop()


def test_a_window_relay_stops_when_a_claim_relay_that_does_not_check_serves_lanes(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """A claim relay of a release before engines announced themselves takes its member and lane
    locks and nothing else: the window relay finds it serving at its next rebalance and stops."""
    relay = RelayThread(_config(database_url, kafka_bootstrap, lanes=4, rebalance_interval=0.1))
    relay.start()
    older = engine.connect()
    try:
        wait_for(lambda: len(relay.relay.owned) == 4, 20, "window relay took no lanes")
        schema = relay.relay.config.schema
        pid = older.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        older.execute(
            sa.text("SELECT pg_advisory_lock(:ns, :pid), pg_advisory_lock(:lane_ns, 99)"),
            {
                "ns": namespace(schema, KIND_MEMBER),
                "pid": pid,
                "lane_ns": namespace(schema, KIND_LANE),
            },
        )
        older.commit()
        wait_for(lambda: relay.error is not None, 20, "window relay did not stop")
        assert isinstance(relay.error, ConfigurationError)
        assert f"run --engine claim (backend pid {pid})" in str(relay.error)
    finally:
        older.close()
        relay.relay.stop()


def test_the_rows_a_held_key_owes_are_found_through_the_key_index(engine: sa.Engine) -> None:
    """HELD_OWED runs before every batch of a lane with a held key: it must not scan the whole
    outbox (backlog and delivered rows) for each one (migration 0008)."""
    sql = WindowStatements.for_schema(None)
    params = {"lanes": 32, "owned": list(range(32)), "delivered": "1:1:", "opened": None, "done": 0}
    with engine.connect() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
            "SELECT gen_random_uuid(), 't', convert_to('k' || g %% 2000, 'UTF8'), 'v', '{}', "
            "g %% 2000 FROM generate_series(1, 20000) g"
        )
        conn.exec_driver_sql(
            "INSERT INTO outbox_relay_held SELECT id, key_hash, key FROM outbox WHERE id <= 3"
        )
        conn.commit()
        conn.exec_driver_sql("ANALYZE outbox")
        conn.exec_driver_sql("ANALYZE outbox_relay_held")
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cur:
            cur.execute(f"EXPLAIN {sql.owed}", params)
            plan = "\n".join(row[0] for row in cur.fetchall())
        conn.rollback()
    assert "ix_outbox_key_hash" in plan, plan
    assert "Seq Scan on outbox o" not in plan, plan


def _window_of_generated_rows(conn: sa.Connection, sql: WindowStatements, rows: int) -> Cursor:
    """A delivered snapshot, ``rows`` rows committed after it (key_hash = g % 32), and the
    window they are in, opened over every lane. The table is ANALYZEd before the rows come, as
    a burst finds it: its statistics know nothing of the window's transaction."""
    conn.exec_driver_sql("ANALYZE outbox")
    delivered = conn.exec_driver_sql("SELECT pg_current_snapshot()::text").scalar_one()
    conn.commit()
    conn.exec_driver_sql(
        "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
        "SELECT gen_random_uuid(), 't', convert_to('k' || g, 'UTF8'), 'v', '{}', g %% 32 "
        f"FROM generate_series(1, {rows}) g"
    )
    conn.commit()
    opened = pg_window.window_open(conn, sql, 32, list(range(32)), Cursor(delivered, None, 0, 0))
    conn.commit()
    assert opened.rows == rows and opened.low is not None and opened.high is not None
    return Cursor(delivered, opened.window, opened.low - 1, opened.high)


def test_a_page_walks_the_primary_key_and_not_the_whole_window(engine: sa.Engine) -> None:
    """A page of a large window reads about a page of rows: given the whole window's id range,
    the planner scanned and sorted all of the window's rows for each page (and, statistics
    ending before the window's transaction, walked them through the txid index)."""
    sql = WindowStatements.for_schema(None)
    with engine.connect() as conn:
        # Delivered rows of an earlier window, in the statistics; the window's are not.
        conn.exec_driver_sql(
            "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
            "SELECT gen_random_uuid(), 't', 'k', 'v', '{}', 0 FROM generate_series(1, 20000)"
        )
        conn.commit()
        cursor = _window_of_generated_rows(conn, sql, 20000)
        params = {
            "lanes": 32,
            "owned": list(range(32)),
            "delivered": cursor.delivered,
            "opened": cursor.opened,
            "done": cursor.done,
            "end": cursor.done + 1000,
            "batch_size": 500,
        }
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cur:
            cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql.page}", params)
            plan = cur.fetchone()[0][0]["Plan"]  # type: ignore[index]
        conn.rollback()
    nodes = [plan, *plan.get("Plans", [])]
    assert any(n.get("Index Name") == "outbox_pkey" for n in nodes), plan
    assert all(n["Node Type"] != "Sort" for n in nodes), plan
    scanned = sum(n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) for n in nodes[1:])
    assert scanned <= 1000, plan


def test_pages_of_a_few_lanes_among_many_return_each_row_once_in_id_order(
    engine: sa.Engine,
) -> None:
    """A relay that owns 2 lanes of 32 reads its window's rows among 15 times as many of other
    lanes: the ranges a page reads grow until the page is full, and the pages together are the
    window's rows of those lanes, each once, in id order."""
    sql = WindowStatements.for_schema(None)
    owned = [3, 17]
    with engine.connect() as conn:
        cursor = _window_of_generated_rows(conn, sql, 3200)
        wanted = [
            int(i)
            for (i,) in conn.exec_driver_sql(
                "SELECT id FROM outbox WHERE key_hash %% 32 IN (3, 17) ORDER BY id"
            )
        ]
        conn.commit()
        got: list[int] = []
        sizes: list[int] = []
        while True:
            page = pg_window.window_page(conn, sql, 32, owned, cursor, 30)
            conn.commit()
            got += [row[0] for row in page]
            sizes.append(len(page))
            if len(page) < 30:
                break
            cursor = Cursor(cursor.delivered, cursor.opened, page[-1][0], cursor.high)
    assert got == wanted
    assert len(wanted) == 200 and sizes == [30] * 6 + [20]


def test_the_backlog_reads_the_cursors_once_not_once_per_row(engine: sa.Engine) -> None:
    """WINDOW_STATS runs on the relay's loop every stats interval: under a held horizon every
    cursor write leaves a version of its row behind, and a lookup of the cursor per pending row
    walked them all (minutes for a 300,000-row backlog, the relay's loop held that long)."""
    sql = WindowStatements.for_schema(None)
    with engine.connect() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
            "SELECT gen_random_uuid(), 't', 'k', 'v', '{}', g %% 32 FROM generate_series(1, 5000) g"
        )
        conn.exec_driver_sql(
            "INSERT INTO outbox_relay_windows (lane, lanes, delivered) "
            "SELECT g, 32, '1:1:' FROM generate_series(0, 31) g"
        )
        conn.commit()
        conn.exec_driver_sql("ANALYZE outbox")
        params = {"lanes": 32, "owned": list(range(32)), "floor": "1"}
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cur:
            cur.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql.stats}", params)
            plan = cur.fetchone()[0][0]["Plan"]  # type: ignore[index]
        conn.rollback()

    def scans(node: dict[str, Any]) -> list[tuple[str, int]]:
        found = []
        if "Relation Name" in node:
            found.append((str(node["Relation Name"]), int(node["Actual Loops"])))
        for child in node.get("Plans", []):
            found += scans(child)
        return found

    cursor_scans = [loops for name, loops in scans(plan) if name == "outbox_relay_windows"]
    assert cursor_scans == [1], plan
