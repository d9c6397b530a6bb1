"""The after-commit wake-up signal: delivered to a listener while a relay waits for work (and
only then), folded under load, harmless when the database is unreachable."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import Outbox, OutboxConfig, migrate
from outbox._pg.fleet import FleetListener
from outbox._pg.lanes import announce_idle
from outbox._pg.wakeup import Listener, channel, make_notifier
from tests.fixtures.common import wait_for


def _listen(
    engine: sa.Engine, schema: str | None
) -> tuple[Listener, threading.Event, threading.Event]:
    def connect() -> Any:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        return psycopg.connect(*cargs, **cparams)

    woken, stop = threading.Event(), threading.Event()
    listener = Listener(connect, schema, woken, stop).start()
    wait_for(listener.listening.is_set, 10, "listener never started listening")
    return listener, woken, stop


@contextmanager
def _waiting_relay(engine: sa.Engine, schema: str | None) -> Iterator[None]:
    """What a relay does while it waits for work: hold the shared ``idle`` lock."""
    with engine.connect() as conn:
        announce_idle(conn, schema, True)
        conn.commit()
        yield
        announce_idle(conn, schema, False)
        conn.commit()


def test_commit_with_events_wakes_a_waiting_relay(database_url: str, engine: sa.Engine) -> None:
    listener, woken, stop = _listen(engine, None)
    ob = Outbox(database_url)
    try:
        woken.clear()  # the listener kicks once when it (re)connects
        with _waiting_relay(engine, None):
            with ob.unit_of_work("no-events"):
                pass
            with ob.unit_of_work("with-event") as uow:
                uow.publish("wakeup-test", b"x")
            assert woken.wait(10), "no notification after a commit that appended an event"
    finally:
        ob.close()
        stop.set()
        listener.join(5)


def test_no_wake_up_while_no_relay_waits(database_url: str, engine: sa.Engine) -> None:
    """Relays busy (or none running): the commit's probe says so, and the process sends
    nothing at all -- its notifier thread does not even ask, but for the first commit on a
    connection, whose statement is not prepared yet and so goes without the probe."""
    listener, woken, stop = _listen(engine, None)
    ob = Outbox(database_url)
    try:
        woken.clear()
        for n in range(20):
            with ob.unit_of_work(f"busy-{n}") as uow:
                uow.publish("wakeup-test", b"x")
        assert not woken.wait(1.0), "a notification although no relay waits"
        assert ob._notify.sent == 0  # type: ignore[attr-defined]
        assert ob._notify.rounds <= 2  # type: ignore[attr-defined]
        with _waiting_relay(engine, None):  # a relay starts waiting: the next commit wakes it
            with ob.unit_of_work("idle-now") as uow:
                uow.publish("wakeup-test", b"x")
            assert woken.wait(10)
    finally:
        ob.close()
        stop.set()
        listener.join(5)


def test_wake_relays_off_sends_no_notification(database_url: str, engine: sa.Engine) -> None:
    # A schema of its own: its channel hears no other test's notifications.
    migrate.upgrade(engine, schema="quiet")
    listener, woken, stop = _listen(engine, "quiet")
    ob = Outbox(database_url, config=OutboxConfig(schema="quiet", wake_relays=False))
    try:
        woken.clear()
        with _waiting_relay(engine, "quiet"):
            with ob.unit_of_work("quiet") as uow:
                uow.publish("wakeup-test", b"x")
            assert not woken.wait(1.0), "a notification came although wake_relays is off"
            # The listener still hears others: the silence above was the setting, not a dead
            # line.
            notify = make_notifier(engine, None, "quiet")
            notify()
            assert woken.wait(10)
    finally:
        ob.close()
        stop.set()
        listener.join(5)


def test_a_burst_of_commits_is_folded_into_few_notifications(engine: sa.Engine) -> None:
    migrate.upgrade(engine, schema="billing")
    listener, woken, stop = _listen(engine, "billing")
    notify = make_notifier(engine, None, "billing")
    try:
        with _waiting_relay(engine, "billing"):
            woken.clear()
            for _ in range(2000):
                notify()
            assert woken.wait(10)
            # The listener can be woken before the sending thread has counted its notification.
            wait_for(lambda: notify.sent >= 1, 10, "no notification was counted")  # type: ignore[attr-defined]
            sent = notify.sent  # type: ignore[attr-defined]
            assert 1 <= sent < 200, f"{sent} notifications for 2000 commits"
            # The last call is covered: a later notification still arrives.
            woken.clear()
            notify()
            assert woken.wait(10)
        # Nobody waits: the thread still asks, but sends nothing.

        def one_round() -> None:
            counted = notify.rounds  # type: ignore[attr-defined]
            notify()
            wait_for(lambda: notify.rounds > counted, 10, "no round")  # type: ignore[attr-defined]

        one_round()  # a round that began while the relay still waited has ended now
        before = notify.sent  # type: ignore[attr-defined]
        woken.clear()
        one_round()  # began after: it asks and sends nothing
        assert not woken.wait(0.5)
        assert notify.sent == before  # type: ignore[attr-defined]
    finally:
        stop.set()
        listener.join(5)
    assert channel("billing") == "outbox_wakeup__billing" and channel(None) == "outbox_wakeup"


def test_a_joined_commit_wakes_through_its_read_back(
    database_url: str, engine: sa.Engine, redis_url: str, redis_prefix: str
) -> None:
    """With Redis, the read-back after the caller's commit carries the idle probe: while no
    relay waits the notifier thread is not called at all, and a waiting relay is woken."""
    listener, woken, stop = _listen(engine, None)
    ob = Outbox(database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix))
    callers = sa.create_engine(database_url)

    def joined(key: str) -> None:
        with callers.begin() as conn, ob.unit_of_work(key, connection=conn) as uow:
            uow.publish("wakeup-test", b"x")

    try:
        woken.clear()
        for n in range(10):
            joined(f"busy-{n}")
        assert not woken.wait(1.0), "a notification although no relay waits"
        assert ob._notify.rounds == 0  # type: ignore[attr-defined]
        with _waiting_relay(engine, None):
            joined("idle-now")
            assert woken.wait(10), "no notification after a joined commit with an event"
    finally:
        ob.close()
        callers.dispose()
        stop.set()
        listener.join(5)


def test_a_fleet_relay_is_woken_by_a_notification_its_driver_read_already(
    engine: sa.Engine,
) -> None:
    """A notification that came in on a fleet relay's session behind a statement's results is
    read off the socket by the driver without reaching the notify handler; the relay's next
    wait must still see it (the socket will not signal it again), not sleep until the poll."""
    listener = FleetListener()
    kick = threading.Event()
    watch = listener.watch(None, kick)
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    sender = psycopg.connect(*cargs, **cparams, autocommit=True)
    try:
        with engine.connect() as conn:
            watch.session(conn)
            driver = conn.connection.driver_connection
            assert driver is not None
            pgconn = driver.pgconn
            sender.execute(f"NOTIFY {channel(None)}")
            # What the driver does while it fetches a statement's results: read the socket
            # into libpq's buffer, leaving the notification there unparsed, the socket empty.
            deadline = time.monotonic() + 10
            while not select.select([pgconn.socket], [], [], 0.1)[0]:
                assert time.monotonic() < deadline, "the notification never arrived"
            pgconn.consume_input()
            assert not select.select([pgconn.socket], [], [], 0.2)[0]
            kick.clear()  # set by watch.session (a first look)
            watch.wait(5.0)
            assert kick.is_set(), "the relay slept through a notification its session holds"
            assert watch.waits == 0, "it waited on the socket for a notification it had"
            watch.join(1.0)
    finally:
        sender.close()
        listener.close()
