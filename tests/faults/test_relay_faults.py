"""The relay under real faults: SIGKILL storms, a broker cut off by a TCP proxy, and database
sessions terminated by PostgreSQL."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.admin import relay_ownership
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.kafka import Broker
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.relay import (
    assert_delivered,
    check_key_order,
    insert_rows,
    outbox_count,
    read_topic,
    relay_pids,
    start_relay,
    stop_mid_batch,
    wait_for_records,
)

pytestmark = pytest.mark.slow


def _committed(ids: list[uuid.UUID], keys: list[str]) -> dict[bytes, list[str]]:
    out: dict[bytes, list[str]] = {}
    for event_id, key in zip(ids, keys, strict=True):
        out.setdefault(key.encode(), []).append(str(event_id))
    return out


def _catches_sigterm(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the process has its SIGTERM handler installed yet (``SigCgt`` in its status)."""
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return True  # gone: nothing to wait for
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each relay and expect a clean exit. A relay restarted a moment ago may still be
    importing; the signal is sent once it is caught (else it would die of it, not stop)."""
    for proc in procs:
        if proc.poll() is None:
            wait_for(
                lambda p=proc: p.poll() is not None or _catches_sigterm(p),  # type: ignore[misc]
                30,
                "the relay never installed its SIGTERM handler",
            )
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_sigkill_storm_loses_nothing_and_keeps_key_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """3 relays, 20k events or more over 200 keys written while relays are SIGKILLed (mid-batch,
    as their sessions show) and restarted, ten times at least."""
    topic = f"relay-storm-{uuid.uuid4().hex[:8]}"
    batch = 200
    args = ("--batch-size", str(batch), "--lanes", "16", "--rebalance-interval", "0.2")
    log = tmp_path / "relays.log"
    relays = [start_relay(database_url, kafka_bootstrap, *args, log_path=log) for _ in range(3)]
    rng = random.Random(7)
    all_ids: list[uuid.UUID] = []
    all_keys: list[str] = []
    done_writing = threading.Event()
    enough_kills = threading.Event()
    kills_wanted = 10

    def writer() -> None:
        # Waves of 500 events every 0.25 s, for 10 s at least and until the storm has killed
        # enough relays (a loaded machine kills more slowly), at most 60 s.
        counter = 0
        for wave in range(240):
            if wave >= 40 and enough_kills.is_set():
                break
            keys = [f"key-{rng.randrange(200):03d}" for _ in range(500)]
            items = [(k, f"{k}:{counter + i}".encode()) for i, k in enumerate(keys)]
            counter += len(items)
            all_ids.extend(insert_rows(engine, topic, items))
            all_keys.extend(keys)
            time.sleep(0.25)
        done_writing.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    kills = 0
    in_flight = 0  # batches the killed relays held claimed (sent or not) when they died
    try:
        while not done_writing.is_set():
            time.sleep(rng.uniform(0.1, 0.4))
            index = rng.randrange(len(relays))
            victim = relays[index]
            if victim.poll() is None:
                in_flight += stop_mid_batch(engine, victim)
                victim.kill()
                victim.wait()
                kills += 1
                if kills >= kills_wanted:
                    enough_kills.set()
            relays[index] = start_relay(database_url, kafka_bootstrap, *args, log_path=log)
        thread.join(30)
        wait_for(lambda: outbox_count(engine) == 0, 90, "relays did not drain the outbox")

        def three_registered() -> bool:
            with engine.connect() as conn:
                return len(relay_ownership(conn, None)) == 3

        # Past start-up (signal handlers installed), so SIGTERM must end each with exit 0.
        wait_for(three_registered, 30, "the last relays never registered")
    finally:
        _stop_all(relays)
    print(f"{kills} kills, {in_flight} claimed batches held by the killed relays")
    assert len(all_ids) >= 20_000 and len(all_ids) % 500 == 0 and kills >= kills_wanted
    # Most kills must land on a relay with a batch in hand, or the storm proves little.
    assert in_flight >= kills // 2, f"only {in_flight} batches in flight over {kills} kills"
    assert [p.returncode for p in relays] == [0, 0, 0]  # SIGTERM: clean exit
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, all_ids)
    check_key_order(records, _committed(all_ids, all_keys))
    # At most the batches a crash held claimed are sent again: none for a kill of an idle relay.
    duplicates = len(records) - len(all_ids)
    assert duplicates <= batch * in_flight, (
        f"{duplicates} duplicates after {kills} kills holding {in_flight} claimed batches"
    )


def test_window_sigkill_storm_loses_nothing_and_keeps_key_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The window engine's storm: 3 relays, waves of events over 200 keys, a relay SIGKILLed
    and restarted every few tenths of a second. Nothing is lost, key order holds, and a kill
    re-sends at most the page it had in hand (its cursor moves with each page's results)."""
    topic = f"window-storm-{uuid.uuid4().hex[:8]}"
    batch = 200
    args = ("--engine", "window", "--batch-size", str(batch), "--lanes", "16",
            "--rebalance-interval", "0.2")  # fmt: skip
    log = tmp_path / "relays.log"
    relays = [start_relay(database_url, kafka_bootstrap, *args, log_path=log) for _ in range(3)]
    rng = random.Random(11)
    all_ids: list[uuid.UUID] = []
    all_keys: list[str] = []
    done_writing = threading.Event()

    def writer() -> None:
        counter = 0
        for _ in range(24):  # 12,000 events over 6 s at least
            keys = [f"key-{rng.randrange(200):03d}" for _ in range(500)]
            items = [(k, f"{k}:{counter + i}".encode()) for i, k in enumerate(keys)]
            counter += len(items)
            all_ids.extend(insert_rows(engine, topic, items))
            all_keys.extend(keys)
            time.sleep(0.25)
        done_writing.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    kills = 0
    try:
        while not done_writing.is_set():
            time.sleep(rng.uniform(0.1, 0.4))
            index = rng.randrange(len(relays))
            if relays[index].poll() is None:
                relays[index].kill()
                relays[index].wait()
                kills += 1
            relays[index] = start_relay(database_url, kafka_bootstrap, *args, log_path=log)
        thread.join(30)
        records = wait_for_records(kafka_bootstrap, topic, all_ids, timeout=90)
        wait_for(lambda: outbox_count(engine) == 0, 60, "the space never came back")
    finally:
        _stop_all(relays)
    assert kills >= 6
    assert [p.returncode for p in relays] == [0, 0, 0]
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, all_ids)
    check_key_order(records, _committed(all_ids, all_keys))
    duplicates = len(records) - len(all_ids)
    assert duplicates <= batch * kills, f"{duplicates} duplicates after {kills} kills"


