"""The unit of work's transaction on asyncpg (``postgresql+asyncpg://`` engines).

Not generated: asyncpg exists only for asyncio, so this module has no sync twin. It gives
:class:`~outbox._pg.transaction_async.AsyncTransaction`'s methods the same meaning on an asyncpg
connection; the statements, the claim and every decision are the same ones.

How it keeps the transaction whole: SQLAlchemy's asyncpg adapter starts a transaction of its
own (asyncpg's ``Connection.transaction()``) at a connection's first statement. For the
duration of a unit of work the adapter is switched to autocommit, so it starts none, and the
toolkit sends ``BEGIN`` and ``COMMIT`` itself on the asyncpg connection; ORM sessions and Core
statements on :attr:`AsyncpgTransaction.connection` run inside that server transaction. The
adapter's previous mode is restored before the connection goes back to the pool, and a
connection that comes back inside a server transaction is discarded
(:func:`~outbox._pg.transaction_base.install_guard`).

What differs from psycopg, and why:

* ``BEGIN`` and the claim take two round trips (psycopg: one). asyncpg sends a statement
  with parameters only through the extended protocol, one statement per message.
* ``COMMIT`` follows the final statement in a message of its own, and no relay-idle probe is
  sent after it: relays are woken after every commit that appended events (the wake-up is
  throttled either way, see :mod:`outbox._pg.wakeup`).
* asyncpg prepares every statement under a name of its own per connection, so a transaction
  pooler (``OutboxConfig(pooler='transaction')``) is refused for asyncpg engines
  (:func:`~outbox._pg.engines.engine_for`).
* A cancelled task cancels its statement on the server: asyncpg sends the cancel request
  itself when the awaiting task is cancelled.
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox._pg.after_commit import forget
from outbox._pg.statements import Prepared
from outbox._pg.transaction_async import AsyncTransaction, connect
from outbox._pg.transaction_base import ENDED, GUARDED, SAVEPOINT, SWITCHED
from outbox.errors import TransactionEndedError

_PARAMETER = re.compile(r"%\((\w+)\)s")


@functools.lru_cache(maxsize=1024)
def dollar(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its psycopg ``%(name)s`` parameters numbered ``$1, $2, ...`` (one number
    per distinct name, in order of first use), and the names in that order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PARAMETER.sub(number, sql), tuple(names)


def bind(sql: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    """asyncpg's form of a psycopg statement and its parameters."""
    text, names = dollar(sql)
    return text, [params[name] for name in names]


def begin_command(level: str | None, read_only: bool, deferrable: bool) -> str:
    """The same transaction characteristics the adapter would request of asyncpg (its
    isolation levels are SQLAlchemy's, spelt ``repeatable_read``)."""
    parts = ["BEGIN"]
    if level is not None and level != "autocommit":
        parts.append("ISOLATION LEVEL " + level.replace("_", " ").upper())
    if read_only:
        parts.append("READ ONLY")
    if deferrable:
        parts.append("DEFERRABLE")
    return " ".join(parts)


