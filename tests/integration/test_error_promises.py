"""The errors the documentation promises, on the real database: a commit from the body through
the unit of work's session, an engine on another driver, a database without the toolkit's
tables, and the unit of work's session used after its block."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import AsyncOutbox, ConfigurationError, Outbox, ReplayedWriteError, migrate
from outbox.errors import TransactionEndedError
from tests.fixtures.uow import INSERT_ORDER, count, create_orders


def test_session_commit_in_the_body_is_refused_and_nothing_commits(
    engine: sa.Engine, database_url: str
) -> None:
    create_orders(engine)
    with Outbox(database_url) as ob:
        refused = pytest.raises(TransactionEndedError, match=r"uow\.session\.commit\(\)")
        with refused, ob.unit_of_work("k-commit") as uow:
            uow.session.execute(INSERT_ORDER, {"k": "k-commit", "a": 1})
            uow.session.commit()
        assert count(engine, "orders") == 0
        assert count(engine, "idempotency_keys") == 0
        with ob.unit_of_work("k-commit") as uow:  # the key stayed free
            assert not uow.replayed


def test_async_session_commit_in_the_body_is_refused(engine: sa.Engine, database_url: str) -> None:
    create_orders(engine)

    async def main() -> None:
        async with AsyncOutbox(database_url) as aob:
            refused = pytest.raises(TransactionEndedError, match=r"uow\.session\.commit\(\)")
            with refused:
                async with aob.unit_of_work("k-async") as uow:
                    await uow.session.execute(INSERT_ORDER, {"k": "k-async", "a": 1})
                    await uow.session.commit()

    asyncio.run(main())
    assert count(engine, "orders") == 0 and count(engine, "idempotency_keys") == 0


def test_an_asyncpg_engine_is_refused_before_any_io(database_url: str) -> None:
    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    async_engine = create_async_engine(url)
    connected: list[object] = []
    sa.event.listen(async_engine.sync_engine.pool, "connect", lambda *a: connected.append(a))
    with pytest.raises(ConfigurationError, match=r"psycopg 3 driver.*postgresql\+asyncpg"):
        AsyncOutbox(async_engine)
    assert connected == []


@pytest.mark.parametrize("how", ["never migrated", "another schema"])
def test_a_database_without_the_tables_says_run_outbox_migrate(
    how: str, engine: sa.Engine, database_url: str
) -> None:
    if how == "never migrated":
        migrate.downgrade(engine, "base")
        schema = None
    else:
        schema = "elsewhere"
    for _ in range(2):  # the hint also on a connection that already failed once
        with Outbox(database_url, schema=schema) as ob:
            hint = pytest.raises(ConfigurationError, match="run `outbox migrate`")
            with hint as caught, ob.unit_of_work("k-1"):
                pass
    assert (schema or "search path") in str(caught.value)


def test_the_session_after_the_block_says_the_unit_of_work_ended(database_url: str) -> None:
    with Outbox(database_url) as ob:
        with ob.unit_of_work("k-after") as uow:
            uow.result = {"ok": True}
        for read in (lambda: uow.session, lambda: uow.connection):
            with pytest.raises(TransactionEndedError, match="after the unit of work ended"):
                read()
        with ob.unit_of_work("k-after") as replayed:
            assert replayed.replayed
        with pytest.raises(ReplayedWriteError):  # a replay still says it is one
            _ = replayed.session
