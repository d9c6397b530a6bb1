"""Benchmark: the sync consumer runner's micro-batches in this process, without a broker.

    python benchmarks/consumer_micro.py [--database-url URL] [--redis-url URL]
                                        [--messages 10000] [--batch-size 500]
                                        [--handlers handle,handle_batch] [--without-redis]
                                        [--no-optimistic] [--profile DIR]

``benchmarks/consumer.py`` measures ``outbox consume`` as a whole, Kafka included; on a shared
machine its rates move with everything else the broker and the client do. This one measures
only what the runner does with messages once they are in hand: ``--messages`` records built
in memory (4 partitions, 200-byte values, unique ``X-Idempotency-Key`` headers) are put in the
backlogs of a ``ConsumerRunner`` that never connects to a broker, and its micro-batches
(``MicroBatches.run``, the code ``outbox consume`` runs) take them to the end: first as new
keys, then the same records again in a new group (every one a duplicate). The handlers are
``benchmarks/consumer.py``'s: ``handle`` (one ``INSERT`` per message; optimistic batches unless
``--no-optimistic``) and ``handle_batch`` (a ``@batch_handler``, one ``INSERT ... SELECT
unnest(...)`` per batch). Each phase's business rows are counted: one per key, or the run
fails. Each phase prints its rate, its time a message and the CPU time a message of this
process (the server's is not in it), which a busy machine moves less than the rates.
``--profile DIR`` writes a cProfile of each phase to DIR (its figures carry the profiler's
cost).

Run it from two checkouts one after the other (each with its own ``.venv``) to see what a
change buys, in the same minutes of the same machine.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import sys
import time
import uuid
from pathlib import Path

from scratch import database_argument, scratch_database

# This folder holds benchmarks named like modules the imports below need (http.py): it leaves
# the path once scratch is in.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import sqlalchemy as sa  # noqa: E402
from confluent_kafka import Message  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

import outbox  # noqa: E402
from outbox.consumer import ConsumerRunner, MessageBatch, batch_handler  # noqa: E402
from outbox.consumer._micro_batches import MicroBatches  # noqa: E402

INSERT = sa.text("INSERT INTO bench_effect (key) VALUES (:key)")
INSERT_ALL = sa.text("INSERT INTO bench_effect (key) SELECT unnest(CAST(:keys AS text[]))")
TOPIC = "bench"
PARTITIONS = 4


def handle(uow: outbox.UnitOfWork, message: object) -> None:
    uow.connection.execute(INSERT, {"key": uow.key})


@batch_handler
def handle_batch(batch: MessageBatch) -> None:
    batch.connection.execute(INSERT_ALL, {"keys": [uow.key for uow, _ in batch]})


HANDLERS = {"handle": handle, "handle_batch": handle_batch}


class NoDeadLetters:
    """Every message here succeeds: a dead letter is a failed run."""

    def send_message(self, message: object, letter: object) -> None:
        raise RuntimeError(f"unexpected dead letter: {letter}")


def records(count: int, run: str) -> list[Message]:
    return [
        Message(
            topic=TOPIC,
            partition=p,
            offset=o,
            key=None,
            value=b"x" * 200,
            headers=[("X-Idempotency-Key", f"{run}-{p}-{o}".encode())],
        )
        for p in range(PARTITIONS)
        for o in range(count // PARTITIONS)
    ]


def phase(
    ob: outbox.Outbox,
    handler: str,
    scope: str,
    messages: list[Message],
    batch_size: int,
    optimistic: bool,
    profile: Path | None,
) -> tuple[float, float]:
    """Seconds the micro-batches took to finish ``messages`` (a new group each time), and the
    CPU seconds this process spent on them (less moved than the first by a busy machine)."""
    runner = ConsumerRunner(
        ob, HANDLERS[handler], topics=[TOPIC], group=f"micro-{uuid.uuid4().hex[:8]}",
        scope=scope, batch_size=batch_size, optimistic=optimistic and handler == "handle",
        bootstrap_servers="127.0.0.1:9", metrics_registry=CollectorRegistry(),
    )  # fmt: skip
    batches = MicroBatches(
        runner._attempts(NoDeadLetters()),  # type: ignore[arg-type]
        runner.config, runner._partitions, runner._metrics,
        stopping=runner._stopping, beat=runner._beat,
    )  # fmt: skip
    runner._partitions.assign([(TOPIC, p) for p in range(PARTITIONS)])
    for message in messages:
        runner._accept(message)
    profiler = cProfile.Profile() if profile is not None else None
    started, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    while plan := runner._partitions.take(batch_size, time.monotonic()):
        if not batches.run(plan).moved:
            raise RuntimeError("a micro-batch moved nothing")
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    database_argument(parser, "outbox_bench_consumer_micro")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--handlers", default="handle,handle_batch")
    parser.add_argument("--without-redis", action="store_true", help="also run without Redis")
    parser.add_argument("--no-optimistic", action="store_true", help="handle with savepoints")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR")
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    gc.freeze()  # as outbox consume does once it is set up
    gc.set_threshold(50_000, 20, 20)
    n = args.messages - args.messages % PARTITIONS
    with scratch_database(
        args.database_url, "CREATE TABLE bench_effect (key text NOT NULL)"
    ) as url:
        print(f"{n} messages per phase, batch size {args.batch_size}", flush=True)
        for redis_url in [args.redis_url, *([None] if args.without_redis else [])]:
            for handler in args.handlers.split(","):
                with outbox.Outbox(url, redis_url=redis_url) as ob:
                    run, scope = uuid.uuid4().hex[:8], f"micro-{uuid.uuid4().hex[:8]}"
                    messages = records(n, run)
                    for name in ("new keys", "100% duplicates"):
                        label = f"{handler}{'' if redis_url else ', no Redis'}, {name}"
                        profile = None
                        if args.profile is not None:
                            profile = args.profile / ("-".join(label.replace(",", "").split())
                                                      .rstrip("%") + ".prof")  # fmt: skip
                        seconds, cpu = phase(ob, handler, scope, messages, args.batch_size,
                                             not args.no_optimistic, profile)  # fmt: skip
                        with ob.engine.connect() as conn:
                            rows, keys = conn.execute(sa.text(
                                "SELECT count(*), count(DISTINCT key) FROM bench_effect "
                                "WHERE key LIKE :run"), {"run": f"{run}-%"}).one()  # fmt: skip
                        if rows != n or keys != n:
                            raise RuntimeError(f"{label}: {rows} rows for {keys} of {n} keys")
                        print(f"  {label:<40} {n / seconds:>9.0f} msg/s "
                              f"{seconds * 1e6 / n:>7.1f} us/msg {cpu * 1e6 / n:>7.1f} us CPU/msg",
                              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
