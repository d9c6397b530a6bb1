"""A unit of work joined to a connection it cannot work in is refused with a toolkit error that
says what to do, in both flavours, leaving nothing behind: one in autocommit (no transaction to
join), and a text the driver cannot write in the session's client encoding."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from hypothesis import given, strategies as st
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox.errors import ConfigurationError, ValidationError
from tests.fixtures.hostile import scaled


def written(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM outbox)"
                )
            ).one()
        )


@pytest.mark.parametrize("how", ["connection option", "engine", "session"])
def test_a_unit_of_work_joined_to_an_autocommit_connection_is_refused(
    how: str, engine: sa.Engine, database_url: str
) -> None:
    auto = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    ob = outbox.Outbox(engine)
    try:
        with pytest.raises(ConfigurationError, match=r"autocommit.*engine\.begin"):
            if how == "session":
                with Session(auto) as session, ob.unit_of_work("k", session=session) as uow:
                    uow.publish("t", b"x")
            else:
                source = engine if how == "connection option" else auto
                with source.connect() as conn:
                    if how == "connection option":
                        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                    with ob.unit_of_work("k", connection=conn) as uow:
                        uow.publish("t", b"x")
    finally:
        ob.close()
        auto.dispose()
    assert written(engine) == (0, 0)


def test_an_async_unit_of_work_joined_to_an_autocommit_connection_is_refused(
    engine: sa.Engine, database_url: str
) -> None:
    async def main() -> None:
        auto = create_async_engine(database_url, isolation_level="AUTOCOMMIT")
        aob = outbox.AsyncOutbox(auto)
        try:
            async with auto.connect() as conn:
                with pytest.raises(ConfigurationError, match=r"autocommit.*engine\.begin"):
                    async with aob.unit_of_work("k", connection=conn) as uow:
                        uow.publish("t", b"x")
        finally:
            await aob.close()
            await auto.dispose()

    asyncio.run(main())
    assert written(engine) == (0, 0)


def test_a_joined_unit_of_work_in_a_transaction_of_an_autocommit_connection_runs(
    engine: sa.Engine, database_url: str
) -> None:
    """Autocommit with a transaction the caller opened itself is a transaction to join."""
    auto = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    ob = outbox.Outbox(engine)
    try:
        with auto.connect() as conn:
            conn.exec_driver_sql("BEGIN")
            with ob.unit_of_work("k", connection=conn) as uow:
                uow.publish("t", b"x")
            conn.exec_driver_sql("COMMIT")
    finally:
        ob.close()
        auto.dispose()
    assert written(engine) == (1, 1)


beyond_latin1 = st.text(st.characters(min_codepoint=0x100, exclude_categories=["Cs"]), min_size=1)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_joined_text_the_client_encoding_cannot_carry_is_refused(
    flavour: str, engine: sa.Engine, database_url: str
) -> None:
    """The key, a header, the result: the error names the text and the fix."""
    latin1 = {"client_encoding": "latin1"}
    ob = outbox.Outbox(engine)

    @scaled(10)
    @given(beyond_latin1, st.sampled_from(["key", "header", "result"]))
    def run(text: str, where: str) -> None:
        key = f"k{text}" if where == "key" else "k"
        headers = {"h": text} if where == "header" else {}
        result = {"r": text} if where == "result" else None
        if flavour == "sync":
            joined = sa.create_engine(database_url, connect_args=latin1)
            try:
                with (
                    joined.begin() as conn,
                    pytest.raises(ValidationError, match="client_encoding"),
                    ob.unit_of_work(key, connection=conn) as uow,
                ):
                    uow.publish("t", b"x", headers=headers)
                    uow.result = result
            finally:
                joined.dispose()
        else:
            asyncio.run(async_run(key, headers, result))
        assert written(engine) == (0, 0)

    async def async_run(key: str, headers: dict[str, str | bytes], result: object) -> None:
        joined = create_async_engine(database_url, connect_args=latin1)
        aob = outbox.AsyncOutbox(joined)
        try:
            async with joined.begin() as conn:
                with pytest.raises(ValidationError, match="client_encoding"):
                    async with aob.unit_of_work(key, connection=conn) as uow:
                        uow.publish("t", b"x", headers=headers)
                        uow.result = result
        finally:
            await aob.close()
            await joined.dispose()

    try:
        run()
    finally:
        ob.close()
