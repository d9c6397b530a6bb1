"""`outbox status` with the window engine: the lanes' cursors, their backlog and held rows, and
each live relay's engine (against real PostgreSQL and a broker)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from outbox import admin, cli, migrate
from outbox._core.lanes import KIND_MEMBER, namespace
from outbox.relay import Relay, RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.console import ConsoleServer
from tests.fixtures.relay import RelayThread, insert_rows, wait_for_records


def _status_json(capsys: pytest.CaptureFixture[str], database_url: str) -> dict[str, Any]:
    assert cli.main(["status", "--json", "--database-url", database_url]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _window_once(database_url: str, bootstrap: str) -> None:
    config = RelayConfig(database_url, bootstrap, engine="window", lanes=4)
    assert Relay(config).run(once=True) == 0


def test_status_shows_the_window_lanes_backlog_and_held_rows(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = f"status-window-{uuid.uuid4().hex[:8]}"
    assert _status_json(capsys, database_url)["windows"] is None  # no window relay ran yet
    parked, *rest = insert_rows(engine, topic, [("held", b"1"), ("held", b"2"), ("free", b"3")])
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET parked_at = now(), attempts = 10 WHERE event_id = :e"),
            {"e": parked},
        )
    _window_once(database_url, kafka_bootstrap)  # "free" goes out; "held" waits behind its row
    wait_for_records(kafka_bootstrap, topic, [rest[1]])
    later = insert_rows(engine, topic, [(f"new{i}", b"v") for i in range(3)])
    with engine.begin() as conn:  # one lane's cursor inside a window
        conn.exec_driver_sql(
            "UPDATE outbox_relay_windows SET opened = delivered, done_id = 7, high_id = 9 "
            "WHERE lane = 0"
        )

    doc = _status_json(capsys, database_url)
    windows = doc["windows"]
    assert windows["lanes"] == 4
    assert windows["held"] == 1  # the parked row holds its key
    assert windows["backlog"] == len(later)  # not the held key's rows: behind the cursor
    # The held key's second row: owed, past the cursor, still in the table.
    assert windows["past_cursors"] == doc["outbox"]["pending"] - len(later) == 1
    assert doc["lanes"]["count"] == 4 and doc["lanes"]["source"] == "windows"
    by_lane = {w["lane"]: w for w in windows["by_lane"]}
    assert sorted(by_lane) == [0, 1, 2, 3]
    assert sum(w["backlog"] for w in by_lane.values()) == len(later)
    assert all(w["delivered"] and w["xids_behind"] >= 0 for w in by_lane.values())
    assert max(w["xids_behind"] for w in by_lane.values()) >= len(later)
    assert by_lane[0]["window_in_progress"] and by_lane[0]["window_high_id"] == 9
    assert not by_lane[1]["window_in_progress"] and by_lane[1]["window_done_id"] is None
    oldest = [w["oldest_pending_age_seconds"] for w in by_lane.values() if w["backlog"]]
    assert oldest and all(0 <= age < 60 for age in oldest)

    assert cli.main(["status", "--database-url", database_url]) == 0
    human = capsys.readouterr().out
    assert f"WINDOWS  lanes 4  backlog {len(later)}  held 1" in human
    assert "open, sent to id 7/9" in human
    assert "LANES  4 (from windows)" in human
    assert "XIDS BEHIND" in human


def test_status_names_each_live_relays_engine_and_warns_of_mixed_engines(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    running = RelayThread(RelayConfig(database_url, kafka_bootstrap, engine="window", lanes=4))
    running.start()
    older = engine.connect()
    try:
        wait_for(lambda: running.relay.owned, 20, "the window relay took no lanes")
        with engine.connect() as conn:
            status = admin.read_status(conn)
            conn.rollback()
        assert [(r.pid, r.engine) for r in status.relays] == [(running.relay.pid, "window")]
        assert status.window_relays
        assert not [w for w in status.warnings if "engine" in w]
        assert "ENGINE" in admin.render_status(status)
        # A relay of an earlier release registers without an engine lock: a claim relay.
        pid = older.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        older.execute(
            sa.text("SELECT pg_advisory_lock(:ns, :pid)"),
            {"ns": namespace(None, KIND_MEMBER), "pid": pid},
        )
        older.commit()
        with engine.connect() as conn:
            status = admin.read_status(conn)
            conn.rollback()
        assert {r.pid: r.engine for r in status.relays} == {
            running.relay.pid: "window",
            pid: "claim",
        }
        assert [w for w in status.warnings if "more than one engine are alive (claim, window)" in w]
    finally:
        older.close()
        running.stop()


def test_the_console_overview_shows_the_window_lanes(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    console_server: Callable[..., ConsoleServer],
) -> None:
    server = console_server()
    with httpx.Client(base_url=server.url) as client:
        before = client.get("/")
        assert before.status_code == 200
        assert 'id="windows"' not in before.text  # no window relay ran yet
        topic = f"console-window-{uuid.uuid4().hex[:8]}"
        parked, _ = insert_rows(engine, topic, [("held", b"1"), ("held", b"2")])
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE outbox SET parked_at = now(), attempts = 10 WHERE event_id = :e"),
                {"e": parked},
            )
        _window_once(database_url, kafka_bootstrap)
        insert_rows(engine, topic, [(f"new{i}", b"v") for i in range(4)])
        page = client.get("/")
    assert page.status_code == 200
    assert re.search(r'id="window-backlog">4<', page.text)
    assert re.search(r'id="window-held">1<', page.text)
    window_rows = page.text.split('id="windows"')[1].split("</table>")[0]
    lanes = re.findall(r'<tr><td class="num">(\d+)</td><td class="num">(\d+)</td>', window_rows)
    assert [lane for lane, _ in lanes] == ["0", "1", "2", "3"]
    assert sum(int(n) for _, n in lanes) == 4


def test_status_of_a_schema_before_the_window_tables_reports_no_windows(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.downgrade(database_url, "0006")
    doc = _status_json(capsys, database_url)
    assert doc["windows"] is None
    assert doc["migration"]["current"] == "0006"
    assert any("run `outbox migrate`" in w for w in doc["warnings"])
