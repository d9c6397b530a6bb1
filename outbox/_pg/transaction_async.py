"""The unit of work's transaction: one pooled connection, the toolkit's statements sent raw.

This asyncio module is the source; ``transaction.py`` (the sync flavour) is generated from it by
``tools/async_to_sync.py``.

Round trips are most of a short transaction's cost, so the toolkit keeps its own to a minimum:

* ``BEGIN`` and the key claim travel in ONE simple-protocol message (parameters are bound
  client-side by psycopg, never by string formatting). To stop psycopg from sending its own
  ``BEGIN`` first, the driver connection is switched to autocommit for the duration; the server
  still runs everything inside the explicit transaction, and psycopg's ``commit()`` and
  ``rollback()`` act on the server's transaction state. The previous autocommit setting is
  restored before the connection goes back to the pool.
* The final statement and ``COMMIT`` travel in one message too, the statement PREPAREd once
  per connection so the server does not plan it every time.
* A batch of units of work (the consumer runner's micro-batches) claims all its keys with
  ``BEGIN`` in one message (:meth:`AsyncTransaction.begin_with_many`) and runs each unit of work
  in a savepoint that it releases and sets anew in one message (:meth:`AsyncTransaction.renew`).

Driver errors are translated here, the one place, into SQLAlchemy's exception types, and a
broken connection is invalidated so the pool never hands it out again.

An interruption (``KeyboardInterrupt``, ``SystemExit``, a cancelled task) may land anywhere,
also while psycopg waits for the server or cleans up after itself. Two things then hold: a
statement the client gave up on is cancelled on the server at once (its transaction holds the
key's lock, and a backend waiting on another lock would not notice its client had gone), and a
connection that goes back to the pool not idle, or still switched to autocommit, is discarded
(:func:`~outbox._pg.transaction_base.install_guard`; that module holds what the two flavours
share).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import AsyncClientCursor, generators, pq
from psycopg.pq.abc import PGresult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from outbox._pg.after_commit import forget
from outbox._pg.coalesce import coalesce
from outbox._pg.literals import execute_text as _execute_text
from outbox._pg.statements import Prepared
from outbox._pg.transaction_base import (
    CANCEL,
    ENDED,
    GUARDED,
    SAVEPOINT,
    SWITCHED,
    GuardedConnection,
    begin_command,
    check_unprepared,
    checked,
    prepared_names,
    statement_rows,
    stop_abandoned,
    wanted_statements,
)
from outbox.errors import ConfigurationError, TransactionEndedError


async def check_caller(session: Any, connection: AsyncConnection | None) -> None:
    """:func:`check_unprepared` for the connection of a caller's session (``session``, an ORM
    session of this flavour) or connection."""
    conn = await session.connection() if session is not None else connection
    assert conn is not None
    raw = await conn.get_raw_connection()
    check_unprepared(raw.driver_connection)


async def check_transaction(session: Any, connection: AsyncConnection | None) -> None:
    """Refuse a caller's session (of this flavour) or connection that runs in autocommit
    outside a transaction: a joined unit of work works in a savepoint of the caller's
    transaction, and there is none to join (every statement would commit on its own, the key's
    claim apart from its outbox rows)."""
    conn = await session.connection() if session is not None else connection
    assert conn is not None
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if (
        isinstance(driver, psycopg.BaseConnection)
        and driver.autocommit
        and driver.pgconn.transaction_status == pq.TransactionStatus.IDLE
    ):
        raise ConfigurationError(
            "a unit of work joined to a connection or session joins its transaction, and this "
            "one runs in autocommit (isolation_level='AUTOCOMMIT') with no transaction open: "
            "join it to a connection in a transaction (engine.begin(), or a session on an "
            "engine without AUTOCOMMIT), or let the unit of work open its own (no connection= "
            "or session=)"
        )


async def connect(engine: AsyncEngine) -> AsyncConnection:
    """A connection of ``engine`` for a unit of work's own transaction
    (:class:`~outbox._pg.transaction_base.GuardedConnection`)."""
    return AsyncConnection(engine, await greenlet_spawn(GuardedConnection, engine.sync_engine))


async def _send(driver: psycopg.AsyncConnection[Any], message: bytes) -> list[PGresult]:
    """Run ``message`` (statements with their parameters as literals, for the simple query
    protocol) on ``driver``, in autocommit mode and outside a pipeline, and return its results
    (:func:`~outbox._pg.transaction_base.checked`).

    What psycopg's ``cursor.execute()`` does, without what a cursor adds around it: a cursor
    and a transformer made for every message, and the prepared-statement cache's count of the
    message's text -- which is never the same twice, each message carrying its own literals.
    The connection's lock is held as the cursor holds it, and an interrupted wait cancels the
    statement on the server as psycopg's ``wait()`` does for a cursor."""
    async with driver.lock:
        pgconn = driver.pgconn
        pgconn.send_query(message)
        results = await driver.wait(generators.execute(pgconn))
    return checked(driver, results)