@pytest.mark.parametrize("relay_engine", ["claim", "window"])
def test_broker_cut_longer_than_message_timeout_loses_nothing(
    engine: sa.Engine,
    database_url: str,
    tansu: Callable[..., Broker],
    tcp_proxy: Callable[..., TcpProxy],
    tmp_path: Path,
    relay_engine: str,
) -> None:
    proxy_port = free_port()
    broker = tansu(advertised_port=proxy_port)
    proxy = tcp_proxy("127.0.0.1", broker.port, listen_port=proxy_port)
    topic = f"relay-cut-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "relay.log"
    relay = start_relay(
        database_url,
        broker.bootstrap,
        "--batch-size", "100",
        "--engine", relay_engine,
        "--kafka-config", "message.timeout.ms=1500",
        "--kafka-config", "socket.timeout.ms=1000",
        # Each failed send is logged at DEBUG after the first (the outage is summarized).
        "--log-level", "DEBUG",
        log_path=log,
    )  # fmt: skip
    try:
        first = insert_rows(engine, topic, [(f"k{i % 10}", b"before") for i in range(100)])
        wait_for(lambda: outbox_count(engine) == 0, 30, "first rows never left")
        proxy.cut()
        keys = [f"k{i % 10}" for i in range(400)]
        during = insert_rows(engine, topic, [(k, b"during") for k in keys])

        def outages() -> int:
            return log.read_text().count("event=kafka_unavailable")

        # At least two message timeouts passed with the broker unreachable.
        wait_for(lambda: outages() >= 2, 30, "relay never reported the broker unreachable")
        assert outbox_count(engine) == 400  # nothing deleted without a delivery report
        assert outbox_count(engine, parked=True) == 0  # an outage parks nothing
        proxy.restore()
        wait_for(lambda: outbox_count(engine) == 0, 60, "relay did not resume after the cut")
        assert "event=kafka_recovered" in log.read_text()
    finally:
        _stop_all([relay])
    records = read_topic(broker.bootstrap, topic)
    assert_delivered(records, first + during)
    check_key_order(records, _committed(first + during, [f"k{i % 10}" for i in range(100)] + keys))


def test_terminated_database_sessions_are_reconnected(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"relay-terminate-{uuid.uuid4().hex[:8]}"
    keys = [f"k{i % 50}" for i in range(30_000)]
    ids = insert_rows(engine, topic, [(k, b"v") for k in keys])
    log = tmp_path / "relay.log"
    relay = start_relay(database_url, kafka_bootstrap, "--batch-size", "100", log_path=log)
    mid_drain = 0
    try:
        for _ in range(3):
            # Mid-drain: the relay is claiming, producing and deleting batches right now.
            before = outbox_count(engine)
            wait_for(lambda b=before: outbox_count(engine) < b, 30, "relay is not draining")
            with engine.connect() as conn:
                killed = sum(
                    int(
                        conn.execute(
                            sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}
                        ).scalar_one()
                    )
                    for pid in relay_pids(engine)
                )
            left = outbox_count(engine)
            mid_drain += int(killed > 0 and left > 0)
        wait_for(lambda: outbox_count(engine) == 0, 60, "relay did not finish after reconnects")
    finally:
        _stop_all([relay])
    assert mid_drain >= 2, "the sessions were not terminated while rows were pending"
    text = log.read_text()
    assert text.count("event=database_reconnected") >= 2
    assert relay.returncode == 0
    records = read_topic(kafka_bootstrap, topic, timeout=60)
    assert_delivered(records, ids)
    check_key_order(records, _committed(ids, keys))
