"""Wake-up signal from units of work to idle relays: ``pg_notify`` after the commit, only while a
relay waits for work.

Why not ``NOTIFY`` inside the business transaction: PostgreSQL takes a database-wide lock on the
notification queue when a transaction that notified commits, so every writer would commit one
at a time. Instead the unit of work calls the notifier *after* its commit. The notifier only
sets a flag (no I/O in the caller's thread); one background thread per process then sends, on
its own connection, in its own tiny transaction with asynchronous commit (a wake-up needs no
fsync), ``pg_notify`` -- but only if some relay holds the ``idle`` lock, which relays take
while they wait for work (:func:`outbox._pg.lanes.announce_idle`); and it pauses
``MIN_INTERVAL`` after each round. Commits during the pause only set the flag again and share
the next round.

A unit of work also asks the question itself, in the same message as its ``COMMIT``
(``Statements.relay_idle_probe``), and calls the notifier only when the answer is yes: while
every relay is busy draining (or none runs), writers send nothing and their thread stays asleep.
Without the probe (a unit of work joined to the caller's transaction, a keyless publish), the
thread asks before it sends.

No commit is ever left without a wake-up it needs: a relay takes the ``idle`` lock and then
claims once more before it waits, so a commit either probes while the lock is held (and
wakes it) or came before the lock and is seen by that claim. The flag is cleared *before* the
thread sends, so a commit that sets it afterwards causes another round. A lost notification
(connection down) only delays a row until the relay's next poll (``--poll-interval``), the
backstop.

The relay listens on the same channel (:class:`Listener`) and wakes its loop through a
``threading.Event``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import sqlalchemy as sa
from psycopg import sql

from outbox._core.environment import ENV_WAKEUP_INTERVAL
from outbox._core.retry import Backoff
from outbox._pg.lanes import idle_probe_sql
from outbox.schema import validate_schema_name

log = logging.getLogger("outbox.wakeup")

CHANNEL = "outbox_wakeup"
_RETRY_AFTER = 1.0
ENV_INTERVAL = ENV_WAKEUP_INTERVAL
DEFAULT_INTERVAL = 0.001


def _interval_from_env() -> float:
    """The pause after each notification, in seconds (``OUTBOX_WAKEUP_INTERVAL``).

    It bounds the rounds of the notifier thread per writer process (and the extra wait of a
    commit that lands just after one). A round is a small statement on the notifier's
    connection, a notification only while a relay waits; units of work of the process's own
    transactions start a round only when their commit found a relay waiting.
    """
    raw = os.environ.get(ENV_INTERVAL)
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        log.warning(
            "event=bad_setting %s=%r (seconds, 0 < x <= 1); using %.3f",
            ENV_INTERVAL,
            raw,
            DEFAULT_INTERVAL,
        )
        return DEFAULT_INTERVAL
    return value


MIN_INTERVAL = _interval_from_env()


def channel(schema: str | None) -> str:
    """The LISTEN/NOTIFY channel of the outbox in ``schema`` (an allow-listed identifier)."""
    schema = validate_schema_name(schema)
    return CHANNEL if schema is None else f"{CHANNEL}__{schema}"


class _Notifier:
    """Coalescing, non-blocking sender of wake-up notifications for one engine and schema."""

    def __init__(self, engine: sa.Engine, schema: str | None) -> None:
        self._engine = engine
        self._channel = channel(schema)
        # Notify only while a relay waits for work: one statement that probes and sends. A
        # wake-up needs no durability: without synchronous_commit off, every notification
        # would be a commit waiting for its own WAL flush, doubling the writers' fsync load.
        # Set for the statement's own transaction only, never for the session: behind a
        # transaction pooler a session setting would stay on a server connection that other
        # clients get next.
        self._statement = (
            f"SELECT pg_notify(%s, '') WHERE ({idle_probe_sql(schema)}) "
            "AND set_config('synchronous_commit', 'off', true) IS NOT NULL"
        )
        self._pending = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._connection: Any = None
        self.rounds = 0
        self.sent = 0

    def __call__(self) -> None:
        # Called by the unit of work after every commit that appended outbox rows. It must be
        # cheap and never raise: the commit already happened and the caller's work is done.
        try:
            self._pending.set()
            if self._pid != os.getpid() or self._thread is None:
                self._start()
        except Exception:  # pragma: no cover - defensive, the relay's poll is the backstop
            log.debug("event=wakeup_notify_failed", exc_info=True)

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None:
                return
            # After a fork the parent's thread and connection are not ours: start afresh.
            self._pid = os.getpid()
            self._connection = None
            self._thread = threading.Thread(
                target=self._run, name="outbox-wakeup-notifier", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            self._pending.clear()
            try:
                self._send()
            except Exception as exc:
                log.debug("event=wakeup_send_failed error=%r", type(exc).__name__)
                self._drop()
                time.sleep(_RETRY_AFTER)  # bounded; relays fall back to polling meanwhile
            # At most one round per MIN_INTERVAL: each costs the database a small statement
            # and this process a thread switch; commits meanwhile only set the flag and are
            # covered by the next round.
            time.sleep(MIN_INTERVAL)

    def _send(self) -> None:
        if self._connection is None:
            raw = self._engine.raw_connection()
            driver = raw.driver_connection
            # Our own connection for the process's lifetime, not a slot of the caller's pool.
            raw.detach()
            if driver is None:
                raise RuntimeError("the engine's driver connection is not available")
            driver.autocommit = True
            # No server-side prepared statement: behind a transaction pooler its name would be
            # left on a server connection where another client's statement of the same name
            # is expected (and would run in its place).
            driver.prepare_threshold = None
            self._connection = driver
        cursor = self._connection.execute(self._statement, (self._channel,))
        self.rounds += 1
        self.sent += cursor.rowcount

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


def make_notifier(engine: Any, redis: Any, schema: str | None) -> Callable[[], None]:
    """Return the callable a unit of work invokes after a commit that appended outbox rows.

    The call returns at once and never raises. ``redis`` is accepted for interface stability
    and not used: relays need nothing but PostgreSQL, and a ``pg_notify`` outside the business
    transaction costs writers no more than a Redis ``PUBLISH`` did when measured (docs/relay.md,
    "Benchmark").
    """
    if not isinstance(engine, sa.Engine):
        return noop
    return _Notifier(engine, schema)


def noop() -> None:
    """The notifier of an outbox that does not wake relays (``OutboxConfig.wake_relays``)."""
    return None


class Wakeups(Protocol):
    """A relay's source of wake-ups (a :class:`Listener`, or a fleet's
    :class:`outbox._pg.fleet.Watch` on the relay's own session): ``wait`` waits for the
    relay's kick, ``join`` ends it."""

    def wait(self, timeout: float) -> None: ...

    def join(self, timeout: float) -> None: ...


