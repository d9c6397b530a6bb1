"""A rolling update as Kubernetes runs one (deploy/kubernetes): the new process starts, then the
old one gets SIGTERM with work in hand and must exit by itself within the manifest's
terminationGracePeriodSeconds (after which the kubelet would SIGKILL it). Nothing may be lost,
and duplicates stay within what README.md allows: for the relay at most one batch, for the
consumer none in effects (a redelivered message replays its stored outcome)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from tests.fixtures.common import REPORTS, free_port, wait_for
from tests.fixtures.consumer import produce
from tests.fixtures.kafka import create_topic
from tests.fixtures.processes import die_with_parent, log_tail, stop_process
from tests.fixtures.relay import (
    assert_delivered,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
    start_relay,
    stop_mid_batch,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OUTBOX_BIN = str(Path(sys.executable).with_name("outbox"))
LOCK = 280_028  # the advisory lock the consumers' handler waits for while the test holds it


def grace_period(deployment: str) -> float:
    """terminationGracePeriodSeconds of a Deployment of deploy/kubernetes."""
    path = REPO / "deploy" / "kubernetes" / f"{deployment}.yaml"
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == "Deployment":
            return float(doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
    raise AssertionError(f"{path} holds no Deployment")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""


def counter(port: int, name: str) -> float:
    """The sum of a counter's samples on a ``/metrics`` page."""
    total = 0.0
    for line in get(port, "/metrics")[1].splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sigterm_and_wait(proc: subprocess.Popen[bytes], grace: float, log: Path) -> int:
    """What the kubelet does: SIGTERM, then SIGKILL when the grace period runs out. Returns the
    exit status; a process that needed the SIGKILL fails the test. (A stopped process gets
    SIGCONT after the SIGTERM: it goes on with the signal waiting.)"""
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"still running {grace:g}s after SIGTERM (the grace period):\n{log_tail(log)}"
        ) from None


def test_relay_rolling_update_loses_nothing(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"rolling-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=4)
    batch = 100
    args = ("--batch-size", str(batch), "--rebalance-interval", "0.5")
    old_port, new_port = free_port(), free_port()
    old_log, new_log = tmp_path / "old.log", tmp_path / "new.log"
    ids: list[uuid.UUID] = []
    committed: dict[bytes, list[str]] = {}
    stop_writing = threading.Event()
    writes = threading.Semaphore(0)

    def write(n: int) -> None:
        items = [(f"key-{i % 50:02d}", f"{len(ids) + i}".encode()) for i in range(n)]
        new = insert_rows(engine, topic, items)
        for (key, _value), event_id in zip(items, new, strict=True):
            committed.setdefault(key.encode(), []).append(str(event_id))
        ids.extend(new)

    def writer() -> None:
        # Keeps committing while the update runs: the old relay is stopped mid-stream.
        while not stop_writing.is_set():
            write(500)
            writes.release()
        write(500)  # committed after the old relay left: only the new one can deliver it

    old = start_relay(database_url, kafka_bootstrap, *args, "--metrics-port", str(old_port),
                      log_path=old_log)  # fmt: skip
    new: subprocess.Popen[bytes] | None = None
    thread = threading.Thread(target=writer, daemon=True)
    try:
        wait_for(lambda: get(old_port, "/readyz")[0] == 200, 60, "old relay never ready")
        write(5000)  # a backlog the old relay is draining when the update begins
        thread.start()
        wait_for(lambda: counter(old_port, "outbox_relay_published_total") > 0, 60,
                 "the old relay delivered nothing")  # fmt: skip
        # maxSurge: the new relay starts and becomes ready (waiting for lanes or owning some).
        new = start_relay(database_url, kafka_bootstrap, *args, "--metrics-port", str(new_port),
                          log_path=new_log)  # fmt: skip
        wait_for(lambda: get(new_port, "/readyz")[0] == 200, 60, "new relay never ready")
        assert writes.acquire(timeout=60)  # the writer is still at it
        # SIGTERM lands while the old relay holds a claimed batch.
        held = stop_mid_batch(engine, old, tries=500)
        assert held > 0, "the old relay was never caught mid-batch"
        assert sigterm_and_wait(old, grace_period("relay"), old_log) == 0
        stop_writing.set()
        thread.join(60)
        assert not thread.is_alive()
        wait_for(lambda: outbox_count(engine) == 0, 120, "the new relay did not drain the outbox")
    except BaseException:
        print(log_tail(old_log), log_tail(new_log), sep="\n--- new relay ---\n")
        raise
    finally:
        stop_writing.set()
        stop_process(old, signal.SIGKILL)
        if new is not None:
            stop_process(new, signal.SIGTERM, 30)
    stopped = [ln for ln in old_log.read_text().splitlines() if "event=relay_stopped" in ln]
    assert stopped, "the old relay did not stop through its shutdown"
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, ids)
    check_key_order(records, committed)
    duplicates = len(records) - len(ids)
    REPORTS.setdefault("rolling updates", []).append(
        f"relay: {len(ids)} events, {duplicates} sent twice (allowed: {batch}, one batch)"
    )
    assert duplicates <= batch, f"{duplicates} duplicates: more than the batch in hand ({batch})"


