"""Run the whole example: relay, two order-service consumers (one sync, one asyncio), one
shipping consumer.

    python demo.py --database-url postgresql+psycopg://... --bootstrap-servers localhost:9092 \\
        [--redis-url redis://localhost:6379/0] [--orders 500] [--duplicates 0.3]

It migrates the database, creates the example tables and topics, starts the processes, sends
order requests -- re-sending a share of them on purpose, and one invalid order -- then waits
until every order is shipped and every message is consumed, stops everything with SIGTERM,
counts the effects and prints a report. Flags fall back to OUTBOX_DATABASE_URL,
OUTBOX_REDIS_URL and OUTBOX_KAFKA_BOOTSTRAP_SERVERS.

The :class:`Pipeline` class is the one implementation of the example's pipeline: the
repository's ``make demo`` (``scripts/demo.py``) drives it too, adding a throw-away database,
a local broker and a relay killed mid-way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from outbox import migrate

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import app  # noqa: E402

PARTITIONS = 3
KEY_HEADER = "X-Idempotency-Key"


# -- the input -----------------------------------------------------------------------------------


@dataclass
class Plan:
    """The order requests to send, in send order: ``(request id, body)`` pairs."""

    run: str
    orders: int
    messages: list[tuple[str, dict[str, Any]]]
    invalid: int = 1

    @property
    def duplicates(self) -> int:
        return len(self.messages) - self.orders - self.invalid


def plan_requests(orders: int, duplicates: float, seed: object = None) -> Plan:
    """Every order once, a share of them re-sent (some right behind the first delivery, some
    much later, a few three times), and one invalid order that must be dead-lettered."""
    run = uuid.uuid4().hex[:8]
    rng = random.Random(seed if seed is not None else run)
    requests = [
        (f"{run}-{i}", {"customer": f"customer-{i % 17}", "amount_cents": 100 + i})
        for i in range(orders)
    ]
    messages = list(requests)
    rng.shuffle(messages)
    for request in rng.sample(requests, round(orders * duplicates)):
        for _ in range(2 if rng.random() < 0.1 else 1):
            first = messages.index(request)
            messages.insert(rng.randint(first + 1, len(messages)), request)
    invalid = (f"{run}-invalid", {"customer": "nobody", "amount_cents": 0})
    messages.insert(rng.randint(0, len(messages)), invalid)
    return Plan(run=run, orders=orders, messages=messages)


# -- processes -----------------------------------------------------------------------------------


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, children get SIGKILL when the demo dies, so nothing outlives a killed run."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@dataclass
class Process:
    """A child process with its log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv, cwd=HERE, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent(),
            )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def exit_code(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: no clean-up, no final commit -- a crash."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


# -- the pipeline --------------------------------------------------------------------------------


@dataclass
class Counts:
    """Effects of one run, read from PostgreSQL (rows whose request id carries the run id)."""

    orders: int = 0  # distinct request ids with an order row
    order_rows: int = 0  # more than ``orders`` if a duplicate was applied twice
    shipments: int = 0  # distinct orders with a shipment
    shipment_rows: int = 0  # more than ``shipments`` if an event was applied twice
    outbox_backlog: int = 0  # rows the relay has not delivered yet


@dataclass
class Pipeline:
    """The example's processes around one database and one Kafka cluster.

    ``prepare()`` migrates and creates tables and topics, ``start()`` starts the relay and the
    consumers, ``run(plan)`` sends the requests and waits until everything is consumed,
    ``stop()`` stops every process with SIGTERM and returns the exit codes.
    """

    database_url: str
    bootstrap_servers: str
    redis_url: str | None = None
    kafka_config: dict[str, str] = field(default_factory=dict)
    consumers: int = 2
    relay: bool = True
    topic_suffix: str = ""
    relay_args: Sequence[str] = ()
    consumer_args: Sequence[str] = ()
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="order-demo-")))
    processes: list[Process] = field(default_factory=list)
    relay_process: Process | None = None
    engine: sa.Engine | None = None
    consumed_before: int = 0  # offsets the order service committed before this run
    requests_confirmed: int = 0  # order requests the broker confirmed in this run

    @property
    def requests_topic(self) -> str:
        return "order.requests" + self.topic_suffix

    @property
    def accepted_topic(self) -> str:
        return "order.accepted" + self.topic_suffix

    @property
    def order_group(self) -> str:
        return "order-service" + self.topic_suffix  # also the idempotency scope

    @property
    def shipping_group(self) -> str:
        return "shipping" + self.topic_suffix

    def client_config(self) -> dict[str, str]:
        return {**self.kafka_config, "bootstrap.servers": self.bootstrap_servers}

    # ------------------------------------------------------------------------------- set-up

    def prepare(self) -> None:
        """Migrate the database, create the example tables and the topics."""
        migrate.upgrade(self.database_url)
        self.engine = sa.create_engine(self.database_url, pool_size=2)
        app.create_tables(self.engine)
        admin = AdminClient(self.client_config())
        names = [self.requests_topic, self.accepted_topic]
        wanted = [NewTopic(n, PARTITIONS, 1) for n in names]
        wanted += [NewTopic(n + ".dlq", 1, 1) for n in names]
        for future in admin.create_topics(wanted).values():
            try:
                future.result(30)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        # Without a topic suffix the topics may hold earlier runs: count from here.
        self.consumed_before = self.offsets(self.order_group, self.requests_topic)[0]

    def _env(self) -> dict[str, str]:
        # URLs travel in the environment, not on command lines where `ps` would show passwords.
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_DATABASE_URL"] = self.database_url
        env["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"] = self.bootstrap_servers
        if self.redis_url:
            env["OUTBOX_REDIS_URL"] = self.redis_url
        env["ORDER_TOPIC_SUFFIX"] = self.topic_suffix
        return env

    def _kafka_flags(self) -> list[str]:
        return [arg for k, v in self.kafka_config.items() for arg in ("--kafka-config", f"{k}={v}")]

    def spawn(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self._env(), self.log_dir / f"{name}.log").start()
        self.processes.append(process)
        return process

    def start_relay(self) -> Process:
        """Start a relay (again, after a kill); ``relay_process`` is the one running now."""
        count = sum(p.name.startswith("relay") for p in self.processes)
        self.relay_process = self.spawn(
            f"relay-{count + 1}",
            [sys.executable, "-m", "outbox.cli.relay", *self._kafka_flags(), *self.relay_args],
        )
        return self.relay_process

    def start(self) -> list[Process]:
        """Start the relay (unless ``relay=False``) and the consumers."""
        if self.relay:
            self.start_relay()
        consume = [sys.executable, "-m", "outbox.cli", "consume"]
        flags = [*self._kafka_flags(), "--log-level", "INFO", *self.consumer_args]
        for i in range(self.consumers):
            # Every other one runs the coroutine handler: the asyncio runner, in the same group.
            handler = "app:accept_order" if i % 2 == 0 else "app:accept_order_async"
            self.spawn(f"order-service-{i}", [*consume, handler, "--topic",
                       self.requests_topic, "--group", self.order_group, *flags])  # fmt: skip
        self.spawn("shipping", [*consume, "app:ship_order", "--topic", self.accepted_topic,
                   "--group", self.shipping_group, *flags])  # fmt: skip
        return list(self.processes)

    def wait_until_consuming(self, timeout: float = 30.0) -> bool:
        """Wait until every consumer logged a partition assignment (so the first requests are
        not all waiting for the groups to form). False if that took longer than ``timeout``."""
        consumers = [p for p in self.processes if not p.name.startswith("relay")]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            if all("assigned " + self.requests_topic in p.log_text()
                   or "assigned " + self.accepted_topic in p.log_text()
                   for p in consumers):  # fmt: skip
                return True
            time.sleep(0.2)
        return False

    def check_running(self) -> None:
        """Raise if a process failed. One killed with SIGKILL on purpose (the demo's relay
        crash, or ``kill -9`` by hand) is not a failure: its work moves on without it."""
        for p in self.processes:
            code = p.exit_code()
            if code is not None and code != -signal.SIGKILL:
                raise RuntimeError(f"{p.name} exited with {code}:\n{p.tail()}")

    def stop(self) -> dict[str, int | None]:
        """SIGTERM to every process still running (consumers first); their exit codes."""
        return {p.name: p.stop() for p in reversed(self.processes) if p.exit_code() is None}

    def close(self) -> None:
        for p in self.processes:
            p.kill()
        if self.engine is not None:
            self.engine.dispose()

    # ----------------------------------------------------------------------------- the run

    def send(self, plan: Plan, rate: float | None = None, sent: list[int] | None = None) -> None:
        """Produce the plan's requests (at ``rate`` messages per second, or as fast as the
        producer goes) and wait until the broker confirmed each one."""
        producer = Producer({**self.client_config(), "enable.idempotence": True,
                             "linger.ms": 5})  # fmt: skip

        def confirmed(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                self.requests_confirmed += 1

        next_at = time.monotonic()
        for request_id, body in plan.messages:
            producer.produce(self.requests_topic, value=json.dumps(body).encode(),
                             key=body["customer"].encode(), on_delivery=confirmed,
                             headers=[(KEY_HEADER, request_id.encode())])  # fmt: skip
            producer.poll(0)
            if sent is not None:
                sent[0] += 1
            if rate:
                next_at += 1.0 / rate
                time.sleep(max(0.0, next_at - time.monotonic()))
        if producer.flush(60) or self.requests_confirmed < len(plan.messages):
            raise RuntimeError(
                f"the broker confirmed {self.requests_confirmed} of {len(plan.messages)} order "
                "requests within 60s"
            )

    def counts(self, plan: Plan) -> Counts:
        assert self.engine is not None
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT count(DISTINCT o.request_id), count(*), "
                    "(SELECT count(DISTINCT s.order_id) FROM example_shipments s "
                    " JOIN example_orders o2 ON o2.id = s.order_id WHERE o2.request_id LIKE :p), "
                    "(SELECT count(*) FROM example_shipments s "
                    " JOIN example_orders o2 ON o2.id = s.order_id WHERE o2.request_id LIKE :p), "
                    "(SELECT count(*) FROM outbox) "
                    "FROM example_orders o WHERE o.request_id LIKE :p"
                ),
                {"p": f"{plan.run}-%"},
            ).one()
        return Counts(*(int(v) for v in row))

    def offsets(self, group: str, topic: str) -> tuple[int, int]:
        """(offsets ``group`` committed on ``topic``, records in ``topic``), summed over the
        partitions: equal when the group finished every message."""
        consumer = Consumer({**self.client_config(), "group.id": group})
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            tps = [TopicPartition(topic, p) for p in sorted(partitions)]
            committed = sum(max(tp.offset, 0) for tp in consumer.committed(tps, timeout=10))
            ends = sum(consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps)
        finally:
            consumer.close()
        return committed, ends

    def record_keys(self, topic: str, timeout: float = 30.0) -> list[str]:
        """The ``X-Idempotency-Key`` header of every record in ``topic``, start to end."""
        consumer = Consumer({**self.client_config(), "group.id": f"order-demo-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "fetch.wait.max.ms": 50})  # fmt: skip
        keys: list[str] = []
        try:
            partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in partitions}  # fmt: skip
            position = dict.fromkeys(partitions, 0)
            consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
            deadline = time.monotonic() + timeout
            quiet = False
            # Up to the high watermarks, then until a poll brings nothing more: a watermark
            # read a moment too early must not hide the last records.
            while not quiet or any(position[p] < ends[p] for p in partitions):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {topic} stopped at {position} of {ends}")
                batch = consumer.consume(num_messages=1000, timeout=0.5)
                quiet = not batch
                for msg in batch:
                    if msg.error() is not None:
                        raise RuntimeError(f"reading {topic}: {msg.error()}")
                    position[msg.partition()] = msg.offset() + 1
                    raw = dict(msg.headers() or []).get(KEY_HEADER)
                    keys.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        finally:
            consumer.close()
        return keys

    def run(
        self,
        plan: Plan,
        *,
        rate: float | None = None,
        timeout: float = 120.0,
        on_tick: Callable[[Counts, int], None] | None = None,
        tick: float = 0.2,
    ) -> Counts:
        """Send ``plan`` and wait until every order is shipped, the outbox is empty and both
        groups committed every message (duplicates and re-sent events included).

        ``on_tick(counts, messages sent so far)`` runs on every poll: progress, faults.
        Raises ``TimeoutError`` after ``timeout`` seconds, ``RuntimeError`` if a process died.
        """
        sent = [0]
        failure: list[BaseException] = []

        def sender() -> None:
            try:
                self.send(plan, rate, sent)
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=sender, name="send-requests", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while True:
            if failure:
                raise RuntimeError(f"sending the order requests failed: {failure[0]}")
            self.check_running()
            c = self.counts(plan)
            if on_tick is not None:
                on_tick(c, sent[0])
            if (
                not thread.is_alive()
                and c.orders >= plan.orders
                and c.shipments >= plan.orders
                and c.outbox_backlog == 0
                and self.requests_consumed() >= self.requests_confirmed
                and self.finished(self.shipping_group, self.accepted_topic)
            ):
                return c
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"not finished after {timeout:g}s: {c.orders}/{plan.orders} orders, "
                    f"{c.shipments} shipped, {c.outbox_backlog} events in the outbox"
                )
            time.sleep(tick)

    def requests_consumed(self) -> int:
        """Order requests the order service finished in this run (its committed offsets)."""
        return self.offsets(self.order_group, self.requests_topic)[0] - self.consumed_before

    def finished(self, group: str, topic: str) -> bool:
        committed, ends = self.offsets(group, topic)
        return committed >= ends


