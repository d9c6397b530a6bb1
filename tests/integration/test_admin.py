"""``outbox status`` and ``outbox gc`` against real PostgreSQL (and a real relay and broker)."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import Outbox, PermanentError, admin, cli, migrate
from outbox._core import environment, lanes
from outbox._pg.lanes import register, try_acquire
from outbox.relay import RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.relay import RelayThread, insert_rows, outbox_count

DAY = 86400.0


def _status_json(capsys: pytest.CaptureFixture[str], database_url: str, *extra: str) -> Any:
    code = cli.main(["status", "--database-url", database_url, "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _seed_keys(engine: sa.Engine, scope: str, completed: int, failed: int, prefix: str) -> None:
    """Completed and failed keys written through the real unit of work."""
    ob = Outbox(engine)
    try:
        for i in range(completed):
            with ob.unit_of_work(f"{prefix}-ok-{i}", scope=scope) as uow:
                uow.result = {"i": i}
        for i in range(failed):
            with (
                pytest.raises(PermanentError),
                ob.unit_of_work(f"{prefix}-bad-{i}", scope=scope),
            ):
                raise PermanentError("card declined")
    finally:
        ob.close()


def _age_keys(engine: sa.Engine, like: str, days: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE idempotency_keys SET updated_at = now() - make_interval(secs => :s) "
                "WHERE key LIKE :like"
            ),
            {"s": days * DAY, "like": like},
        )


def test_status_reports_backlog_parked_keys_and_lane_owners(
    engine: sa.Engine, database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = [f"cust-{i}" for i in range(12)]
    orders = insert_rows(engine, "orders", [(k, b"{}") for k in keys for _ in range(2)])
    insert_rows(engine, "payments", [(None, b"{}") for _ in range(5)])
    with engine.begin() as conn:
        # Two parked rows of "orders"; and the oldest pending row is an hour old.
        conn.execute(
            sa.text("UPDATE outbox SET parked_at = now(), last_error = 'too large' "
                    "WHERE event_id = ANY(:ids)"),
            {"ids": orders[:2]},
        )  # fmt: skip
        conn.execute(
            sa.text("UPDATE outbox SET created_at = now() - interval '1 hour' "
                    "WHERE event_id = :id"),
            {"id": orders[5]},
        )  # fmt: skip
        expected_lanes: Counter[tuple[int, bool]] = Counter(
            (lanes.lane_of(int(r.key_hash), 4), r.parked_at is not None)
            for r in conn.execute(sa.text("SELECT key_hash, parked_at FROM outbox"))
        )
    _seed_keys(engine, "billing", completed=4, failed=2, prefix="b")
    _seed_keys(engine, "shipping", completed=3, failed=0, prefix="s")

    # A session that takes the relay's advisory locks exactly as outbox-relay does.
    holder = sa.create_engine(
        database_url,
        poolclass=sa.pool.NullPool,
        connect_args={"application_name": lanes.APPLICATION_NAME},
    )
    try:
        with holder.connect() as conn:
            pid = register(conn, None, 4)
            assert try_acquire(conn, None, [0, 1]) == [0, 1]
            conn.commit()
            doc = _status_json(capsys, database_url)
            human_code = cli.main(["status", "--database-url", database_url])
            human = capsys.readouterr().out
    finally:
        holder.dispose()

    assert human_code == 0
    assert doc["version"] == 1
    assert doc["migration"] == {
        "current": migrate.head_revision(),
        "head": migrate.head_revision(),
        "up_to_date": True,
    }
    assert doc["outbox"]["pending"] == 27 and doc["outbox"]["parked"] == 2
    topics = {t["topic"]: t for t in doc["outbox"]["topics"]}
    assert (topics["orders"]["pending"], topics["orders"]["parked"]) == (22, 2)
    assert (topics["payments"]["pending"], topics["payments"]["parked"]) == (5, 0)
    assert 3590 <= doc["outbox"]["oldest_pending_age_seconds"] < 3700
    assert topics["orders"]["oldest_pending_age_seconds"] >= 3590
    assert topics["payments"]["oldest_pending_age_seconds"] < 600

    assert doc["lanes"]["count"] == 4 and doc["lanes"]["source"] == "relays"
    assert doc["lanes"]["announced_by_relays"] == [4]
    got_lanes = {
        b["lane"]: (b["pending"], b["parked"], b["owner_pid"]) for b in doc["lanes"]["backlog"]
    }
    for lane in range(4):
        want = (expected_lanes[(lane, False)], expected_lanes[(lane, True)])
        if want == (0, 0):
            assert lane not in got_lanes
        else:
            assert got_lanes[lane] == (*want, pid if lane in (0, 1) else None)

    assert doc["idempotency_keys"]["total"] == 9
    assert doc["idempotency_keys"]["by_status"] == {"completed": 7, "failed": 2, "started": 0}
    assert doc["idempotency_keys"]["by_scope"] == [
        {"scope": "billing", "status": "completed", "count": 4},
        {"scope": "billing", "status": "failed", "count": 2},
        {"scope": "shipping", "status": "completed", "count": 3},
    ]
    assert doc["relays"] == [
        {
            "pid": pid,
            "application_name": "outbox-relay",
            "client_addr": "127.0.0.1",
            "lanes": [0, 1],
            "engine": "claim",
        }
    ]
    assert any("outbox parked list" in w for w in doc["warnings"])

    assert "pending 27  parked 2" in human
    assert "RELAYS  alive 1" in human
    assert "completed 7  failed 2" in human

    # With the relay gone its locks are gone, and status says nothing serves the backlog.
    doc = _status_json(capsys, database_url)
    assert doc["relays"] == [] and doc["lanes"]["source"] == "default"
    assert any("no relay is running" in w for w in doc["warnings"])
    # --lanes splits the backlog the way relays with that setting would.
    doc = _status_json(capsys, database_url, "--lanes", "1")
    assert doc["lanes"]["backlog"] == [{"lane": 0, "pending": 27, "parked": 2, "owner_pid": None}]


@pytest.mark.slow
def test_status_shows_a_running_relay_holding_every_lane_and_the_backlog_draining(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = f"admin-status-{uuid.uuid4().hex[:8]}"
    insert_rows(engine, topic, [(f"k{i % 7}", b"x") for i in range(40)])
    relay = RelayThread(
        RelayConfig(database_url, kafka_bootstrap, lanes=3, poll_interval=0.2)
    ).start()
    try:
        wait_for(lambda: outbox_count(engine) == 0, 60, "the relay did not drain the outbox")

        def relay_holds_all_lanes() -> bool:
            doc = _status_json(capsys, database_url)
            return [r["lanes"] for r in doc["relays"]] == [[0, 1, 2]]

        wait_for(relay_holds_all_lanes, 30, "status never showed one relay holding lanes 0-2")
        doc = _status_json(capsys, database_url)
        assert doc["lanes"] == {
            "count": 3, "source": "relays", "announced_by_relays": [3], "backlog": []
        }  # fmt: skip
        assert doc["outbox"]["pending"] == 0 and doc["outbox"]["oldest_pending_age_seconds"] is None
        assert doc["warnings"] == []
    finally:
        relay.stop()
    doc = _status_json(capsys, database_url)
    assert doc["relays"] == []


def test_status_of_an_unmigrated_database_says_to_migrate(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate.downgrade(database_url, "base")
    assert cli.main(["status", "--database-url", database_url]) == 1
    assert "run `outbox migrate` first" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ gc


def _keys(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT key FROM idempotency_keys")).scalars())


def test_gc_deletes_only_expired_keys_in_batches(engine: sa.Engine) -> None:
    _seed_keys(engine, "billing", completed=20, failed=3, prefix="old")
    _seed_keys(engine, "billing", completed=6, failed=1, prefix="young")
    _seed_keys(engine, "billing", completed=2, failed=0, prefix="edge")
    _age_keys(engine, "old-%", days=10)
    _age_keys(engine, "edge-%", days=6.9)  # just inside a 7-day retention: kept
    before = _keys(engine)

    dry = admin.run_gc(engine, 7 * DAY, dry_run=True)
    assert (dry.candidates, dry.deleted, dry.batches) == (23, 0, 0)
    assert _keys(engine) == before

    seen: list[int] = []
    result = admin.run_gc(engine, 7 * DAY, batch_size=5)
    assert (result.candidates, result.deleted, result.batches) == (23, 23, 5)
    assert _keys(engine) == {k for k in before if not k.startswith("old-")}
    assert len(_keys(engine)) == 9

    again = admin.delete_expired_keys(
        engine, result.cutoff, batch_size=5, progress=lambda done, n: seen.append(n)
    )
    assert again == (0, 1) and seen == [0]


def test_gc_by_scope_leaves_other_scopes(engine: sa.Engine) -> None:
    _seed_keys(engine, "billing", completed=3, failed=0, prefix="old-b")
    _seed_keys(engine, "shipping", completed=4, failed=0, prefix="old-s")
    _age_keys(engine, "old-%", days=30)
    result = admin.run_gc(engine, 7 * DAY, scope="shipping")
    assert result.deleted == 4
    assert _keys(engine) == {f"old-b-ok-{i}" for i in range(3)}


def test_gc_skips_rows_a_live_transaction_holds_and_never_waits(engine: sa.Engine) -> None:
    _seed_keys(engine, "billing", completed=12, failed=0, prefix="old")
    _age_keys(engine, "old-%", days=10)
    outcome: dict[str, Any] = {}
    with engine.connect() as live:
        # A transaction holding one expired key's row (e.g. updating it) and staying open.
        live.execute(sa.text("SELECT 1 FROM idempotency_keys WHERE key = 'old-ok-3' FOR UPDATE"))

        def gc() -> None:
            outcome["result"] = admin.run_gc(engine, 7 * DAY, batch_size=4)

        worker = threading.Thread(target=gc, daemon=True)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "gc waited for a row lock held by a live transaction"
        assert outcome["result"].deleted == 11
        assert _keys(engine) == {"old-ok-3"}
        live.rollback()
    assert admin.run_gc(engine, 7 * DAY).deleted == 1
    assert _keys(engine) == set()


def test_gc_cli_refuses_short_retention_and_deletes_nothing(
    engine: sa.Engine,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        environment.ENV_CACHE_TTL,
        environment.ENV_MIN_REDELIVERY_WINDOW,
        environment.ENV_RETENTION,
    ):
        monkeypatch.delenv(name, raising=False)
    _seed_keys(engine, "billing", completed=5, failed=0, prefix="old")
    _age_keys(engine, "old-%", days=3)
    base = ["gc", "--database-url", database_url]
    assert cli.main([*base, "--older-than", "2d"]) == 3
    assert "redelivery window" in capsys.readouterr().err
    assert len(_keys(engine)) == 5

    assert cli.main([*base, "--older-than", "2d", "--min-redelivery-window", "2d", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["candidates"], doc["deleted"], doc["dry_run"]) == (5, 5, False)
    assert doc["older_than_seconds"] == 2 * DAY
    assert _keys(engine) == set()


def _updated_at_index_reads(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sa.text(
                    "SELECT idx_tup_read FROM pg_stat_user_indexes "
                    "WHERE indexrelname = 'ix_idempotency_keys_updated_at'"
                )
            ).scalar_one()
        )


def test_gc_batches_do_not_walk_the_keys_deleted_before_them(
    engine: sa.Engine, database_url: str
) -> None:
    """While a long transaction holds the xmin horizon, the keys gc deleted stay in the
    updated_at index as dead entries: each batch starts where the previous one ended, so the
    index entries read stay about one per key instead of growing with every batch."""
    keys, batch = 20_000, 500
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO idempotency_keys (scope, key, status, updated_at) "
                "SELECT 'billing', 'old-' || g, 'completed', "
                "now() - interval '10 days' + g * interval '1 ms' "
                "FROM generate_series(1, :n) g"
            ),
            {"n": keys},
        )
    gc_engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)  # stats at exit
    pin = engine.connect()
    try:
        pin.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pin.exec_driver_sql("SELECT count(*) FROM idempotency_keys").scalar_one()
        with gc_engine.connect() as conn:
            cutoff = admin.gc_cutoff(conn, 7 * DAY)
        before = _updated_at_index_reads(engine)
        deleted, batches = admin.delete_expired_keys(gc_engine, cutoff, batch_size=batch)
        # Every backend of gc_engine has ended and flushed its statistics.
        read = _updated_at_index_reads(engine) - before
    finally:
        pin.close()
        gc_engine.dispose()
    assert (deleted, batches) == (keys, keys // batch + 1)
    assert read <= 2 * keys, f"{read:,} index entries read to delete {keys:,} keys"
