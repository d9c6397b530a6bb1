"""Benchmark: a relay fleet, many databases on one PostgreSQL served by two relay processes.

    python benchmarks/fleet.py [--server-url URL] [--bootstrap-servers HOST:PORT]
                               [--databases 100] [--idle-seconds 120] [--rates 250,1000]
                               [--load-seconds 15] [--writers 4]

Measured in one run:

* **connections**: the sessions the two relay processes hold in all (serving sessions, wake-up
  listeners, membership);
* **idle CPU** over ``--idle-seconds``: the two relay processes and the PostgreSQL backends
  of their sessions, from ``/proc/<pid>/stat``, as a percentage of one core, and the Kafka
  producers alive in each relay process at its end;
* **commit -> Kafka latency** (p50/p99) while ``--writers`` processes commit each of
  ``--rates`` events/s in all (a phase each), each to a random database, with the after-commit
  wake-up a unit of work sends (a consumer timestamps arrival), after a first event in every
  database (reported apart); and the CPU each phase cost per 1,000 events: relays,
  their backends, writers, every other PostgreSQL process (the writers' backends, and anything
  else the server runs meanwhile), the broker, the consumer, the machine;
* **takeover**: after a SIGKILL of the process serving more databases, the seconds until every
  database is served again (by the survivor).

The databases are copies of a template migrated once (``outbox_testing_db_...``), dropped at
the end. Without ``--bootstrap-servers`` a Tansu broker is started on a free port. Figures
from a machine whose cores others share are indicative only.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer
from cpu import TICK, Meter, _process_ticks, processes_named
from relay import BROKER_PIDS, start_tansu

from outbox._core import codec as _codec
from outbox._core.fleet import member_key, member_namespace, owner_namespace
from outbox._pg.wakeup import make_notifier
from outbox.schema import tables
from outbox.testing.databases import TemplateDatabases

REPO = Path(__file__).resolve().parents[1]
MEMBERS = ("a", "b")
MEMBER_KEYS = [member_key(m) for m in MEMBERS]


def relay_processes(
    bootstrap: str, server: str, pattern: str, logs: Path
) -> list[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    procs = []
    for member in MEMBERS:
        argv = [
            sys.executable, "-m", "outbox.cli.relay",
            "--discover-url", server, "--discover-pattern", pattern,
            "--member-id", member, "--bootstrap-servers", bootstrap,
            "--poll-interval", "30", "--log-level", "WARNING",
        ]  # fmt: skip
        with (logs / f"{member}.log").open("ab") as out:
            procs.append(
                subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            )
    return procs


def served(admin: sa.Engine, pattern: str) -> int:
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                    "WHERE l.locktype = 'advisory' AND l.classid = :ns AND l.objid = 0 "
                    "AND l.objsubid = 2 AND l.granted AND d.datname LIKE :p"
                ),
                {"ns": owner_namespace(None), "p": pattern},
            ).scalar_one()
        )


def relay_backends(admin: sa.Engine, pattern: str) -> list[int]:
    """The backends of the two relay processes: their sessions to the benchmark's databases,
    and their membership sessions (other relays may be running on the same server)."""
    with admin.connect() as conn:
        return [
            int(p)
            for p in conn.execute(
                sa.text(
                    "SELECT a.pid FROM pg_stat_activity a WHERE a.application_name = "
                    "'outbox-relay' AND (a.datname LIKE :p OR a.pid IN (SELECT l.pid FROM "
                    "pg_locks l WHERE l.locktype = 'advisory' AND l.classid = :ns "
                    "AND l.objid = ANY(:keys) AND l.objsubid = 2))"
                ),
                {"p": pattern, "ns": member_namespace(None), "keys": MEMBER_KEYS},
            ).scalars()
        ]


class Arrivals:
    """A consumer of ``topic`` on a thread of its own, timestamping each event's arrival."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.arrived: dict[str, float] = {}
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                "auto.offset.reset": "earliest",
                "session.timeout.ms": 6000,
                "topic.metadata.refresh.interval.ms": 500,
                "fetch.wait.max.ms": 1,
                "fetch.min.bytes": 1,
            }
        )
        self._consumer.subscribe([topic])
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            now = time.time()
            for k, v in msg.headers() or []:
                if k == _codec.IDEMPOTENCY_HEADER:
                    self.arrived.setdefault(bytes(v).decode(), now)

    def wait_for(self, events: dict[str, float], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not events.keys() <= self.arrived.keys():
            time.sleep(0.1)

    def latencies(self, events: dict[str, float]) -> list[float]:
        """Milliseconds from commit to arrival of the ``events`` that arrived, sorted."""
        return sorted((self.arrived[e] - c) * 1000 for e, c in events.items() if e in self.arrived)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


def producers_alive(pid: int) -> int:
    """librdkafka clients in process ``pid``: each runs one thread named ``rdk:main``."""
    tasks = Path(f"/proc/{pid}/task")
    count = 0
    for task in tasks.iterdir() if tasks.exists() else []:
        with contextlib.suppress(OSError):
            count += (task / "comm").read_text().strip() == "rdk:main"
    return count


def wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out: {what}")


WRITER_THREADS = 4

# One event's row, as the relay reads it; the statement goes to the driver directly, so that
# the load generator costs the machine as little as it can (what the relays need is rows
# committed at a known time, not a unit of work's own cost: benchmarks/uow.py measures that).
INSERT = (
    "INSERT INTO outbox (event_id, topic, key, value, headers, key_hash) "
    "VALUES (%s, %s, %s, %s, %s, %s)"
)


def write_share(
    urls: list[str],
    topic: str,
    per_second: float,
    seconds: float,
    worker: int,
    go: Any,
    results: Any,
) -> None:
    """One writer process: commit ``per_second`` events for ``seconds`` to random databases of
    ``urls`` (each commit followed by its wake-up, as a unit of work does); put the commit
    times, by event id, on ``results``."""
    import psycopg
    from psycopg.types.json import Jsonb

    engines = [sa.create_engine(u, poolclass=sa.pool.NullPool) for u in urls]
    notifiers = [make_notifier(e, None, None) for e in engines]
    # Each thread its own autocommit connection to each database (one round trip a commit),
    # connected before the clock starts.
    dsns = [sa.make_url(u).set(drivername="postgresql").render_as_string(False) for u in urls]
    sessions = [
        [psycopg.connect(dsn, autocommit=True) for dsn in dsns] for _ in range(WRITER_THREADS)
    ]
    headers = Jsonb(_codec.encode_headers({}))
    committed: dict[str, float] = {}
    go.wait()
    start = time.monotonic()

    def write(thread: int) -> None:
        rng = random.Random(worker * 100 + thread)
        interval = WRITER_THREADS / per_second
        mine = sessions[thread]
        n = 0
        while (now := time.monotonic()) - start < seconds:
            due = start + thread * interval / WRITER_THREADS + n * interval
            if due > now:
                time.sleep(due - now)
            n += 1
            i = rng.randrange(len(urls))
            event_id = uuid.uuid4()
            key = f"k{rng.randrange(1000)}".encode()
            mine[i].execute(
                INSERT,
                (event_id, topic, key, b"x" * 100, headers, _codec.key_hash(key, event_id.bytes)),
                prepare=True,
            )
            committed[str(event_id)] = time.time()
            notifiers[i]()

    threads = [threading.Thread(target=write, args=(t,)) for t in range(WRITER_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(committed)
    for conns in sessions:
        for c in conns:
            c.close()
    for engine in engines:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--bootstrap-servers")
    parser.add_argument("--databases", type=int, default=100)
    # Four polls of 30 s: every relay's whole idle cycle (claims, statistics, a rebalance).
    parser.add_argument("--idle-seconds", type=float, default=120.0)
    parser.add_argument(
        "--rates",
        type=lambda text: [int(r) for r in text.split(",") if r],
        default=[250, 1000],
        help="events/s of each load phase, comma-separated",
    )
    parser.add_argument("--load-seconds", type=float, default=15.0)
    parser.add_argument("--writers", type=int, default=4, help="writer processes")
    args = parser.parse_args()

    broker = None
    bootstrap = args.bootstrap_servers
    if not bootstrap:
        broker, bootstrap = start_tansu()
    templates = TemplateDatabases(args.server_url)
    admin = sa.create_engine(args.server_url, poolclass=sa.pool.NullPool)
    urls: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    engines: list[sa.Engine] = []
    writers: list[Any] = []
    try:
        started = time.monotonic()
        for _ in range(args.databases):
            urls.append(templates.create())
        first = str(sa.make_url(urls[0]).database)
        pattern = first.rsplit("_", 1)[0].replace("_", r"\_") + r"\_%"
        print(f"{args.databases} databases created in {time.monotonic() - started:.1f}s")

        procs = relay_processes(bootstrap, args.server_url, pattern, logs)
        started = time.monotonic()
        wait(lambda: served(admin, pattern) == args.databases, 120, "every database served")
        print(f"every database served {time.monotonic() - started:.1f}s after start")
        time.sleep(3.0)
        backends = relay_backends(admin, pattern)
        print(f"relay sessions in all: {len(backends)} for {args.databases} databases, 2 processes")

        # Idle.
        relay_pids = [p.pid for p in procs]
        before = {p: _process_ticks(p) for p in relay_pids + backends}
        time.sleep(args.idle_seconds)
        after = {p: _process_ticks(p) for p in relay_pids + backends}
        spent = {p: after[p] - before[p] for p in before if after[p]}
        relays_pct = sum(spent.get(p, 0) for p in relay_pids) / TICK / args.idle_seconds * 100
        backends_pct = sum(spent.get(p, 0) for p in backends) / TICK / args.idle_seconds * 100
        print(
            f"idle CPU over {args.idle_seconds:g}s: relays {relays_pct:.2f}% of a core, their "
            f"backends {backends_pct:.2f}%, total {relays_pct + backends_pct:.2f}%"
        )
        print(
            "Kafka producers alive in the relay processes while idle: "
            + ", ".join(str(producers_alive(p)) for p in relay_pids)
        )

        # Latency under load, a topic for each phase (a consumer of the broker used here
        # falls behind as one topic grows, which would be read as the relays' latency): a
        # consumer timestamps every event's arrival; before the clock, a first event in every
        # database creates the topic, and the producers look it up once (a first record to
        # a topic a producer has not seen waits for that lookup: the first phase reports it).
        engines = [sa.create_engine(u, poolclass=sa.pool.NullPool) for u in urls]
        notifiers = [make_notifier(engine, None, None) for engine in engines]
        for phase, rate in enumerate(args.rates):
            topic = f"fleet-bench-{uuid.uuid4().hex[:8]}"
            reader = Arrivals(bootstrap, topic)
            first: dict[str, float] = {}
            for engine, notify in zip(engines, notifiers, strict=True):
                event_id = uuid.uuid4()
                with engine.begin() as conn:
                    conn.execute(
                        sa.insert(tables(None).outbox),
                        {
                            "event_id": event_id,
                            "topic": topic,
                            "key": b"w",
                            "value": b"w",
                            "headers": _codec.encode_headers({}),
                            "key_hash": _codec.key_hash(b"w", event_id.bytes),
                        },
                    )
                first[str(event_id)] = time.time()
                notify()
            reader.wait_for(first, 60)
            if phase == 0:
                firsts = reader.latencies(first)
                print(
                    f"first event of each database (the topic new to the broker and the "
                    f"producers): p50 {statistics.median(firsts):.1f} ms, max "
                    f"{firsts[-1]:.1f} ms ({len(first) - len(firsts)} not seen)"
                )
            time.sleep(2.0)
            # Writer processes, each committing to its own share of the databases (a random
            # one of its share each time, so the union is random over all of them): one Python
            # process cannot commit 1,000 events a second over a hundred databases and send
            # their wake-ups too. They connect first, then wait for the start.
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            go = ctx.Event()
            per_writer, seconds = rate / args.writers, args.load_seconds
            writers = [
                ctx.Process(
                    target=write_share,
                    args=(urls[w :: args.writers], topic, per_writer, seconds, w, go, results),
                )
                for w in range(args.writers)
            ]
            for writer in writers:
                writer.start()
            # Where the phase's CPU goes, per event: the relays, their backends, the writers
            # (with their backends: every other PostgreSQL process), the broker, this process.
            meter = Meter(
                {
                    "relays": lambda: relay_pids,
                    "relay backends": lambda: backends,
                    "writers": lambda procs=writers: [w.pid for w in procs if w.pid],
                    "other postgres": lambda: sorted(
                        set(processes_named("postgres")) - set(backends)
                    ),
                    "broker": lambda: list(BROKER_PIDS),
                    "consumer": lambda: [os.getpid()],
                }
            )
            time.sleep(5.0)  # the writers' connections are up (they wait for `go`)
            committed: dict[str, float] = {}
            go.set()
            meter.start()
            for _ in writers:
                committed.update(results.get(timeout=args.load_seconds + 120))
            usage = meter.stop()
            for writer in writers:
                writer.join(10)
            times = sorted(committed.values())
            elapsed = max(times[-1] - times[0], 1e-9)
            reader.wait_for(committed, 20)
            lat = reader.latencies(committed)
            reader.close()
            missing = len(committed) - len(lat)
            pending = 0
            if missing:  # still in an outbox (not sent), or sent and not seen by the consumer?
                for engine in engines:
                    with engine.connect() as conn:
                        pending += conn.execute(
                            sa.text("SELECT count(*) FROM outbox WHERE topic = :t"), {"t": topic}
                        ).scalar_one()
            p50 = statistics.median(lat)
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            print(
                f"commit->Kafka, {rate} events/s asked, {len(committed) / elapsed:.0f} "
                f"committed, over {args.databases} random databases: p50 {p50:.1f} ms, "
                f"p99 {p99:.1f} ms, max {lat[-1]:.1f} ms ({len(lat)} events, {missing} not seen"
                + (f", {pending} of them still in an outbox)" if missing else ")")
            )
            print(f"  CPU ms per 1,000 events while writing: {usage.per(len(committed))}")

        # Takeover after SIGKILL.
        victim = procs[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed = time.monotonic()
        wait(lambda: served(admin, pattern) < args.databases, 10, "the kill freed no lock")
        freed = args.databases - served(admin, pattern)
        wait(lambda: served(admin, pattern) == args.databases, 60, "takeover")
        print(
            f"takeover after SIGKILL of one process: every database served again "
            f"{time.monotonic() - killed:.2f}s after the kill (>= {freed} databases moved)"
        )
    finally:
        for writer in writers:
            if writer.is_alive():
                writer.terminate()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            if proc.poll() is None:
                proc.kill()
        for engine in engines:
            engine.dispose()
        for url in urls:
            with contextlib.suppress(Exception):
                templates.drop(url)
        templates.close()
        admin.dispose()
        if broker is not None:
            broker.kill()
        print(f"relay logs: {logs}")


if __name__ == "__main__":
    main()
