"""Online migrations: ``outbox migrate`` from every earlier revision to head while units of
work write, a relay delivers and a long read-only transaction holds the outbox. Each revision's
lock wait is bounded by the lock timeout, so no writer stalls much longer than that; a lock
still held after the last attempt fails naming the session that holds it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.config import Config
from alembic.script import ScriptDirectory

from outbox import Outbox, migrate
from outbox.relay import RelayConfig
from tests.fixtures.relay import RelayThread, outbox_count

ROOT = Path(__file__).resolve().parents[2]
LOCK_TIMEOUT = 0.5
# The reader stays open this long after the migration first waits for it: far past the
# lock timeout.
READER_HOLDS = 6 * LOCK_TIMEOUT
# A writer may wait through one lock timeout, plus the slack of a busy machine.
STALL_BOUND = 3 * LOCK_TIMEOUT


def _earlier_revisions() -> list[str]:
    cfg = Config()
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    script = ScriptDirectory.from_config(cfg)
    order = [s.revision for s in reversed(list(script.walk_revisions()))]
    return order[:-1]


def _migrate(database_url: str, **env: str) -> subprocess.Popen[str]:
    """``outbox migrate`` with its lock limits in the environment."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "migrate"],
        cwd=ROOT,
        env={**clean, "OUTBOX_DATABASE_URL": database_url, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lock_wait_begins(engine: sa.Engine, proc: subprocess.Popen[str]) -> bool:
    """Wait until a session waits for a lock on the outbox (the migration, or writers queued
    behind it): True; or until the migration ended without waiting: False."""
    deadline = time.monotonic() + 60
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks"
                    " WHERE NOT granted AND relation = 'outbox'::regclass"
                )
            ).scalar_one()
            conn.rollback()
            if waiting:
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.01)
    raise AssertionError("the migration neither waited for a lock nor ended within 60 s")


class Writers:
    """Units of work in a loop on two threads, each one's duration recorded."""

    def __init__(self, database_url: str) -> None:
        self.outbox = Outbox(database_url)
        self.stop = threading.Event()
        self.durations: list[float] = []
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(n,)) for n in range(2)]

    def _run(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            started = time.monotonic()
            try:
                with self.outbox.unit_of_work(f"w{n}-{i}") as uow:
                    uow.publish("migrations.online", {"i": i}, key=f"k{n}")
            except BaseException as exc:
                self.errors.append(exc)
                return
            self.durations.append(time.monotonic() - started)

    def __enter__(self) -> Writers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)
        self.outbox.close()


@contextmanager
def long_reader(engine: sa.Engine) -> Iterator[int]:
    """A REPEATABLE READ, read-only transaction that has read the outbox (a report, a
    ``pg_dump``): it holds ACCESS SHARE on the table until it ends."""
    conn = engine.connect()
    conn.execute(sa.text("SET application_name = 'nightly report'"))
    conn.commit()
    conn.execute(sa.text("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"))
    conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one()
    pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    try:
        yield int(pid)
    finally:
        conn.rollback()
        conn.close()


@pytest.mark.parametrize("start", _earlier_revisions())
def test_migrating_to_head_under_a_long_reader_stalls_writers_at_most_about_the_lock_timeout(
    start: str,
    database_url: str,
    engine: sa.Engine,
    kafka_bootstrap: str,
) -> None:
    migrate.downgrade(engine, start)
    relay = RelayThread(RelayConfig(database_url, kafka_bootstrap, poll_interval=0.2)).start()
    try:
        with Writers(database_url) as writers:
            while len(writers.durations) < 20 and not writers.errors:
                time.sleep(0.01)
            with long_reader(engine):
                before = len(writers.durations)
                proc = _migrate(database_url, OUTBOX_MIGRATE_LOCK_TIMEOUT=str(LOCK_TIMEOUT))
                if _lock_wait_begins(engine, proc):
                    time.sleep(READER_HOLDS)  # the reader's own length, not a wait for a state
            _out, err = proc.communicate(timeout=60)
            during = len(writers.durations) - before
        assert not writers.errors, writers.errors[0]
        longest = max(writers.durations)
        assert longest <= STALL_BOUND, (
            f"a unit of work stalled {longest:.2f} s behind the migration (bound {STALL_BOUND} s)"
        )
        assert during > 20, f"only {during} units of work committed while the migration ran"
        assert proc.returncode == 0, err
        with engine.connect() as c:
            assert migrate.current_revision(c) == migrate.head_revision()
        deadline = time.monotonic() + 30
        while outbox_count(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert outbox_count(engine) == 0, "the relay did not deliver every event"
    finally:
        relay.stop()


def test_a_lock_held_through_every_attempt_fails_naming_the_session_that_holds_it(
    database_url: str, engine: sa.Engine
) -> None:
    migrate.downgrade(engine, "0004")
    with long_reader(engine) as pid:
        proc = _migrate(
            database_url, OUTBOX_MIGRATE_LOCK_TIMEOUT="0.2", OUTBOX_MIGRATE_LOCK_ATTEMPTS="2"
        )
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert "revision 0005" in line
    assert f"pid {pid}" in line
    assert "'nightly report'" in line
    assert "'idle in transaction'" in line
    assert "AccessShareLock on outbox" in line
    assert f"pg_terminate_backend({pid})" in line
    with engine.connect() as c:
        # One transaction per revision: the revision before the blocked one stays applied.
        assert migrate.current_revision(c) == "0004"
