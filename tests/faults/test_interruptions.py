"""Units of work interrupted anywhere -- KeyboardInterrupt, SystemExit, asyncio and anyio
cancellation -- hand their connection back idle and clean, or have it discarded, and free their
key at once, also when the interruption finds the final statement waiting on another
transaction's per-key order lock. Afterwards, hundreds of units of work on the same pool run
without an error.

Where the interruption lands is chosen by a seeded random generator: the n-th line executed in
the toolkit, SQLAlchemy or psycopg (sync), or the n-th scheduling point of the event loop
(asyncio, anyio). The order-lock case is driven by what pg_locks shows, not by time.
"""

from __future__ import annotations

import asyncio
import functools
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox._core.claim import lock_id
from tests.fixtures.common import wait_for
from tests.fixtures.uow import INSERT_ORDER, create_orders

ROUNDS = 60  # interrupted units of work per flavour
AFTER = 200  # units of work that must then run cleanly
SEEDS = [11, 12]
INTERRUPTS: list[type[BaseException]] = [KeyboardInterrupt, SystemExit]
# No relay wake-ups: their thread's short transactions are not under test here.
QUIET = outbox.OutboxConfig(wake_relays=False)
WATCHED = ("/outbox/", "/sqlalchemy/", "/psycopg/")

# Every backend of this test's database other than the one asking: what it is doing.
ACTIVITY = sa.text(
    "SELECT pid, state, query FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND backend_type = 'client backend'"
)
HELD_ADVISORY = sa.text(
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE l.locktype = 'advisory' AND a.datname = current_database()"
)
WAITING = sa.text(
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.datname = current_database()"
)


def _key_held(engine: sa.Engine, key: str) -> bool:
    unsigned = lock_id("default", key) & 0xFFFFFFFFFFFFFFFF
    query = sa.text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid::bigint = :hi AND objid::bigint = :lo AND objsubid = 1"
    )
    with engine.connect() as conn:
        return bool(
            conn.execute(query, {"hi": unsigned >> 32, "lo": unsigned & 0xFFFFFFFF}).scalar()
        )


def _clean(engine: sa.Engine) -> None:
    """Nothing of the interrupted attempts is left on the server: no advisory lock held or
    awaited, no connection in a transaction or running a statement.

    A connection the client closed takes its locks along only when its server process has
    exited, a moment after the socket closed: the check waits up to 10 s for that. A connection
    still in use (handed out again, or leaked) never gets there."""
    seen: list[object] = []

    def clean() -> bool:
        with engine.connect() as conn:
            held = conn.execute(HELD_ADVISORY).scalar()
            busy = [tuple(row) for row in conn.execute(ACTIVITY) if row.state != "idle"]
        seen[:] = [held, busy]
        return held == 0 and busy == []

    try:
        wait_for(clean, 10, "left on the server")
    except TimeoutError:
        pytest.fail(f"left on the server after 10 s: advisory locks held, busy sessions: {seen}")


@pytest.fixture
def orders(engine: sa.Engine) -> Iterator[None]:
    create_orders(engine)
    yield


# -- sync: KeyboardInterrupt and SystemExit at the n-th line ------------------------------------


