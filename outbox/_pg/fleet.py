"""The relay fleet's locks and discovery in PostgreSQL (the decisions: :mod:`outbox._core.fleet`).

* membership: ``(fleet-member namespace, member key)`` held by every running member on its
  session to the membership database, read back from ``pg_locks`` of that database;
* ownership: ``(fleet-owner namespace, 0)`` held in each database by the one process that
  serves it, on its relay's own session (taken before the relay registers for lanes, so that
  it goes with that session: a killed process frees it at once);
* discovery: the databases of one server whose names match a ``LIKE`` pattern;
* wake-ups: :class:`FleetListener`, one thread waiting (epoll) on the sessions of the relays
  that wait for work, each listening on its own session (:class:`Watch`): one connection per
  database served, none for wake-ups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
from typing import Any

import sqlalchemy as sa
from psycopg import sql

from outbox._core.fleet import member_namespace, owner_namespace
from outbox._pg.wakeup import channel

log = logging.getLogger("outbox.wakeup")

_LOCKS_OF = """
SELECT l.objid::bigint FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.classid = %s AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


def members_channel(schema: str | None) -> str:
    """The channel on which a member that joined tells the others to read the members again."""
    return channel(schema).replace("outbox_wakeup", "outbox_fleet_members", 1)


def member_join(connection: Any, schema: str | None, key: int) -> bool:
    """Take this member's lock on ``connection`` (a driver connection in autocommit), listen
    for members joining and announce this one; false while another live session holds the
    lock (a second process with the same member id)."""
    row = connection.execute(
        "SELECT pg_try_advisory_lock(%s, %s)", (member_namespace(schema), key)
    ).fetchone()
    if not (row and row[0]):
        return False
    name = members_channel(schema)
    connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(name)))
    connection.execute("SELECT pg_notify(%s, '')", (name,))
    return True


def members_gone(connection: Any, schema: str | None, keys: list[int]) -> bool:
    """Whether any of the member ``keys`` has no live holder any more: a shared lock on a
    member's key is granted only while no session holds the member's own (exclusive) one.
    Much cheaper than reading ``pg_locks`` (which copies every lock of the server); the lock
    lasts as long as the statement (autocommit)."""
    if not keys:
        return False
    row = connection.execute(
        "SELECT bool_or(pg_try_advisory_xact_lock_shared(%s, k)) FROM unnest(%s::int[]) k",
        (member_namespace(schema), keys),
    ).fetchone()
    return bool(row and row[0])


def member_announced(connection: Any) -> bool:
    """Whether a member announced itself (:func:`member_join`) on ``connection`` since the
    last call: reads what arrived on the socket, without a statement."""
    connection.pgconn.consume_input()
    return _queued(connection)


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