class Listener:
    """The relay's side: ``LISTEN`` on a dedicated connection and set ``event`` on every
    notification, from a daemon thread. Reconnects by itself; while it is down the relay still
    polls every ``--poll-interval``."""

    def __init__(
        self,
        connect: Callable[[], Any],
        schema: str | None,
        event: threading.Event,
        stop: threading.Event,
    ) -> None:
        self._connect = connect
        self._channel = channel(schema)
        self._event = event
        self._stop = stop
        self._thread = threading.Thread(target=self._run, name="outbox-relay-listen", daemon=True)
        self.listening = threading.Event()

    def start(self) -> Listener:
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff = Backoff(0.1, 5.0)
        while not self._stop.is_set():
            connection: Any = None
            try:
                connection = self._connect()
                connection.autocommit = True
                connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                backoff.succeeded()
                # Something may have committed while we were not listening: look once. This
                # kick comes before `listening` is announced, so whoever waits for `listening`
                # and then for a wake-up sees a notification, not this kick.
                self._event.set()
                self.listening.set()
                while not self._stop.is_set():
                    for _ in connection.notifies(timeout=0.5, stop_after=1):
                        self._event.set()
            except Exception as exc:
                self.listening.clear()
                delay = backoff.failed()
                log.warning(
                    "event=listen_failed error=%r retry_in=%.1fs", type(exc).__name__, delay
                )
                self._stop.wait(delay)
            finally:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        connection.close()
        self.listening.clear()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a wake-up (or anything else that sets the event)."""
        self._event.wait(timeout)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
