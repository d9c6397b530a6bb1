"""A relay fleet for real: two ``outbox-relay`` processes serving several databases found by
discovery and listed in a file, one of them down, a database added while they run, one process
SIGKILLed mid-stream. Every event reaches Kafka, in commit order per key, and the survivor
serves the killed process's databases within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox._core.fleet import owner_namespace
from outbox._pg.wakeup import channel
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.postgres import DatabaseFactory
from tests.fixtures.processes import die_with_parent, local_tcp_ports, log_tail, stop_process
from tests.fixtures.relay import (
    assert_delivered,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


class Databases:
    """Databases named ``<prefix>_<n>``, copies of the session's migrated template."""

    def __init__(self, factory: DatabaseFactory) -> None:
        self.factory = factory
        self.prefix = f"fleet_{uuid.uuid4().hex[:8]}"
        self.names: list[str] = []
        self.engines: dict[str, sa.Engine] = {}
        self._admin = sa.create_engine(factory.admin_url, isolation_level="AUTOCOMMIT")

    @property
    def pattern(self) -> str:
        return self.prefix + r"\_%"

    def create(self) -> str:
        name = f"{self.prefix}_{len(self.names)}"
        template = self.factory.create_template()
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        self.names.append(name)
        self.engines[name] = sa.create_engine(self.factory.url_for(name))
        return name

    def owners(self) -> dict[str, int]:
        """Database name -> client port of the session holding its serving lock."""
        with self._admin.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT d.datname, a.client_port FROM pg_locks l "
                    "JOIN pg_database d ON d.oid = l.database "
                    "JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE l.locktype = 'advisory' AND l.classid = :ns AND l.objid = 0 "
                    "AND l.objsubid = 2 AND l.granted AND d.datname LIKE :p"
                ),
                {"ns": owner_namespace(None), "p": self.pattern},
            )
            return {str(r.datname): int(r.client_port) for r in rows}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.dispose()
        for name in self.names:
            with contextlib.suppress(Exception):
                self.factory.drop(name)
        self._admin.dispose()


@pytest.fixture
def databases(_database_factory: DatabaseFactory) -> Iterator[Databases]:
    dbs = Databases(_database_factory)
    try:
        yield dbs
    finally:
        dbs.close()


def start_member(
    member: str,
    admin_url: str,
    pattern: str,
    listing: Path,
    bootstrap: str,
    log: Path,
    extra: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    argv = [
        sys.executable, "-m", "outbox.cli.relay",
        "--discover-url", admin_url, "--discover-pattern", pattern,
        "--databases-file", str(listing), "--refresh-interval", "1",
        "--member-id", member, "--bootstrap-servers", bootstrap,
        "--batch-size", "100", "--lanes", "8",
        # Wake-ups must do the work: a poll would come too late for the waits below.
        "--poll-interval", "30",
        *(extra or []),
    ]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            preexec_fn=die_with_parent(),
        )


def test_two_members_share_databases_survive_a_sigkill_and_pick_up_a_new_one(
    databases: Databases, pg_admin_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    for _ in range(6):
        databases.create()
    down_port = free_port()
    listing = tmp_path / "databases.txt"
    # A database nobody listens for: its trouble must not hold up the others.
    listing.write_text(f"# down\npostgresql+psycopg://postgres@127.0.0.1:{down_port}/nowhere\n")
    topic = f"fleet-{uuid.uuid4().hex[:8]}"
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    procs = {
        "a": start_member("a", pg_admin_url, databases.pattern, listing, kafka_bootstrap, log_a),
        "b": start_member("b", pg_admin_url, databases.pattern, listing, kafka_bootstrap, log_b),
    }
    committed: dict[bytes, list[str]] = {}
    all_ids: list[uuid.UUID] = []
    lock = threading.Lock()
    stop_writing = threading.Event()

    def write_wave(wave: int) -> None:
        with lock:
            names = list(databases.names)
        for name in names:
            items = [(f"{name}:k{k}", f"{name}:{wave}:{k}".encode()) for k in range(5)]
            ids = insert_rows(databases.engines[name], topic, items)
            # What a unit of work's commit does for a waiting relay (outbox._pg.wakeup).
            with databases.engines[name].begin() as conn:
                conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": channel(None)})
            with lock:
                all_ids.extend(ids)
                for (key, _), event_id in zip(items, ids, strict=True):
                    committed.setdefault(key.encode(), []).append(str(event_id))

    def writer() -> None:
        wave = 0
        while not stop_writing.is_set():
            write_wave(wave)
            wave += 1
            time.sleep(0.1)

    def drained() -> bool:
        return all(outbox_count(e) == 0 for e in list(databases.engines.values()))

    def port_owner(port: int) -> str | None:
        for member, proc in procs.items():
            if proc.poll() is None and port in local_tcp_ports(proc.pid):
                return member
        return None

    def logs() -> str:
        return f"a:\n{log_tail(log_a, 40)}\nb:\n{log_tail(log_b, 40)}"

    thread = threading.Thread(target=writer, daemon=True)
    try:
        thread.start()
        # Every database served, each by exactly one of the two members.
        wait_for(
            lambda: len(databases.owners()) == 6,
            60,
            f"not every database served\n{logs()}",
            interval=0.2,
        )

        # A database created while the fleet runs is found and served.
        with lock:
            added = databases.create()
        wait_for(
            lambda: added in databases.owners(), 30, f"{added} never served\n{logs()}", interval=0.2
        )

        owners = {name: port_owner(port) for name, port in databases.owners().items()}
        assert None not in owners.values(), owners
        counts = {m: sum(1 for o in owners.values() if o == m) for m in procs}
        victim = max(counts, key=lambda m: counts[m])
        survivor = "b" if victim == "a" else "a"
        assert counts[victim] > 0

        # SIGKILL one member while writes go on: the other serves every database soon after.
        procs[victim].kill()
        procs[victim].wait()
        killed_at = time.monotonic()

        def all_with_survivor() -> bool:
            current = databases.owners()
            return len(current) == len(databases.names) and all(
                port_owner(port) == survivor for port in current.values()
            )

        wait_for(all_with_survivor, 30, f"no takeover\n{logs()}", interval=0.2)
        takeover = time.monotonic() - killed_at
        print(f"takeover of {counts[victim]} databases after SIGKILL: {takeover:.2f}s")
        assert takeover < 15, f"takeover took {takeover:.1f}s"
        time.sleep(1.0)
        stop_writing.set()
        thread.join(30)
        wait_for(drained, 20, f"the survivor did not drain every database\n{logs()}", interval=0.2)
    finally:
        stop_writing.set()
        for proc in procs.values():
            if proc.poll() is None:
                stop_process(proc, signal.SIGTERM, 15)
    assert procs[survivor].returncode == 0, logs()
    # The down database is reported by name, and did not stop the others.
    survivor_log = (log_a if survivor == "a" else log_b).read_text()
    assert f"database=127.0.0.1:{down_port}/nowhere" in survivor_log, logs()
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, all_ids)
    check_key_order(records, committed)
