"""A unit of work joined to a caller's psycopg connection sets its savepoint with the driver, in
one message with the key's claim, and releases it in one message with the final statement
(outbox._pg.savepoint_async). What the caller sees of its transaction stays as with
SQLAlchemy's own savepoint: a failed body rolls back to it and nothing else, a savepoint the
body opens inside it ends there, and an already failed transaction is reported, not hidden."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from tests.fixtures.uow import count, create_orders, rows

INSERT_ORDER = sa.text("INSERT INTO orders (order_key, amount) VALUES (:k, 1)")


def _orders(engine: sa.Engine) -> list[str]:
    return sorted(r[0] for r in rows(engine, "SELECT order_key FROM orders"))


def test_a_failed_body_rolls_back_to_the_savepoint_only(engine: sa.Engine) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob, engine.connect() as conn:
        conn.execute(INSERT_ORDER, {"k": "before"})
        with pytest.raises(ValueError), ob.unit_of_work("k", connection=conn) as uow:
            conn.execute(INSERT_ORDER, {"k": "inside"})
            uow.publish("t", b"x")
            raise ValueError("transient")
        # The key's lock went with the savepoint: another attempt runs while the caller's
        # transaction is still open.
        with ob.unit_of_work("k") as other:
            assert not other.replayed
            other.result = "other"
        conn.execute(INSERT_ORDER, {"k": "after"})
        conn.commit()
    assert _orders(engine) == ["after", "before"]
    assert count(engine, "outbox") == 0
    assert rows(engine, "SELECT key, result FROM idempotency_keys") == [("k", "other")]


def test_a_savepoint_of_the_body_ends_inside_the_unit_of_work(engine: sa.Engine) -> None:
    create_orders(engine)
    with outbox.Outbox(engine) as ob:
        with engine.begin() as conn, ob.unit_of_work("k", connection=conn) as uow:
            conn.execute(INSERT_ORDER, {"k": "kept"})
            inner = conn.begin_nested()
            conn.execute(INSERT_ORDER, {"k": "dropped"})
            inner.rollback()
            with ob.unit_of_work("nested", connection=conn) as nested:
                nested.result = 2
            uow.publish("t", b"x")
            uow.result = 1
        with ob.unit_of_work("k") as again:
            assert again.replayed and again.result == 1
    assert _orders(engine) == ["kept"]
    assert count(engine, "outbox") == 1
    assert count(engine, "idempotency_keys") == 2


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_failed_caller_transaction_is_reported(
    flavour: str, engine: sa.Engine, database_url: str
) -> None:
    create_orders(engine)
    failing = sa.text("SELECT 1 / 0")
    if flavour == "sync":
        with outbox.Outbox(engine) as ob, engine.connect() as conn:
            with pytest.raises(sa.exc.DataError):
                conn.execute(failing)
            with pytest.raises(sa.exc.DBAPIError) as raised, ob.unit_of_work("k", connection=conn):
                pass
            conn.rollback()
        error: sa.exc.DBAPIError = raised.value
    else:

        async def run() -> sa.exc.DBAPIError:
            callers = create_async_engine(database_url)
            aob = outbox.AsyncOutbox(callers)
            try:
                async with callers.connect() as conn:
                    with pytest.raises(sa.exc.DataError):
                        await conn.execute(failing)
                    with pytest.raises(sa.exc.DBAPIError) as raised:
                        async with aob.unit_of_work("k", connection=conn):
                            pass
                    await conn.rollback()
                return raised.value
            finally:
                await aob.close()
                await callers.dispose()

        error = asyncio.run(run())
    assert type(error.orig).__name__ == "InFailedSqlTransaction"
    assert count(engine, "idempotency_keys") == 0


def test_a_large_final_statement_is_bound_and_the_savepoint_released(engine: sa.Engine) -> None:
    """Events beyond the literals' limit go bound by the driver, the release in a message of its
    own; a unit of work after it in the same transaction still has its own savepoint."""
    create_orders(engine)
    value = b"\x00\xff" * 40_000  # 80 KB of bytes no text literal could carry as such
    with outbox.Outbox(engine) as ob, engine.begin() as conn:
        with ob.unit_of_work("large", connection=conn) as uow:
            uow.publish("t", value)
        with pytest.raises(ValueError), ob.unit_of_work("next", connection=conn):
            conn.execute(INSERT_ORDER, {"k": "dropped"})
            raise ValueError("transient")
    assert rows(engine, "SELECT value FROM outbox") == [(value,)]
    assert rows(engine, "SELECT key FROM idempotency_keys") == [("large",)]
    assert count(engine, "orders") == 0


@pytest.mark.parametrize("isolation", [None, "REPEATABLE READ"])
def test_a_transaction_begun_with_the_claim_is_the_callers_to_the_end(
    engine: sa.Engine, database_url: str, isolation: str | None
) -> None:
    """The claim's message begins the caller's transaction (with the isolation level the
    caller asked for) when the server has not begun it yet: psycopg is not left in
    autocommit, so the caller's statements stay in that transaction, its rollback rolls
    them all back, and its next transaction on the connection is a transaction again."""
    create_orders(engine)
    options = {} if isolation is None else {"isolation_level": isolation}
    callers = sa.create_engine(database_url, pool_size=1, max_overflow=0, **options)
    try:
        with outbox.Outbox(engine) as ob:
            with callers.connect() as conn:
                driver = conn.connection.driver_connection
                assert driver is not None
                with ob.unit_of_work("rolled-back", connection=conn) as uow:
                    assert not driver.autocommit
                    level = conn.exec_driver_sql("SHOW transaction_isolation").scalar()
                    conn.execute(INSERT_ORDER, {"k": "rolled-back"})
                    uow.publish("t", b"x")
                assert not driver.autocommit
                conn.rollback()
                conn.execute(INSERT_ORDER, {"k": "second, rolled back too"})
                conn.rollback()
                with ob.unit_of_work("committed", connection=conn) as uow:
                    conn.execute(INSERT_ORDER, {"k": "committed"})
                conn.commit()
            with callers.connect() as conn:  # the same connection, back from the pool
                conn.execute(INSERT_ORDER, {"k": "third, rolled back"})
                conn.rollback()
    finally:
        callers.dispose()
    assert level == (isolation or "read committed").lower()
    assert _orders(engine) == ["committed"]
    assert count(engine, "idempotency_keys") == 1
    assert count(engine, "outbox") == 0