class AsyncTransaction:
    """A transaction on a connection checked out of ``engine``.

    ``pooled`` says that a transaction pooler (PgBouncer in transaction mode) stands between
    the toolkit and PostgreSQL: nothing may then rely on the session -- statements are sent
    with their parameters inline rather than PREPAREd, and a permanent failure is recorded in
    the same transaction, after a rollback to a savepoint set with the claim, rather than under
    a session-level lock.
    """

    __slots__ = (
        "_cancel", "_driver", "_pipeline", "_pooled", "_saved_autocommit", "_unit", "connection",
    )  # fmt: skip

    def __init__(
        self,
        connection: AsyncConnection,
        driver: psycopg.AsyncConnection[Any],
        pooled: bool = False,
    ) -> None:
        self.connection = connection
        self._driver = driver
        self._pooled = pooled
        self._saved_autocommit: bool | None = None
        info = connection.info
        self._cancel: pq.abc.PGcancel = info.get(CANCEL) or info.setdefault(
            CANCEL, driver.pgconn.get_cancel()
        )
        # The claim's token (see outbox._pg.statements.UNIT_SETTING), new at every begin.
        self._unit = ""
        # psycopg's pipeline while statements are pipelined (start_pipeline, end_pipeline).
        self._pipeline: contextlib.AbstractAsyncContextManager[Any] | None = None

    @classmethod
    async def open(cls, engine: AsyncEngine, *, pooled: bool = False) -> AsyncTransaction:
        """Check a connection out of ``engine`` (the psycopg 3 driver is required)."""
        connection = await connect(engine)
        raw = await connection.get_raw_connection()
        driver = raw.driver_connection
        if not isinstance(driver, psycopg.AsyncConnection):
            await connection.close()
            raise TypeError("outbox-kit needs the psycopg 3 driver (postgresql+psycopg://)")
        if pooled:
            try:
                check_unprepared(driver)
            except ConfigurationError:
                await connection.close()
                raise
        return cls(connection, driver, pooled)

    async def begin(self) -> None:
        """Start an ordinary transaction (psycopg sends BEGIN with the first statement)."""
        await self.connection.begin()

    async def begin_with(self, claim: Prepared, params: dict[str, Any]) -> tuple[Any, ...]:
        """Start the transaction and run ``claim`` in the same round trip; return its row.

        Statements this connection has not PREPAREd yet (the claim, and final statements that
        :meth:`commit_with` could not send prepared) are PREPAREd in the same message, before
        ``BEGIN``, where a failure cannot harm a transaction.
        """
        rows = await self.begin_with_many([claim], params, savepoint=self._pooled)
        return rows[0][0]

    async def begin_with_many(
        self, statements: list[Prepared], params: dict[str, Any], *, savepoint: bool = False
    ) -> list[list[tuple[Any, ...]]]:
        """:meth:`begin_with` for several statements, run in order in the same round trip;
        returns the rows of each. With ``savepoint``, a savepoint for the first unit of work of
        a batch is set in that round trip too (see :meth:`renew`).

        The claim's token is bound as the parameter ``unit`` (a new one for every transaction).
        A stale record of prepared statements is corrected before ``BEGIN`` is sent again:
        nothing of this transaction has run then."""
        driver = self._driver
        known = prepared_names.setdefault(driver, set())
        self._saved_autocommit = driver.autocommit
        self.connection.info[SWITCHED] = True
        self._unit = params["unit"] = secrets.token_hex(8)
        pooled = self._pooled
        try:
            await driver.set_autocommit(True)
            begin = begin_command(driver)
            wanted = wanted_statements.setdefault(driver, set())
            body = b"; ".join(_execute_text(driver, p, params, inline=pooled) for p in statements)
            if savepoint:
                body += f"; SAVEPOINT {SAVEPOINT}".encode()
            for _attempt in range(2):
                if pooled:
                    # No PREPARE, nothing to learn about the session: one attempt.
                    results = await _send(driver, f"{begin}; ".encode() + body)
                    rows = statement_rows(driver, results, 1, len(statements))
                    break
                missing = [p for p in (*statements, *wanted) if p.name not in known]
                prefix = "".join(f"{p.prepare}; " for p in missing)
                if driver.isolation_level is not None:
                    # PREPARE counts as a query: BEGIN ISOLATION LEVEL must come first.
                    head = f"{begin}; {prefix}"
                else:
                    head = f"{prefix}{begin}; "
                try:
                    results = await _send(driver, head.encode() + body)
                except (
                    psycopg.errors.InvalidSqlStatementName,
                    psycopg.errors.DuplicatePreparedStatement,
                ):
                    # Our record of what the server holds went stale (a DEALLOCATE ALL, or a
                    # statement left from an earlier life of the connection): learn the truth
                    # once, outside any transaction, and try again.
                    await self._rollback()
                    known.clear()
                    names = await driver.execute(
                        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'outbox_%'"
                    )
                    known.update(row[0] for row in await names.fetchall())
                    continue
                known.update(p.name for p in missing)
                wanted.clear()
                rows = statement_rows(driver, results, len(missing) + 1, len(statements))
                break
            else:  # pragma: no cover - two stale records in a row means a concurrent DEALLOCATE
                raise psycopg.errors.InvalidSqlStatementName(
                    "prepared statements of this connection keep disappearing"
                )
        except psycopg.Error as exc:
            raise await self._translate(statements[0].execute, params, exc) from exc
        # SQLAlchemy's own transaction object over the server transaction: ORM sessions and
        # Core statements on this connection join it, and never commit it themselves.
        await self.connection.begin()
        self.connection.info[ENDED] = False
        self.connection.info[GUARDED] = True
        return rows

    async def renew(self, *, rollback: bool) -> None:
        """End the savepoint of a batch's unit of work and set the next one, in one round trip.

        ``rollback`` undoes what was done since the savepoint was set (``ROLLBACK TO`` keeps the
        savepoint); otherwise it is released and set anew. Locks taken before it stay held.
        """
        sql = (
            f"ROLLBACK TO SAVEPOINT {SAVEPOINT}"
            if rollback
            else f"RELEASE SAVEPOINT {SAVEPOINT}; SAVEPOINT {SAVEPOINT}"
        )
        try:
            await self._driver.execute(sql.encode())
        except psycopg.Error as exc:
            raise await self._translate(sql, {}, exc) from exc

    def usable(self) -> bool:
        """True while the server transaction is open (possibly failed, awaiting a rollback to a
        savepoint) on a live connection; false once the body ended it or the connection died."""
        driver = self._driver
        if driver.broken or driver.closed or self.connection.invalidated:
            return False
        status = driver.pgconn.transaction_status
        if self._pipeline is not None and status == pq.TransactionStatus.ACTIVE:
            return True  # statements in flight: what became of them is known at the sync
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    async def start_pipeline(self) -> None:
        """Pipeline what is sent from now on (psycopg's pipeline mode): a statement returns
        once sent, without waiting for its answer, unless its rows are read. A failed
        statement's error may then surface in a later statement, or at :meth:`end_pipeline`:
        which statement failed is not known. Statements are sent in bursts
        (:func:`~outbox._pg.coalesce.coalesce`), and at once where an answer is needed."""
        pipeline = self._driver.pipeline()
        # Statements go to the server in bursts, not one write (and one wake-up of the server)
        # each: see outbox._pg.coalesce.
        coalesce(await pipeline.__aenter__())
        self._pipeline = pipeline

    async def end_pipeline(self) -> None:
        """Wait for every pipelined statement; raises the error of one that failed."""
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            return
        try:
            await pipeline.__aexit__(None, None, None)
        except psycopg.Error as exc:
            raise await self._translate("(pipelined statements)", {}, exc) from exc

    # failed() answers without a round trip: savepoints can be shared (savepoint_chunk).
    tells_failures = True

    def failed(self) -> bool:
        """True when a statement failed in the transaction: it awaits a rollback to a savepoint
        (known without a round trip)."""
        return self._driver.pgconn.transaction_status == pq.TransactionStatus.INERROR

    async def execute(self, sql: str, params: dict[str, Any]) -> Any:
        """Run ``sql`` in the transaction (bound by the driver); ``unit``, the claim's token,
        is bound with ``params``."""
        params = {**params, "unit": self._unit}
        try:
            return await self._driver.execute(sql, params)
        except psycopg.Error as exc:
            raise await self._translate(sql, params, exc) from exc

    async def commit(self) -> None:
        self.connection.info[GUARDED] = False
        await self.connection.commit()

    async def commit_bound(self, final: Prepared, params: dict[str, Any]) -> None:
        """Run ``final`` with its parameters bound by the driver (large values go in binary
        rather than as quoted literals), then COMMIT.

        Under a client encoding other than UTF-8, psycopg would write text with Python's codec,
        whose tables differ from the server's for some encodings: the statement then goes as
        :meth:`commit_with` sends it, with its literals."""
        if self._driver.info.encoding != "utf-8":
            await self.commit_with(final, params)
            return
        await self.execute(final.direct, params)
        await self.commit()

    async def commit_with(
        self, final: Prepared, params: dict[str, Any], after: Prepared | None = None
    ) -> Any:
        """Run ``final`` and COMMIT in the same round trip (after :meth:`begin_with`); then
        ``after`` (a prepared statement without parameters), a statement of its own after the
        COMMIT, in the same message, whose value is returned (``None`` when it did not run).

        A statement that this connection has not PREPAREd yet goes the ordinary way this time
        (PREPARE inside the transaction could fail it) and is PREPAREd at the next
        :meth:`begin_with`; so is ``after``, which is left out until then. If the statement
        fails, the server skips the COMMIT of the same message (and ``after``) and the
        transaction is rolled back by :meth:`close`. ``after`` must be a statement that cannot
        fail: its error would read as a failed commit.
        """
        driver = self._driver
        if driver.pgconn.transaction_status != pq.TransactionStatus.INTRANS:
            raise TransactionEndedError(
                "the unit of work's transaction is no longer open (it was ended inside the "
                "body); nothing was committed by the unit of work"
            )
        self.connection.info[GUARDED] = False
        params = {**params, "unit": self._unit}
        if self._pooled:
            message = _execute_text(driver, final, params, inline=True) + b"; COMMIT"
            if after is not None:
                message += b"; " + _execute_text(driver, after, {}, inline=True)
            return await self._commit_message(message, final, params, after is not None)
        known = prepared_names.get(driver, ())
        if after is not None and after.name not in known:
            wanted_statements.setdefault(driver, set()).add(after)
            after = None
        if final.name not in known:
            # Not PREPAREd yet: this time the statement's own text with its literals, and the
            # COMMIT in the same message, as behind a pooler.
            wanted_statements.setdefault(driver, set()).add(final)
            message = _execute_text(driver, final, params, inline=True) + b"; COMMIT"
            return await self._commit_message(message, final, params, False)
        message = _execute_text(driver, final, params) + b"; COMMIT"
        if after is not None:
            message += b"; " + after.execute.encode()
        return await self._commit_message(message, final, params, after is not None)

    async def _commit_message(
        self, message: bytes, final: Prepared, params: dict[str, Any], after: bool
    ) -> Any:
        driver = self._driver
        try:
            results = await _send(driver, message)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.errors.InvalidSqlStatementName):
                prepared_names.pop(driver, None)
            raise await self._translate(final.execute, params, exc) from exc
        # The server transaction is over; close SQLAlchemy's view of it (psycopg sends nothing).
        await self.connection.commit()
        if not after:
            return None
        # The results of the final statement, COMMIT and ``after``.
        rows = statement_rows(driver, results, 2, 1)[0]
        return rows[0][0] if rows else None

    async def hold(self, lock_id: int) -> bool:
        """Take a session-scoped advisory lock on ``lock_id`` while the transaction is healthy.

        The transaction already holds the transaction-scoped lock of the same id, so this never
        waits; unlike that lock, it outlives the ROLLBACK that :meth:`roll_back_and_record`
        does next, so no other attempt can claim the key in between.
        """
        driver = self._driver
        if self._pooled:
            # No session lock behind a pooler: the savepoint set with the claim serves instead
            # (roll_back_and_record rolls back to it, keeping the transaction's key lock).
            return self.usable() and not self.connection.info.get(ENDED, False)
        if driver.pgconn.transaction_status != pq.TransactionStatus.INTRANS:
            return False
        try:
            cursor = await driver.execute("SELECT pg_try_advisory_lock(%s)", (lock_id,))
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            raise await self._translate("pg_try_advisory_lock", {}, exc) from exc
        return bool(row and row[0])

    async def roll_back_and_record(
        self, held: bool, lock_id: int, sql: str, params: dict[str, Any]
    ) -> tuple[bool, bool]:
        """Roll back the unit of work, then run ``sql`` (its failure record) on its own.

        Returns ``(locked, recorded)``: whether the key could be held for the record (if the
        session lock was not taken before, it is tried after the rollback) and whether ``sql``
        wrote a row. The session lock is always released before returning.
        """
        driver = self._driver
        self.connection.info[GUARDED] = False
        if self._pooled:
            return await self._roll_back_and_record_pooled(held, lock_id, sql, params)
        try:
            await self._rollback()
            if not held:
                cursor = await driver.execute("SELECT pg_try_advisory_lock(%s)", (lock_id,))
                row = await cursor.fetchone()
                held = bool(row and row[0])
            if not held:
                return False, False
            # The connection is in autocommit mode: the statement is a transaction of its own.
            return True, (await driver.execute(sql, params)).rowcount == 1
        except psycopg.Error as exc:
            raise await self._translate(sql, params, exc) from exc
        finally:
            if held:
                try:
                    await driver.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
                except psycopg.Error as exc:
                    # A broken connection released the lock with its session.
                    await self.connection.invalidate(exc)

    async def _roll_back_and_record_pooled(
        self, held: bool, lock_id: int, sql: str, params: dict[str, Any]
    ) -> tuple[bool, bool]:
        """:meth:`roll_back_and_record` without session state: back to the savepoint set with
        the claim (the transaction keeps the key's lock), the record, COMMIT -- one message.
        If the body ended the transaction, the record gets a transaction of its own that takes
        the key's lock first (another attempt holding it decides instead)."""
        driver = self._driver
        cursor = AsyncClientCursor(driver)
        try:
            if held:
                await cursor.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}; {sql}; COMMIT", params)
                cursor.nextset()  # the record's result
                recorded = cursor.rowcount == 1
                if self.connection.in_transaction():
                    # SQLAlchemy's view; the server is idle, nothing is sent.
                    await self.connection.rollback()
                return True, recorded
            await self._rollback()
            await cursor.execute("BEGIN; SELECT pg_try_advisory_xact_lock(%(lock_id)s)",
                                 {"lock_id": lock_id})  # fmt: skip
            cursor.nextset()
            row = await cursor.fetchone()
            if not (row and row[0]):
                await driver.execute("ROLLBACK")
                return False, False
            await cursor.execute(f"{sql}; COMMIT", params)
            return True, cursor.rowcount == 1
        except psycopg.Error as exc:
            raise await self._translate(sql, params, exc) from exc

    async def finish(self) -> None:
        """End a transaction that wrote nothing and return the connection to the pool."""
        self.connection.info[GUARDED] = False
        try:
            await self.connection.commit()
        finally:
            await self.close()

    async def close(self) -> None:
        """Roll back whatever is uncommitted and return the connection to the pool."""
        connection = self.connection
        self._stop_server_work()
        try:
            if self._pipeline is not None:
                with contextlib.suppress(psycopg.Error, sa.exc.DBAPIError):  # rolled back below
                    await self.end_pipeline()
            if not connection.invalidated:
                connection.info[GUARDED] = False
                forget(connection.sync_connection)  # the keys its claims took
                if connection.info.pop(ENDED, False):
                    # psycopg's rollback() may have sent DEALLOCATE ALL: learn anew next time.
                    prepared_names.pop(self._driver, None)
                await self._rollback()
                if self._saved_autocommit is not None:
                    await self._driver.set_autocommit(self._saved_autocommit)
                connection.info.pop(SWITCHED, None)
        except (sa.exc.DBAPIError, psycopg.Error) as exc:
            await connection.invalidate(exc)
        except BaseException:
            # Interrupted again while cleaning up: the pool discards the connection.
            self._stop_server_work(again=True)
            raise
        finally:
            await connection.close()

    def _stop_server_work(self, *, again: bool = False) -> None:
        """Cancel the statement the server may still run for this connection, without awaiting
        (see :func:`stop_abandoned`)."""
        stop_abandoned(self._driver, self._cancel, again=again)

    async def _rollback(self) -> None:
        driver = self._driver
        if driver.pgconn.transaction_status == pq.TransactionStatus.IDLE:
            return
        if driver.autocommit:
            # A plain ROLLBACK statement: psycopg's rollback() would add DEALLOCATE ALL and
            # throw away every prepared statement of the connection.
            await driver.execute("ROLLBACK")
        else:
            await driver.rollback()
            prepared_names.pop(driver, None)
        if self.connection.in_transaction():
            # SQLAlchemy's view; the server is idle, nothing is sent.
            await self.connection.rollback()

    async def _translate(self, sql: str, params: dict[str, Any], exc: psycopg.Error) -> Exception:
        broken = self._driver.broken or self._driver.closed
        if broken:
            await self.connection.invalidate(exc)
        return sa.exc.DBAPIError.instance(
            sql, params, exc, psycopg.Error, connection_invalidated=broken
        )
