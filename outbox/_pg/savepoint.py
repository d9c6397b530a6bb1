# generated from outbox/_pg/savepoint_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/_pg/savepoint_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import pq
from sqlalchemy import Connection

from outbox._pg.literals import execute_text
from outbox._pg.statements import Prepared
from outbox._pg.transaction_base import SWITCHED, adopt_transaction, begin_command, install_guard

# Engines whose pools discard a connection left switched to autocommit (checked on every claim
# that begins a transaction: cheaper than SQLAlchemy's event lookups).
_guarded: weakref.WeakSet[sa.Engine] = weakref.WeakSet()

# Up to this many bytes of event values (and events), a final statement goes as literals with
# the savepoint's release; larger ones are bound by the driver, in binary.
INLINE_LIMIT = 64 * 1024
INLINE_EVENTS = 16


def driver_of(connection: Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection under a caller's connection, or ``None``: another driver, a
    connection SQLAlchemy no longer holds, or a client encoding other than UTF-8 (where a joined
    unit of work's texts are bound by the driver, as the caller's own are, and refused with the
    same error when the encoding cannot carry them: :func:`outbox._pg.literals.untranslatable`)."""
    if connection.invalidated or connection.closed:
        return None
    raw = connection.connection
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.Connection) or driver.info.encoding != "utf-8":
        return None
    return driver


class DriverSavepoint:
    """A savepoint named after the unit of work's token, with the interface the unit of work
    uses of SQLAlchemy's (``is_active``, ``commit()``, ``rollback()``)."""

    __slots__ = ("_connection", "_driver", "_name", "is_active")

    def __init__(self, connection: Connection, driver: psycopg.Connection[Any], unit: str) -> None:
        self._connection = connection
        self._driver = driver
        self._name = f"outbox_unit_{unit}".encode()
        self.is_active = False

    def open_with(self, claim: Prepared, params: dict[str, Any]) -> tuple[Any, ...]:
        """Set the savepoint and run ``claim`` in one message; return the claim's row. On a
        failure the savepoint is rolled back (if it was set) before the error is raised.

        A caller's transaction that SQLAlchemy has begun but the server has not yet (psycopg
        sends ``BEGIN`` before a transaction's first statement, in a round trip of its own)
        is begun in the same message, with the characteristics psycopg would ask for: the
        claim then costs the caller's transaction no round trip of its own. psycopg, switched
        to autocommit for that message so that it sends no ``BEGIN`` first, is switched back
        at once (:func:`~outbox._pg.transaction_base.adopt_transaction`): it follows the
        server's transaction status, so the caller's statements and its ``COMMIT`` go on as if
        psycopg had begun the transaction itself."""
        driver = self._driver
        status = driver.pgconn.transaction_status
        message = b"SAVEPOINT " + self._name + b"; " + self._text(claim, params)
        begin = status == pq.TransactionStatus.IDLE and not driver.autocommit
        skip = 1
        if begin:
            message = begin_command(driver).encode() + b"; " + message
            skip = 2
            # Interrupted before psycopg is switched back, the connection is discarded when
            # it returns to its pool (outbox._pg.transaction_base.install_guard).
            guard(self._connection.engine)
            self._connection.info[SWITCHED] = True
        # The SAVEPOINT runs unless the caller's transaction has failed already.
        healthy = status != pq.TransactionStatus.INERROR
        cursor = driver.cursor()
        try:
            try:
                if begin:
                    driver.set_autocommit(True)
                cursor.execute(message)
            finally:
                if begin:
                    adopt_transaction(driver)
                    del self._connection.info[SWITCHED]
        except psycopg.Error as exc:
            self.is_active = healthy
            with contextlib.suppress(Exception):
                self.rollback()
            raise self._translate(message, exc) from exc
        except BaseException:
            self.is_active = True  # interrupted: the caller's handler rolls back to it
            raise
        self.is_active = True
        for _ in range(skip):
            cursor.nextset()
        row = cursor.fetchone()
        assert row is not None
        return tuple(row)

    def release_with(self, final: Prepared, params: dict[str, Any]) -> None:
        """Run ``final`` and release the savepoint in one message; on a failure the savepoint
        stays open (the server skipped the ``RELEASE``)."""
        message = self._text(final, params) + b"; RELEASE SAVEPOINT " + self._name
        try:
            self._driver.execute(message)
        except psycopg.Error as exc:
            raise self._translate(message, exc) from exc
        self.is_active = False

    def commit(self) -> None:
        """Release the savepoint (its work joins the caller's transaction)."""
        self._send(b"RELEASE SAVEPOINT " + self._name)
        self.is_active = False

    def rollback(self) -> None:
        """Roll back to the savepoint: its work goes, the caller's earlier work stays. Nothing
        is sent on a connection that is gone (as SQLAlchemy's own savepoints do)."""
        if not self.is_active:
            return
        self.is_active = False
        driver = self._driver
        if driver.closed or driver.broken or self._connection.invalidated:
            return
        self._send(b"ROLLBACK TO SAVEPOINT " + self._name)

    def _text(self, statement: Prepared, params: dict[str, Any]) -> bytes:
        return execute_text(self._driver, statement, params, inline=True)

    def _send(self, message: bytes) -> None:
        try:
            self._driver.execute(message)
        except psycopg.Error as exc:
            raise self._translate(message, exc) from exc

    def _translate(self, message: bytes, exc: psycopg.Error) -> Exception:
        """``exc`` as SQLAlchemy raises a driver's error; a broken connection is invalidated."""
        broken = self._driver.broken or self._driver.closed
        if broken:
            self._connection.invalidate(exc)
        return sa.exc.DBAPIError.instance(
            message.decode(errors="replace")[:200], None, exc, psycopg.Error,
            connection_invalidated=broken,
        )  # fmt: skip


def guard(engine: sa.Engine) -> None:
    """The pool guard on the engine of a caller's connection (its own, or the outbox's)."""
    if engine not in _guarded:
        install_guard(engine)
        _guarded.add(engine)
