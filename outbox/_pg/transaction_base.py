"""What the unit of work's transaction does the same in both flavours: keep a unit of work whole
against its own body (:class:`GuardedConnection`) and the pool clean (:func:`install_guard`),
stop a statement the client gave up on (:func:`stop_abandoned`), the ``BEGIN`` psycopg would
send, the pooler's check, the record of the statements PREPAREd on each driver connection, and
the reading of a message's results (:func:`checked`, :func:`statement_rows`).

Nothing here awaits: both flavours of the transaction (``transaction_async.py`` and its
generated twin ``transaction.py``) import it, so it is written, and loaded, once.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import IsolationLevel, adapt, errors, pq
from psycopg.pq.abc import PGresult
from sqlalchemy.engine.base import RootTransaction

from outbox._pg.statements import Prepared
from outbox.errors import ConfigurationError, TransactionEndedError

# Names of the statements the transaction PREPAREd on each driver connection, and statements to
# PREPARE at the connection's next begin_with(): one record for both flavours, keyed by the
# driver connection.
prepared_names: weakref.WeakKeyDictionary[psycopg.BaseConnection[Any], set[str]] = (
    weakref.WeakKeyDictionary()
)
wanted_statements: weakref.WeakKeyDictionary[psycopg.BaseConnection[Any], set[Prepared]] = (
    weakref.WeakKeyDictionary()
)


GUARDED = "outbox.unit_of_work_open"
ENDED = "outbox.unit_of_work_rolled_back"
# Set while the driver connection is switched to autocommit by a unit of work.
SWITCHED = "outbox.autocommit_switched"
# The connection's cancel key (libpq PGcancel), made while the connection is alive: usable
# after psycopg closed the connection, to stop what its backend still runs.
CANCEL = "outbox.cancel"

# The savepoint a batch runs each unit of work in.
SAVEPOINT = "outbox_unit"


def _refuse_commit(conn: sa.Connection) -> None:
    if conn.info.get(GUARDED):
        raise TransactionEndedError(
            "commit() is not allowed inside a unit of work: it commits when the with-block "
            "ends, together with its idempotency key and outbox rows (use begin_nested() for "
            "a savepoint)"
        )


def _note_rollback(conn: sa.Connection) -> None:
    # A rollback (an ORM session does one after a failed flush) throws the whole unit of work
    # away, which is safe; what must not follow is more work outside the transaction.
    if conn.invalidated:
        # The connection was lost (SQLAlchemy rolls back while handling the error): touching
        # conn.info now would raise PendingRollbackError in place of the real error.
        return
    if conn.info.get(GUARDED):
        conn.info[ENDED] = True


def _refuse_begin(conn: sa.Connection) -> None:
    if conn.info.get(GUARDED) and conn.info.get(ENDED):
        raise TransactionEndedError(
            "the unit of work's transaction was rolled back inside its body; nothing more can "
            "be done in it: let the exception propagate and retry the unit of work"
        )


def _discard_unclean(dbapi_connection: Any, record: Any) -> None:
    # After the pool's reset: a connection a unit of work left switched to autocommit, or in
    # any state but idle (an interruption inside SQLAlchemy or an event handler can leave the
    # pool believing a transaction was ended that the server still holds), is not handed out
    # again.
    if dbapi_connection is None:
        return
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    pgconn = getattr(driver, "pgconn", None)
    switched = record.info.pop(SWITCHED, False)
    in_transaction = getattr(driver, "is_in_transaction", None)  # asyncpg's connection
    if (
        switched
        or (pgconn is not None and pgconn.transaction_status != pq.TransactionStatus.IDLE)
        or (callable(in_transaction) and in_transaction())
    ):
        record.info[GUARDED] = False
        record.invalidate()


class GuardedConnection(sa.Connection):
    """The connection of a unit of work's own transaction: it keeps that transaction whole
    against the unit of work's body.

    ``commit()`` from the body would commit business rows without the key and the outbox rows:
    refused before anything is sent. After a rollback from the body, any further statement is
    refused instead of running outside the transaction. The checks live in the connection the
    toolkit opens, not in listeners on the engine: an engine with listeners makes SQLAlchemy
    dispatch every event of every connection of that engine (its ``begin``, each statement's
    ``before_execute`` ...), the caller's own connections included.
    """

    def _begin_impl(self, transaction: RootTransaction) -> None:
        _refuse_begin(self)
        super()._begin_impl(transaction)

    def _commit_impl(self) -> None:
        _refuse_commit(self)
        super()._commit_impl()

    def _rollback_impl(self) -> None:
        _note_rollback(self)
        super()._rollback_impl()


def install_guard(engine: sa.Engine) -> None:
    """Keep the pool clean: a connection that comes back to it other than idle (or still
    switched to autocommit by a unit of work) is discarded. A unit of work's own transaction is
    kept whole by its connection (:class:`GuardedConnection`)."""
    if not sa.event.contains(engine.pool, "checkin", _discard_unclean):
        sa.event.listen(engine.pool, "checkin", _discard_unclean)


def cancel_key(connection: sa.Connection) -> tuple[Any, Any] | None:
    """``(driver connection, its cancel key)`` of a SQLAlchemy connection on psycopg, for
    :func:`stop_abandoned` (a caller's connection joined by a unit of work); ``None`` for
    another driver. The key is made once per driver connection, while it is alive."""
    if connection.invalidated:
        return None
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.BaseConnection) or driver.closed:
        return None
    cancel = _cancel_keys.get(driver)
    if cancel is None:
        cancel = _cancel_keys[driver] = driver.pgconn.get_cancel()
    return driver, cancel


_cancel_keys: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def stop_abandoned(driver: Any, cancel: Any, *, again: bool = False) -> None:
    """Cancel the statement the server may still run for ``driver``, without awaiting.

    Needed when the client stopped waiting for it: psycopg, interrupted, cancels it itself, but
    gives up and closes the connection when interrupted again (an anyio cancel scope interrupts
    every await) -- and a backend waiting on a lock does not notice that its client closed the
    connection. ``cancel`` is the cancel key taken while the connection was alive (it works
    after the close). Sent only while a statement runs, or after an interruption (``again``:
    one that is being handled elsewhere): a connection lost in a network failure is not
    waited on.
    """
    running = not driver.closed and (
        driver.pgconn.transaction_status == pq.TransactionStatus.ACTIVE
    )
    if not (running or ((again or _interrupted()) and (driver.closed or driver.broken))):
        return
    with contextlib.suppress(psycopg.Error):  # the backend is gone already
        cancel.cancel()
    if not driver.closed:
        driver.pgconn.finish()


def _interrupted() -> bool:
    """True while an interruption (not an ordinary exception) is being handled."""
    exc = sys.exc_info()[1]
    return exc is not None and not isinstance(exc, Exception)


def adopt_transaction(driver: psycopg.BaseConnection[Any]) -> None:
    """Leave autocommit within the transaction the toolkit began on ``driver``: what
    ``set_autocommit(False)`` does, which psycopg refuses while a transaction is open (it would
    then have begun that transaction itself, and behaves the same from here on: it sends no
    ``BEGIN`` while one is open, ``COMMIT`` and ``ROLLBACK`` at the caller's word, and ``BEGIN``
    before the first statement after them)."""
    driver._autocommit = False


def begin_command(driver: psycopg.BaseConnection[Any]) -> str:
    # The same transaction characteristics psycopg itself would request.
    parts = ["BEGIN"]
    level = driver.isolation_level
    if level is not None:
        parts.append("ISOLATION LEVEL " + IsolationLevel(level).name.replace("_", " "))
    if driver.read_only is not None:
        parts.append("READ ONLY" if driver.read_only else "READ WRITE")
    if driver.deferrable is not None:
        parts.append("DEFERRABLE" if driver.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


def checked(driver: psycopg.BaseConnection[Any], results: list[PGresult]) -> list[PGresult]:
    """The results of a message sent on ``driver`` (one per statement that ran), raising the
    error of a statement that failed as psycopg's cursor raises it (the server runs nothing of
    a message after a failed statement)."""
    if not results:
        raise errors.InternalError("got no result from the query")
    for result in results:
        status = result.status
        if status == _FATAL_ERROR:
            raise errors.error_from_result(result, encoding=driver.info.encoding)
        if status != _TUPLES_OK and status != _COMMAND_OK:
            raise errors.InternalError(
                f"unexpected result status from query: {pq.ExecStatus(status).name}"
            )
    return results


_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK


def statement_rows(
    driver: psycopg.BaseConnection[Any], results: list[PGresult], skip: int, count: int
) -> list[list[tuple[Any, ...]]]:
    """The rows of ``count`` statements of one message, after its first ``skip`` results (the
    PREPAREs and the BEGIN sent ahead of them), loaded as psycopg's cursor loads them (the
    connection's adapters and client encoding)."""
    rows = []
    for result in results[skip : skip + count]:
        loader = adapt.Transformer(driver)
        loader.set_pgresult(result)
        rows.append(loader.load_rows(0, result.ntuples, tuple))
    return rows


def check_unprepared(driver: object) -> None:
    """Refuse a driver connection that would PREPARE statements on its own behind a
    transaction pooler (psycopg's automatic prepares are named per client connection: on a
    shared server connection the same name may mean another client's statement, which then runs
    in place of this one)."""
    if getattr(driver, "prepare_threshold", None) is not None:
        raise ConfigurationError(
            "behind a transaction pooler (pooler='transaction') the engine's connections must "
            "not prepare statements: create it with "
            "connect_args={'prepare_threshold': None}, or pass a URL and let the outbox build it"
        )