class Watch:
    """One relay's wake-ups on its own session: ``LISTEN`` runs on the session the relay
    already holds (:meth:`session`), and while the relay waits for work (:meth:`wait`) the
    fleet's listener thread watches that session's socket for it. No connection of its own.

    A notification that arrives while the relay uses its session is read by the driver with
    the statement's results and sets ``kick`` through a notify handler (without one, the
    driver would keep it in a backlog nobody reads)."""

    def __init__(self, owner: FleetListener, schema: str | None, kick: threading.Event) -> None:
        self.owner = owner
        self.channel = channel(schema)
        self.kick = kick
        self.driver: Any = None  # the session's psycopg connection, once listening
        self.parked = False
        self.waits = 0  # waits spent watched by the listener thread (tests read it)

    def session(self, conn: sa.Connection) -> None:
        """Listen on the relay's new session ``conn`` (ends the transaction it opens)."""
        driver = conn.connection.driver_connection
        if driver is None:  # pragma: no cover - a live session always has one
            raise RuntimeError("the session's driver connection is not available")
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(self.channel))
        conn.exec_driver_sql(listen.as_string(driver))
        conn.commit()
        driver.add_notify_handler(self._notified)
        self.driver = driver
        # Something may have committed while nobody listened: look once.
        self.kick.set()

    def _notified(self, _notify: Any) -> None:
        self.kick.set()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for ``kick`` (a notification, a stop, a lost session), the
        session's socket watched meanwhile by the fleet's listener thread."""
        driver = self.driver
        if driver is None or driver.closed or driver.pgconn.transaction_status != _IDLE:
            # No session listening, or one inside a transaction (the server holds its
            # notifications until it ends): the poll timer alone.
            self.kick.wait(timeout)
            return
        if _queued(driver):
            # A notification that came in with the last statement's results, behind them:
            # the driver read it off the socket but never handed it over, and the socket
            # will not say so again.
            self.kick.set()
            return
        self.owner.park(self, driver)
        try:
            self.waits += 1
            self.kick.wait(timeout)
        finally:
            self.owner.unpark(self)

    def join(self, timeout: float) -> None:
        """The relay's shutdown (the name is the per-relay listener's)."""
        self.owner.unpark(self)
        self.driver = None


# libpq's PQTRANS_IDLE: the session is not inside a transaction.
_IDLE = 0


def _queued(driver: Any) -> bool:
    """Whether notifications wait in ``driver``'s buffer (taking them out). psycopg hands
    notifications to the notify handler before it asks libpq for a statement's last result,
    and asking parses whatever followed that result in the same read: a notification sent
    right after a statement's answer can stay queued in libpq, its bytes gone from the socket,
    so a wait on the socket alone would sleep until the poll timer."""
    found = False
    pgconn = driver.pgconn
    while pgconn.notifies() is not None:
        found = True
    return found


class FleetListener:
    """Wake-ups of many relays from one thread: while a relay waits for work its session's
    socket is in this thread's ``epoll`` set; whatever arrives on it (a notification, or the
    connection closing) sets that relay's ``kick`` and takes the socket out of the set again,
    so the relay reads its own session from then on. While a relay's session is down the
    relay still polls every ``--poll-interval``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._parked: dict[Watch, int] = {}  # the watches parked now, and their sockets
        self._thread = threading.Thread(target=self._wait, name="outbox-fleet-listen", daemon=True)
        self._thread.start()

    def watch(self, schema: str | None, kick: threading.Event) -> Watch:
        """A relay's wake-ups on its own session (``schema``'s channel), setting ``kick``."""
        return Watch(self, schema, kick)

    def park(self, watch: Watch, driver: Any) -> None:
        """Watch ``driver``'s socket for ``watch`` until :meth:`unpark` (the relay does not
        touch the session meanwhile)."""
        with self._lock:
            if self._stop.is_set():
                return
            fileno = driver.pgconn.socket
            self._selector.register(fileno, selectors.EVENT_READ, (watch, driver))
            self._parked[watch] = fileno
            watch.parked = True

    def unpark(self, watch: Watch) -> None:
        """Give ``watch``'s session back to its relay (nothing if it is not parked)."""
        with self._lock:
            self._unpark(watch)

    def _unpark(self, watch: Watch) -> None:
        # Under self._lock.
        fileno = self._parked.pop(watch, None)
        watch.parked = False
        if fileno is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(fileno)

    def _wait(self) -> None:
        while not self._stop.is_set():
            ready = self._selector.select(timeout=30.0)
            for key, _ in ready:
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                watch, driver = key.data
                with self._lock:
                    if self._parked.get(watch) != key.fd:
                        continue  # given back meanwhile
                    with contextlib.suppress(Exception):
                        # Read what came (the relay reads its session again from now on;
                        # a broken connection fails the relay's next statement).
                        pgconn = driver.pgconn
                        pgconn.consume_input()
                        while pgconn.notifies() is not None:
                            pass
                    self._unpark(watch)
                watch.kick.set()

    def close(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(2.0)
        with self._lock:
            for watch in list(self._parked):
                self._unpark(watch)
                watch.kick.set()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
