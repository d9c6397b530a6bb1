"""A rolling restart of a relay fleet for real: two ``outbox-relay`` processes serving six
discovered databases are stopped and started again one after the other (SIGTERM, as an
orchestrator's rollout does) while writes go on. Each database moves at most twice (to the
other member and back), every event reaches Kafka in commit order per key, each member holds
one session per database it serves (and one membership session), and each member's
``/metrics`` shows its databases with a ``database`` label."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox._core.fleet import member_key, owner_of
from outbox._pg.wakeup import channel
from outbox.relay._fleet import database_identity
from tests.faults.test_relay_fleet import Databases, databases, start_member
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.processes import local_tcp_ports, log_tail, stop_process
from tests.fixtures.relay import (
    assert_delivered,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
)

pytestmark = pytest.mark.slow

__all__ = ["databases"]  # the fixture, imported for this module's tests

MEMBERS = ("a", "b")
SERVED = re.compile(r"event=database_served member='(\w)'.* database=\S+/(\S+)")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_a_rolling_restart_moves_each_database_at_most_twice(
    databases: Databases, pg_admin_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    # Names that rendezvous hashing splits between the two members (a random prefix can give
    # all six to one of them), so that the rollout moves databases both ways.
    def identity(name: str) -> str:
        url = sa.make_url(pg_admin_url).set(database=name)
        return database_identity(url.render_as_string(hide_password=False))

    keys = sorted(member_key(m) for m in MEMBERS)
    while True:
        databases.prefix = f"fleet_{uuid.uuid4().hex[:8]}"
        owners = [owner_of(identity(f"{databases.prefix}_{i}"), keys) for i in range(6)]
        if min(owners.count(k) for k in keys) >= 2:
            break
    for _ in range(6):
        databases.create()
    listing = tmp_path / "databases.txt"
    listing.write_text("")
    topic = f"fleet-roll-{uuid.uuid4().hex[:8]}"
    logs = {m: tmp_path / f"{m}.log" for m in MEMBERS}
    ports = {m: free_port() for m in MEMBERS}

    def start(member: str) -> subprocess.Popen[bytes]:
        return start_member(
            member,
            pg_admin_url,
            databases.pattern,
            listing,
            kafka_bootstrap,
            logs[member],
            extra=["--metrics-port", str(ports[member])],
        )

    procs = {m: start(m) for m in MEMBERS}
    committed: dict[bytes, list[str]] = {}
    all_ids: list[uuid.UUID] = []
    stop_writing = threading.Event()

    def writer() -> None:
        wave = 0
        while not stop_writing.is_set():
            for name in databases.names:
                items = [(f"{name}:k{k}", f"{name}:{wave}:{k}".encode()) for k in range(3)]
                ids = insert_rows(databases.engines[name], topic, items)
                with databases.engines[name].begin() as conn:
                    conn.execute(sa.text("SELECT pg_notify(:c, '')"), {"c": channel(None)})
                all_ids.extend(ids)
                for (key, _), event_id in zip(items, ids, strict=True):
                    committed.setdefault(key.encode(), []).append(str(event_id))
            wave += 1
            time.sleep(0.05)

    def port_owner(port: int) -> str | None:
        for member, proc in procs.items():
            if proc.poll() is None and port in local_tcp_ports(proc.pid):
                return member
        return None

    def assignment() -> dict[str, str | None]:
        return {name: port_owner(port) for name, port in databases.owners().items()}

    def text_of_logs() -> str:
        return "\n".join(f"{m}:\n{log_tail(logs[m], 40)}" for m in MEMBERS)

    def settled() -> bool:
        current = assignment()
        return len(current) == 6 and set(current.values()) == set(MEMBERS)

    thread = threading.Thread(target=writer, daemon=True)
    try:
        thread.start()
        wait_for(settled, 60, f"the databases never settled\n{text_of_logs()}", interval=0.2)
        before = assignment()

        # One session per database served, and the membership session: no wake-up listener
        # connections of their own.
        with databases._admin.connect() as conn:
            sessions = conn.execute(
                sa.text(
                    "SELECT client_port FROM pg_stat_activity "
                    "WHERE application_name = 'outbox-relay' AND datname LIKE :p"
                ),
                {"p": databases.pattern},
            ).scalars()
            per_member = Counter(port_owner(int(p)) for p in sessions)
        served_by = Counter(before.values())
        assert per_member == served_by, (per_member, served_by)

        # Each member's page shows the databases it serves, by name.
        for member in MEMBERS:
            page = scrape(ports[member])
            for name, owner in before.items():
                served = 1.0 if owner == member else 0.0
                label = f'database="{identity(name)}"'
                assert (
                    f'outbox_fleet_database_served{{{label},member="{member}"}} {served}' in page
                ), page
                if owner == member:
                    assert f"outbox_relay_database_up{{{label}}} 1.0" in page, page

        # The rollout: each member in turn stopped and started again with the same id.
        for member in MEMBERS:
            stop_process(procs[member], signal.SIGTERM, 30)
            assert procs[member].returncode == 0, text_of_logs()
            other = "b" if member == "a" else "a"
            wait_for(
                lambda other=other: list(Counter(assignment().values()).items()) == [(other, 6)],
                30,
                f"{member}'s databases not taken over\n{text_of_logs()}",
                interval=0.2,
            )
            procs[member] = start(member)
            wait_for(
                lambda: assignment() == before,
                60,
                f"{member} never got its databases back\n{text_of_logs()}",
                interval=0.2,
            )
        time.sleep(0.5)
        stop_writing.set()
        thread.join(30)
        wait_for(
            lambda: all(outbox_count(e) == 0 for e in databases.engines.values()),
            30,
            f"the fleet did not drain\n{text_of_logs()}",
            interval=0.2,
        )
        rollout_logs = {m: logs[m].read_text() for m in MEMBERS}
    finally:
        stop_writing.set()
        for proc in procs.values():
            stop_process(proc, signal.SIGTERM, 15)

    # Moves, from the members' own logs up to the end of the rollout (stopping the fleet
    # afterwards moves databases too): a database served n times moved n - 1 times.
    served_times: Counter[str] = Counter()
    for text in rollout_logs.values():
        for line in text.splitlines():
            if match := SERVED.search(line):
                served_times[match.group(2)] += 1
    assert set(served_times) == set(databases.names), served_times
    moves = {name: served_times[name] - 1 for name in databases.names}
    # Each database moved out of its member and back, and no more.
    assert all(1 <= n <= 2 for n in moves.values()), moves
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, all_ids)
    check_key_order(records, committed)