# -- the command ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("OUTBOX_REDIS_URL"))
    parser.add_argument(
        "--bootstrap-servers", default=os.environ.get("OUTBOX_KAFKA_BOOTSTRAP_SERVERS")
    )
    parser.add_argument(
        "--kafka-config", action="append", default=[], metavar="KEY=VALUE",
        help="extra librdkafka setting for every client (repeatable)",
    )  # fmt: skip
    parser.add_argument("--orders", type=int, default=500)
    parser.add_argument(
        "--duplicates", type=float, default=0.3, help="share of requests re-sent (default 0.3)"
    )
    parser.add_argument(
        "--consumers", type=int, default=2, help="order-service consumer processes (default 2)"
    )
    parser.add_argument(
        "--no-relay", action="store_true",
        help="do not start a relay (one is running already, e.g. docker compose)",
    )  # fmt: skip
    parser.add_argument(
        "--topic-suffix", default="",
        help="appended to the topic and group names, to keep runs apart on a shared cluster",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args(argv)
    if not args.database_url or not args.bootstrap_servers:
        parser.error("--database-url and --bootstrap-servers are required (or the env variables)")
    if args.orders < 1 or not 0 <= args.duplicates <= 1:
        parser.error("--orders must be at least 1 and --duplicates between 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pipeline = Pipeline(
        database_url=args.database_url,
        bootstrap_servers=args.bootstrap_servers,
        redis_url=args.redis_url,
        kafka_config=dict(pair.split("=", 1) for pair in args.kafka_config),
        consumers=args.consumers,
        relay=not args.no_relay,
        topic_suffix=args.topic_suffix,
    )
    plan = plan_requests(args.orders, args.duplicates)
    try:
        pipeline.prepare()
        pipeline.start()
        pipeline.wait_until_consuming()
        print(
            f"sending {len(plan.messages)} order requests: {plan.orders} orders, "
            f"{plan.duplicates} re-sent on purpose, 1 invalid (logs in {pipeline.log_dir})"
        )
        pipeline.run(plan, timeout=args.timeout)
        codes = pipeline.stop()
        c = pipeline.counts(plan)
        consumed = pipeline.requests_consumed()
        dlq = pipeline.requests_topic + ".dlq"
        dead = sum(k.startswith(plan.run) for k in pipeline.record_keys(dlq))
    except (RuntimeError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        for p in pipeline.processes:
            print(f"--- {p.name} ({p.log_path})\n{p.tail()}", file=sys.stderr)
        return 1
    finally:
        pipeline.close()
    print()
    print(f"order requests sent:        {len(plan.messages)}")
    print(f"distinct valid orders:      {plan.orders}")
    print(f"order rows written:         {c.order_rows}")
    print(f"shipment rows written:      {c.shipment_rows}")
    print(f"duplicates absorbed:        {consumed - c.orders - dead}  (re-sent requests, replayed)")
    print(f"dead-lettered:              {dead} invalid order, in {dlq}")
    print(f"exit codes after SIGTERM:   {codes}")
    ok = (
        c.orders == c.order_rows == plan.orders
        and c.shipments == c.shipment_rows == plan.orders
        and consumed == len(plan.messages)
        and dead == plan.invalid
        and set(codes.values()) == {0}
    )
    print("OK: one order and one shipment per request" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