INSERT_EFFECT = sa.text(
    "INSERT INTO effects (key, pid) SELECT :key, :pid "
    "FROM (SELECT pg_advisory_xact_lock_shared(:lock)) AS waited"
)


def handle(uow: Any, message: Any) -> None:
    """The consumers' handler (loaded by `outbox consume`): waits while the test holds LOCK;
    the effect names the consumer process that applied it."""
    uow.connection.execute(INSERT_EFFECT, {"key": uow.key, "pid": os.getpid(), "lock": LOCK})


def _consumer(database_url: str, bootstrap: str, topic: str, group: str, port: int,
              log: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            [OUTBOX_BIN, "consume", "tests.faults.test_rolling_update:handle", "--topic", topic,
             "--group", group, "--database-url", database_url, "--bootstrap-servers", bootstrap,
             "--kafka-config", "session.timeout.ms=2000",
             "--kafka-config", "heartbeat.interval.ms=200", "--metrics-port", str(port)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
        )  # fmt: skip


def _messages(keys: range) -> list[dict[str, Any]]:
    return [
        {"value": json.dumps({"n": n}).encode(), "key": f"k{n % 20}".encode(),
         "headers": [("X-Idempotency-Key", f"msg-{n}".encode())]}
        for n in keys
    ]  # fmt: skip


def test_consumer_rolling_update_applies_every_message_once(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"rolling-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=4)
    group = f"g-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE effects (key text NOT NULL, pid int NOT NULL)"))
    old_port, new_port = free_port(), free_port()
    old_log, new_log = tmp_path / "old.log", tmp_path / "new.log"
    holder = engine.connect()
    holder.execute(sa.text("SELECT pg_advisory_lock(:lock)"), {"lock": LOCK})
    holder.commit()
    held = True

    def waiting_handlers(application: str) -> int:
        """Handlers of the consumer whose sessions are named ``application`` that wait for
        the test's lock: messages that consumer has in hand."""
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                "WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objid = :lock "
                "AND a.application_name = :application"),
                {"lock": LOCK, "application": application}).scalar_one())  # fmt: skip

    def named(application: str) -> str:
        return f"{database_url}{'&' if '?' in database_url else '?'}application_name={application}"

    old = _consumer(named("old"), kafka_bootstrap, topic, group, old_port, old_log)
    new: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: "assigned" in old_log.read_text(), 60, "old consumer never assigned")
        # maxSurge: the new consumer starts and joins the group before the old one stops.
        new = _consumer(named("new"), kafka_bootstrap, topic, group, new_port, new_log)
        wait_for(lambda: "assigned" in new_log.read_text(), 60, "new consumer never assigned")
        wait_for(lambda: get(new_port, "/readyz")[0] == 200, 60, "new consumer never ready")
        produce(kafka_bootstrap, topic, _messages(range(0, 400)))
        # The old consumer has a micro-batch in hand: its handler waits for the test's lock.
        wait_for(lambda: waiting_handlers("old") > 0, 60, "the old consumer took no message")
        old.send_signal(signal.SIGTERM)  # mid-message ...
        holder.execute(sa.text("SELECT pg_advisory_unlock(:lock)"), {"lock": LOCK})
        holder.commit()
        held = False  # ... which may now finish
        try:
            status = old.wait(timeout=grace_period("consumer"))
        except subprocess.TimeoutExpired:
            raise AssertionError("the old consumer outlived its grace period") from None
        assert status == 0
        produce(kafka_bootstrap, topic, _messages(range(400, 800)))  # only the new one is left

        def applied() -> int:
            with engine.connect() as conn:
                return int(conn.execute(sa.text("SELECT count(DISTINCT key) FROM effects"))
                           .scalar_one())  # fmt: skip

        wait_for(lambda: applied() == 800, 120, "not every message was applied")
    except BaseException:
        print(log_tail(old_log), log_tail(new_log), sep="\n--- new consumer ---\n")
        raise
    finally:
        if held:
            holder.execute(sa.text("SELECT pg_advisory_unlock(:lock)"), {"lock": LOCK})
        holder.close()
        stop_process(old, signal.SIGKILL)
        if new is not None:
            stop_process(new, signal.SIGTERM, 30)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT key, count(*) FROM effects GROUP BY key"))
        counts = {key: n for key, n in rows}
        by_process = dict(
            conn.execute(sa.text("SELECT pid, count(*) FROM effects GROUP BY pid")).all()
        )
    assert set(counts) == {f"msg-{n}" for n in range(800)}
    doubled = {k: n for k, n in counts.items() if n > 1}
    assert not doubled, f"effects applied twice: {sorted(doubled)[:5]}"
    REPORTS.setdefault("rolling updates", []).append(
        f"consumer: 800 messages, applied by the old consumer {by_process.get(old.pid, 0)}, "
        f"by the new one {by_process.get(new.pid if new else 0, 0)}, none twice"
    )
    # The old consumer finished what it had in hand; the new one did the rest.
    assert new is not None and set(by_process) == {old.pid, new.pid}, by_process
    assert "consumer of group" in old_log.read_text()  # it stopped through its shutdown
