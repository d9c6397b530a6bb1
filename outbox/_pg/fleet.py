"""The relay fleet's locks and discovery in PostgreSQL (the decisions: :mod:`outbox._core.fleet`).

* membership: ``(fleet-member namespace, member key)`` held by every running member on its
  session to the membership database, read back from ``pg_locks`` of that database;
* ownership: ``(fleet-owner namespace, 0)`` held in each database by the one process that
  serves it, on its relay's own session (taken before the relay registers for lanes, so that
  it goes with that session: a killed process frees it at once);
* discovery: the databases of one server whose names match a ``LIKE`` pattern;
* wake-ups: :class:`FleetListener`, one thread waiting (epoll) on the ``LISTEN`` connections of
  every database the process serves, instead of a thread per database waking twice a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from psycopg import sql

from outbox._core.fleet import member_namespace, owner_namespace
from outbox._core.retry import Backoff
from outbox._pg.wakeup import channel

log = logging.getLogger("outbox.wakeup")

_LOCKS_OF = """
SELECT l.objid::bigint FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def member_join(connection: Any, schema: str | None, key: int) -> bool:
    """Take this member's lock on ``connection`` (a driver connection in autocommit); false
    while another live session holds it (a second process with the same member id)."""
    row = connection.execute(
        "SELECT pg_try_advisory_lock(%s, %s)", (member_namespace(schema), key)
    ).fetchone()
    return bool(row and row[0])


def live_members(connection: Any, schema: str | None) -> set[int]:
    """The member keys whose lock some session of this database holds."""
    rows = connection.execute(_LOCKS_OF, (member_namespace(schema),)).fetchall()
    return {int(r[0]) for r in rows}


def owner_try(conn: sa.Connection, schema: str | None) -> bool:
    """Try to take the serving lock of this database on the relay's session ``conn`` (and end
    the transaction the statement opened); true once held."""
    held = conn.exec_driver_sql(
        "SELECT pg_try_advisory_lock(%s, 0)", (owner_namespace(schema),)
    ).scalar_one()
    conn.commit()
    return bool(held)


def owner_pid(conn: sa.Connection, schema: str | None) -> int | None:
    """The backend pid of the session serving this database, if one does."""
    pid = conn.exec_driver_sql(
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.classid = %s "
        "AND l.objid = 0 AND l.objsubid = 2 AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (owner_namespace(schema),),
    ).scalar()
    return None if pid is None else int(pid)


def discover_databases(connection: Any, pattern: str) -> list[str]:
    """Names of the databases on ``connection``'s server that match the ``LIKE`` ``pattern``
    and accept connections (templates left out), in name order."""
    rows = connection.execute(
        "SELECT datname FROM pg_database WHERE datname LIKE %s AND datallowconn "
        "AND NOT datistemplate ORDER BY datname",
        (pattern,),
    ).fetchall()
    return [str(r[0]) for r in rows]


class _Subscription:
    """One database's wake-ups: its ``LISTEN`` connection and the relay's ``kick`` event."""

    def __init__(
        self, owner: FleetListener, connect: Callable[[], Any], schema: str | None, kick: Any
    ) -> None:
        self.owner = owner
        self.connect = connect
        self.channel = channel(schema)
        self.kick = kick
        self.connection: Any = None
        self.backoff = Backoff(0.1, 5.0)
        self.retry_at = 0.0
        self.closed = False

    def join(self, timeout: float) -> None:
        """Stop listening (the relay's shutdown; the name is the per-relay listener's)."""
        self.owner.unsubscribe(self)


class FleetListener:
    """Wake-ups of many relays: a ``LISTEN`` connection per database, one thread waiting on
    all their sockets and one that (re)connects the ones down. A notification (or a lost
    connection, after which something may have committed unseen) sets that relay's ``kick``;
    while a connection is down its relay still polls every ``--poll-interval``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: set[_Subscription] = set()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._due = threading.Event()  # a subscription needs a connection
        self._threads = [
            threading.Thread(target=self._wait, name="outbox-fleet-listen", daemon=True),
            threading.Thread(target=self._connect_due, name="outbox-fleet-connect", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def subscribe(self, connect: Callable[[], Any], schema: str | None, kick: Any) -> _Subscription:
        """Listen for ``schema``'s wake-ups on connections ``connect()`` opens; set ``kick``."""
        subscription = _Subscription(self, connect, schema, kick)
        with self._lock:
            self._subscriptions.add(subscription)
        self._due.set()
        return subscription

    def unsubscribe(self, subscription: _Subscription) -> None:
        with self._lock:
            subscription.closed = True
            self._subscriptions.discard(subscription)
            self._drop(subscription)

    def _drop(self, subscription: _Subscription) -> None:
        # Under self._lock.
        connection, subscription.connection = subscription.connection, None
        if connection is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(connection.fileno())
            with contextlib.suppress(Exception):
                connection.close()
            os.write(self._wake_w, b"x")

    def _connect_due(self) -> None:
        while not self._stop.is_set():
            self._due.wait(0.5)
            self._due.clear()
            now = time.monotonic()
            with self._lock:
                due = [
                    s
                    for s in self._subscriptions
                    if s.connection is None and not s.closed and s.retry_at <= now
                ]
            for subscription in due:
                self._listen(subscription)

    def _listen(self, subscription: _Subscription) -> None:
        connection: Any = None
        try:
            connection = subscription.connect()
            connection.autocommit = True
            connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(subscription.channel)))
        except Exception as exc:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
            delay = subscription.backoff.failed()
            subscription.retry_at = time.monotonic() + delay
            if subscription.backoff.failures == 1:
                log.warning(
                    "event=listen_failed error=%r retry_in=%.1fs", type(exc).__name__, delay
                )
            return
        subscription.backoff.succeeded()
        with self._lock:
            if subscription.closed:
                connection.close()
                return
            subscription.connection = connection
            self._selector.register(connection.fileno(), selectors.EVENT_READ, subscription)
        os.write(self._wake_w, b"x")
        # Something may have committed while nobody listened: look once.
        subscription.kick.set()

    def _wait(self) -> None:
        while not self._stop.is_set():
            ready = self._selector.select(timeout=5.0)
            for key, _ in ready:
                subscription = key.data
                if subscription is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    connection = subscription.connection
                    if connection is None:
                        continue
                    try:
                        pgconn = connection.pgconn
                        pgconn.consume_input()
                        while pgconn.notifies() is not None:
                            pass
                        if pgconn.status != 0:  # CONNECTION_OK
                            raise OSError("connection lost")
                    except Exception:
                        self._drop(subscription)
                        subscription.retry_at = time.monotonic()
                        self._due.set()
                subscription.kick.set()

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        os.write(self._wake_w, b"x")
        for thread in self._threads:
            thread.join(2.0)
        with self._lock:
            for subscription in list(self._subscriptions):
                subscription.closed = True
                self._drop(subscription)
            self._subscriptions.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