class _Tripwire:
    """Raise ``kind`` at the ``at``-th line executed in the toolkit, SQLAlchemy or psycopg.

    Not while psycopg opens a connection: an interruption there leaves psycopg's own half-made
    connection to the garbage collector, which is psycopg's business, not the toolkit's.
    """

    def __init__(self, at: int, kind: type[BaseException]) -> None:
        self.at = at
        self.kind = kind
        self.lines = 0
        self.paused = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            name = frame.f_code.co_filename
            if "/psycopg/" in name and "connect" in frame.f_code.co_name:
                self.paused += 1
                return self._resume
            return self if any(part in name for part in WATCHED) else None
        if event == "line" and not self.paused:
            self.lines += 1
            if self.lines == self.at:
                sys.settrace(None)
                raise self.kind(f"interrupted at line {self.at}")
        return self

    def _resume(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "return":
            self.paused -= 1
        return self._resume


def _sync_body(ob: outbox.Outbox, key: str, mode: str, engine: sa.Engine) -> None:
    def body(uow: outbox.UnitOfWork) -> None:
        if uow.replayed:
            return
        uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
        uow.publish("chaos.events", {"key": key}, key="hot" if key[-1] in "02468" else key)
        uow.result = {"key": key}

    if mode == "owned":
        with ob.unit_of_work(key) as uow:
            body(uow)
    else:
        with engine.connect() as conn:
            with ob.unit_of_work(key, connection=conn) as uow:
                body(uow)
            conn.commit()


def _lines_of_one(ob: outbox.Outbox, engine: sa.Engine) -> int:
    counter = _Tripwire(at=-1, kind=KeyboardInterrupt)
    sys.settrace(counter)
    try:
        _sync_body(ob, "measure", "owned", engine)
    finally:
        sys.settrace(None)
    return counter.lines


# An interruption inside an event handler the pool calls (the toolkit's among them) can leave
# the pool without the connection it was checking in: the garbage collector closes it (psycopg
# warns), its backend ends, and the pool opens another. Discarded, as it should be.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("seed", SEEDS)
def test_sync_interrupted_anywhere_then_hundreds_run(
    engine: sa.Engine, database_url: str, orders: None, seed: int
) -> None:
    rng = random.Random(seed)
    pooled = sa.create_engine(database_url, pool_size=3, max_overflow=0, pool_timeout=10)
    try:
        with outbox.Outbox(pooled, config=QUIET) as ob:
            lines = _lines_of_one(ob, pooled)
            interrupted = 0
            for i in range(ROUNDS):
                wire = _Tripwire(rng.randrange(1, lines + 1), rng.choice(INTERRUPTS))
                sys.settrace(wire)
                try:
                    _sync_body(ob, f"s{seed}-{i}", rng.choice(["owned", "joined"]), pooled)
                except BaseException as exc:
                    # SQLAlchemy, interrupted in its own code, may raise an error of its own
                    # (an assertion in a finally clause) with the interruption as its context.
                    if not _caused_by_interruption(exc):
                        raise
                    interrupted += 1
                finally:
                    sys.settrace(None)
            assert interrupted > ROUNDS // 4
            _clean(engine)
            for i in range(AFTER):
                _sync_body(ob, f"after-{i}", "owned" if i % 2 else "joined", pooled)
            _clean(engine)
    finally:
        pooled.dispose()


def _caused_by_interruption(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return True
        exc = exc.__context__
    return False


@pytest.mark.parametrize("kind", INTERRUPTS)
def test_interrupted_commit_of_a_joined_connection_is_not_handed_out_again(
    database_url: str, engine: sa.Engine, orders: None, kind: type[BaseException]
) -> None:
    # An interruption inside SQLAlchemy's commit (here: in an event handler, where a signal may
    # land as well) leaves the pool believing the transaction ended; the server still holds it.
    pooled = sa.create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=10)

    def interrupt(_conn: sa.Connection) -> None:
        raise kind("interrupted in commit")

    try:
        with outbox.Outbox(pooled, config=QUIET) as ob:
            with pytest.raises(kind), pooled.connect() as conn:
                with ob.unit_of_work("joined", connection=conn) as uow:
                    uow.result = 1
                sa.event.listen(pooled, "commit", interrupt, once=True)
                conn.commit()
            _clean(engine)
            for i in range(3):  # the pool's only connection, or its replacement
                with ob.unit_of_work(f"next-{i}") as uow:
                    uow.result = i
            with pooled.connect() as conn:
                conn.execute(INSERT_ORDER, {"k": "caller", "a": 1})
                conn.rollback()  # not committed by an autocommit left behind
    finally:
        pooled.dispose()
    assert _count(engine, sa.text("SELECT count(*) FROM orders")) == 0
    _clean(engine)


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: a command run in-process
    earlier in the session may have installed its graceful-stop handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sync_interrupt_while_waiting_on_an_order_lock_frees_the_key(
    engine: sa.Engine, database_url: str, orders: None, default_sigint: None
) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signals reach the main thread only")
    with outbox.Outbox(engine, config=QUIET) as ob, engine.connect() as holder:
        # Another transaction wrote an event of message key "hot" and has not committed:
        # a later writer of "hot" waits for it in its final statement.
        with ob.unit_of_work("holder", connection=holder) as uow:
            uow.publish("chaos.events", "first", key="hot")
        main = threading.main_thread().ident
        assert main is not None

        seen: list[str] = []

        def interrupt_when_waiting() -> None:
            try:
                wait_for(lambda: _count(engine, WAITING) >= 1, 60, "the victim never waited")
                seen.append("waiting")
            except BaseException as exc:  # interrupt anyway: never leave the victim hanging
                seen.append(repr(exc))
            signal.pthread_kill(main, signal.SIGINT)

        helper = threading.Thread(target=interrupt_when_waiting, daemon=True)
        helper.start()
        with pytest.raises(KeyboardInterrupt), ob.unit_of_work("victim") as uow:
            uow.publish("chaos.events", "second", key="hot")
        helper.join(30)
        assert seen == ["waiting"], f"interrupted before the victim waited on the lock: {seen}"
        # The holder is still open: only a cancelled backend can have let go of the key.
        wait_for(lambda: not _key_held(engine, "victim"), 10, "the victim's backend kept its key")
        with ob.unit_of_work("victim") as uow:
            assert not uow.replayed
            uow.result = "second try"
        holder.commit()
    _clean(engine)


def _count(engine: sa.Engine, query: sa.TextClause) -> int:
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


# -- asyncio and anyio: cancelled at the n-th scheduling point ----------------------------------


async def _async_body(aob: outbox.AsyncOutbox, key: str, mode: str) -> None:
    async def body(uow: outbox.AsyncUnitOfWork) -> None:
        if uow.replayed:
            return
        await uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
        uow.publish("chaos.events", {"key": key}, key="hot" if key[-1] in "02468" else key)
        uow.result = {"key": key}

    if mode == "owned":
        async with aob.unit_of_work(key) as uow:
            await body(uow)
    else:
        async with aob.engine.connect() as conn:
            async with aob.unit_of_work(key, connection=conn) as uow:
                await body(uow)
            await conn.commit()


async def _asyncio_cancel_after(steps: int, work: Callable[[], Any]) -> bool:
    task = asyncio.get_running_loop().create_task(work())
    for _ in range(steps):
        if task.done():
            break
        await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def _anyio_cancel_after(steps: int, work: Callable[[], Any]) -> bool:
    scope = anyio.CancelScope()
    done = anyio.Event()

    async def run() -> None:
        try:
            with scope:
                await work()
        finally:
            done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        for _ in range(steps):
            if done.is_set():
                break
            await anyio.lowlevel.checkpoint()
        scope.cancel()
    return scope.cancelled_caught


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("canceller", ["asyncio", "anyio"])
def test_async_cancelled_anywhere_then_hundreds_run(
    engine: sa.Engine, database_url: str, orders: None, seed: int, canceller: str
) -> None:
    cancel_after = _asyncio_cancel_after if canceller == "asyncio" else _anyio_cancel_after

    async def run() -> int:
        rng = random.Random(seed)
        pooled = create_async_engine(database_url, pool_size=3, max_overflow=0, pool_timeout=10)
        cancelled = 0
        try:
            async with outbox.AsyncOutbox(pooled, config=QUIET) as aob:
                for i in range(ROUNDS):
                    key, mode = f"a{seed}-{i}", rng.choice(["owned", "joined"])
                    if await cancel_after(
                        rng.randrange(0, 40), functools.partial(_async_body, aob, key, mode)
                    ):
                        cancelled += 1
                for i in range(AFTER):
                    await _async_body(aob, f"after-{i}", "owned" if i % 2 else "joined")
        finally:
            await pooled.dispose()
        return cancelled

    cancelled = anyio.run(run) if canceller == "anyio" else asyncio.run(run())
    assert cancelled > ROUNDS // 4
    _clean(engine)


@pytest.mark.parametrize("mode", ["owned", "joined"])
@pytest.mark.parametrize("canceller", ["asyncio", "anyio"])
def test_async_cancel_while_waiting_on_an_order_lock_frees_the_key(
    engine: sa.Engine, database_url: str, orders: None, canceller: str, mode: str
) -> None:
    async def victim(aob: outbox.AsyncOutbox) -> None:
        if mode == "owned":
            async with aob.unit_of_work("victim") as uow:
                uow.publish("chaos.events", "second", key="hot")
            return
        async with aob.engine.connect() as conn:
            async with aob.unit_of_work("victim", connection=conn) as uow:
                uow.publish("chaos.events", "second", key="hot")
            await conn.commit()

    async def run() -> None:
        async with (
            outbox.AsyncOutbox(database_url, config=QUIET) as aob,
            aob.engine.connect() as holder,
        ):
            async with aob.unit_of_work("holder", connection=holder) as uow:
                uow.publish("chaos.events", "first", key="hot")

            async def watch() -> None:  # until pg_locks shows the victim waiting
                while _count(engine, WAITING) != 1:
                    await anyio.sleep(0.02)

            if canceller == "asyncio":
                task = asyncio.get_running_loop().create_task(victim(aob))
                await watch()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                async with anyio.create_task_group() as group:
                    group.start_soon(victim, aob)
                    with anyio.fail_after(30):
                        await watch()
                    group.cancel_scope.cancel()
            # The holder is still open: only a cancelled backend lets go of the key.
            for _ in range(500):
                if not _key_held(engine, "victim"):
                    break
                await anyio.sleep(0.02)
            assert not _key_held(engine, "victim"), "the victim's backend kept its key"
            async with aob.unit_of_work("victim") as uow:
                assert not uow.replayed
            await holder.commit()

    if canceller == "anyio":
        anyio.run(run)
    else:
        asyncio.run(run())
    _clean(engine)
