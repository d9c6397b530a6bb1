"""The errors the documentation promises, on the real database: a commit from the body through
the unit of work's session, an engine on another driver, a database without the toolkit's
tables, and the unit of work's session used after its block."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from outbox import (
    AsyncOutbox,
    ConfigurationError,
    Outbox,
    OutboxConfig,
    ReplayedWriteError,
    migrate,
)
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


def test_asyncpg_behind_a_transaction_pooler_is_refused_before_any_io(database_url: str) -> None:
    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    async_engine = create_async_engine(url)
    connected: list[object] = []
    sa.event.listen(async_engine.sync_engine.pool, "connect", lambda *a: connected.append(a))
    config = OutboxConfig(pooler="transaction")
    with pytest.raises(ConfigurationError, match=r"pooler='transaction' is not supported.*asyncpg"):
        AsyncOutbox(async_engine, config=config)
    assert connected == []


def test_an_asyncpg_url_is_refused_naming_the_engine_to_pass(database_url: str) -> None:
    url = database_url.replace("postgresql+psycopg://", "postgresql+asyncpg://")
    with pytest.raises(ConfigurationError, match=r"create_async_engine\("):
        AsyncOutbox(url)


@pytest.mark.parametrize("mode", ["owned", "connection", "session"])
@pytest.mark.parametrize("how", ["never migrated", "another schema"])
def test_a_database_without_the_tables_says_run_outbox_migrate(
    how: str, mode: str, engine: sa.Engine, database_url: str
) -> None:
    if how == "never migrated":
        migrate.downgrade(engine, "base")
        schema = None
    else:
        schema = "elsewhere"
    for _ in range(2):  # the hint also on a connection that already failed once
        with Outbox(database_url, schema=schema) as ob:
            hint = pytest.raises(ConfigurationError, match="run `outbox migrate`")
            if mode == "owned":
                with hint as caught, ob.unit_of_work("k-1"):
                    pass
            elif mode == "connection":
                with ob.engine.connect() as conn:
                    with hint as caught, ob.unit_of_work("k-1", connection=conn):
                        pass
                    assert conn.execute(sa.text("SELECT 1")).scalar() == 1  # still usable
            else:
                with Session(ob.engine) as session:
                    with hint as caught, ob.unit_of_work("k-1", session=session):
                        pass
                    assert session.execute(sa.text("SELECT 1")).scalar() == 1
    assert (schema or "search path") in str(caught.value)


@pytest.mark.parametrize("joined", [False, True])
def test_an_asyncio_unit_of_work_on_a_database_without_the_tables_says_run_outbox_migrate(
    joined: bool, engine: sa.Engine, database_url: str
) -> None:
    migrate.downgrade(engine, "base")

    async def attempt() -> None:
        aob = AsyncOutbox(database_url)
        try:
            hint = pytest.raises(ConfigurationError, match="run `outbox migrate`")
            if joined:
                async with aob.engine.connect() as conn:
                    with hint:
                        async with aob.unit_of_work("k-1", connection=conn):
                            pass
            else:
                with hint:
                    async with aob.unit_of_work("k-1"):
                        pass
        finally:
            await aob.close()

    asyncio.run(attempt())


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