class AsyncpgTransaction(AsyncTransaction):
    """:class:`AsyncTransaction` on an asyncpg connection checked out of an engine."""

    __slots__ = ("_adapter", "_pg", "_saved_level")

    def __init__(self, connection: AsyncConnection, adapter: Any) -> None:
        # The psycopg-only state of the base class (cancel key, autocommit switch) is unused.
        self.connection = connection
        self._pooled = False
        self._unit = ""
        self._pipeline = None  # asyncpg has no pipeline: an optimistic batch needs psycopg
        self._adapter = adapter
        self._pg: Any = adapter.driver_connection
        self._saved_level: Any = None

    @classmethod
    async def open(cls, engine: AsyncEngine, *, pooled: bool = False) -> AsyncTransaction:
        connection = await connect(engine)
        raw = await connection.get_raw_connection()
        return cls(connection, raw.dbapi_connection)

    async def begin(self) -> None:
        await self.connection.begin()

    async def begin_with_many(
        self, statements: list[Prepared], params: dict[str, Any], *, savepoint: bool = False
    ) -> list[list[tuple[Any, ...]]]:
        self._unit = params["unit"] = secrets.token_hex(8)
        adapter = self._adapter
        self._saved_level = adapter.isolation_level
        level = adapter.isolation_level
        # The adapter starts no transaction of its own while switched (see the module's doc).
        adapter.autocommit = True
        self.connection.info[SWITCHED] = True
        pg = self._pg
        rows: list[list[tuple[Any, ...]]] = []
        sql = ""
        try:
            sql = begin_command(level, adapter.readonly, adapter.deferrable)
            await pg.execute(sql)
            for p in statements:
                sql, args = bind(p.direct, params)
                rows.append([tuple(r) for r in await pg.fetch(sql, *args)])
            if savepoint:
                sql = f"SAVEPOINT {SAVEPOINT}"
                await pg.execute(sql)
        except Exception as exc:
            raise await self._translate(sql, params, exc) from exc
        await self.connection.begin()
        self.connection.info[ENDED] = False
        self.connection.info[GUARDED] = True
        return rows

    async def renew(self, *, rollback: bool) -> None:
        sql = (
            f"ROLLBACK TO SAVEPOINT {SAVEPOINT}"
            if rollback
            else f"RELEASE SAVEPOINT {SAVEPOINT}; SAVEPOINT {SAVEPOINT}"
        )
        try:
            await self._pg.execute(sql)
        except Exception as exc:
            raise await self._translate(sql, {}, exc) from exc

    # asyncpg does not say whether a statement failed in its transaction (only a round trip
    # would), so a body that caught its statement's error cannot be told from one that
    # succeeded: messages cannot share a savepoint.
    tells_failures = False

    def failed(self) -> bool:
        return False

    def usable(self) -> bool:
        pg = self._pg
        if pg.is_closed() or self.connection.invalidated:
            return False
        return bool(pg.is_in_transaction())

    async def execute(self, sql: str, params: dict[str, Any]) -> Any:
        params = {**params, "unit": self._unit}
        text, args = bind(sql, params)
        try:
            return await self._pg.execute(text, *args)
        except Exception as exc:
            raise await self._translate(sql, params, exc) from exc

    async def commit(self) -> None:
        self.connection.info[GUARDED] = False
        try:
            await self._pg.execute("COMMIT")
        except Exception as exc:
            raise await self._translate("COMMIT", {}, exc) from exc
        await self.connection.commit()

    async def commit_with(
        self, final: Prepared, params: dict[str, Any], after: Prepared | None = None
    ) -> Any:
        if self.connection.info.get(ENDED) or not self.usable():
            raise TransactionEndedError(
                "the unit of work's transaction is no longer open (it was ended inside the "
                "body); nothing was committed by the unit of work"
            )
        await self.execute(final.direct, params)
        await self.commit()
        return None  # no probe: see the module's doc

    async def hold(self, lock_id: int) -> bool:
        if self.connection.info.get(ENDED) or not self.usable():
            return False
        try:
            return bool(await self._pg.fetchval("SELECT pg_try_advisory_lock($1)", lock_id))
        except Exception as exc:
            if getattr(exc, "sqlstate", None) == "25P02":  # the body's error failed it
                return False
            raise await self._translate("pg_try_advisory_lock", {}, exc) from exc

    async def roll_back_and_record(
        self, held: bool, lock_id: int, sql: str, params: dict[str, Any]
    ) -> tuple[bool, bool]:
        pg = self._pg
        self.connection.info[GUARDED] = False
        try:
            await self._rollback()
            if not held:
                held = bool(await pg.fetchval("SELECT pg_try_advisory_lock($1)", lock_id))
            if not held:
                return False, False
            # No transaction is open: the statement is one of its own.
            text, args = bind(sql, params)
            status = await pg.execute(text, *args)
            return True, status.rsplit(" ", 1)[-1] == "1"
        except Exception as exc:
            raise await self._translate(sql, params, exc) from exc
        finally:
            if held:
                try:
                    await pg.fetchval("SELECT pg_advisory_unlock($1)", lock_id)
                except Exception as exc:
                    # A broken connection released the lock with its session.
                    await self.connection.invalidate(exc)

    async def finish(self) -> None:
        self.connection.info[GUARDED] = False
        try:
            await self.commit()
        finally:
            await self.close()

    async def close(self) -> None:
        connection = self.connection
        try:
            if not connection.invalidated:
                connection.info[GUARDED] = False
                forget(connection.sync_connection)  # the keys its claims took
                connection.info.pop(ENDED, None)
                await self._rollback()
                self._restore()
                connection.info.pop(SWITCHED, None)
        except Exception as exc:
            await connection.invalidate(exc)
        finally:
            await connection.close()

    def _restore(self) -> None:
        if self._saved_level is not None or self.connection.info.get(SWITCHED):
            self._adapter.isolation_level = self._saved_level
            self._saved_level = None

    async def _rollback(self) -> None:
        pg = self._pg
        if not pg.is_closed() and pg.is_in_transaction():
            await pg.execute("ROLLBACK")
        if self.connection.in_transaction():
            # SQLAlchemy's view; the adapter holds no transaction, nothing is sent.
            await self.connection.rollback()

    async def _translate(self, sql: str, params: dict[str, Any], exc: Exception) -> Exception:
        """The error as SQLAlchemy's asyncpg dialect raises it (a ``DBAPIError`` around the
        adapter's exception, the asyncpg one as its cause), the connection invalidated when
        it is lost."""
        translated: Exception = exc
        try:
            self._adapter._handle_exception(exc)
        except Exception as adapted:  # the adapter raises its translation
            translated = adapted
        broken = self._pg.is_closed()
        if broken:
            await self.connection.invalidate(translated)
        dbapi_error = self.connection.dialect.loaded_dbapi.Error
        if not isinstance(translated, dbapi_error):
            return translated
        return sa.exc.DBAPIError.instance(
            sql, params, translated, dbapi_error, connection_invalidated=broken
        )
