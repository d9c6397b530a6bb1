"""Benchmark: ``outbox gc`` removing millions of expired idempotency keys while units of work run.

    python benchmarks/gc.py [--database-url URL] [--keys 5000000] [--seconds 10]
                            [--duty-cycle 1]

Measured in one run, against one PostgreSQL: ``--keys`` expired keys (last updated 30 days ago)
are loaded; then 4 writer processes run units of work (a key and one event each) for
``--seconds`` without gc (the baseline), for ``--seconds`` while ``outbox gc`` deletes the
expired keys (with ``--duty-cycle``), and for ``--seconds`` again after gc finished (when
autovacuum may be cleaning up after it). It prints the writers' rate during gc as a ratio of
the window before it, gc's own rate (keys per second over its whole run) and the keys table's
size before, after gc and after a VACUUM (space a VACUUM returns to the table for new keys, not
to the file system). Ratios are the figures to read: the machine may be shared.

The database named by ``--database-url`` is created and dropped by the benchmark.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa
from scratch import database_argument, scratch_database

import outbox
from outbox import admin

WRITERS = 4
VALUE = b'{"order_id":42,"amount":1999,"currency":"EUR"}'
SEED = sa.text(
    """
INSERT INTO idempotency_keys (scope, key, status, result, created_at, updated_at)
SELECT 'bench', 'expired-' || g, 'completed', '{"ok": true}',
       now() - interval '30 days', now() - interval '30 days' + g * interval '1 ms'
FROM generate_series(:start, :stop) g
"""
)


def _worker(url: str, seconds: float, start: Any, out: Any, wid: int) -> None:
    ob = outbox.Outbox(
        url,
        engine_options={"pool_size": 1, "max_overflow": 0},
        config=outbox.OutboxConfig(wake_relays=False),
    )
    start.wait()
    deadline = time.perf_counter() + seconds
    n = 0
    prefix = f"{wid}-{uuid.uuid4().hex[:8]}"
    while time.perf_counter() < deadline:
        with ob.unit_of_work(f"{prefix}-{n}", scope="bench") as uow:
            uow.publish("bench-gc", VALUE, key=f"customer-{n % 1000}")
        n += 1
    out.put(n)
    ob.close()


def writers(url: str, seconds: float, started: threading.Event | None = None) -> float:
    """Units of work per second of ``WRITERS`` processes over ``seconds``."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, seconds, start, out, w)) for w in range(WRITERS)
    ]
    for p in procs:
        p.start()
    time.sleep(1.5)  # imports and connections, before the clock
    if started is not None:
        started.set()
    start.set()
    done = sum(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    return done / seconds


def size(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.text("SELECT pg_total_relation_size('idempotency_keys')")).scalar_one()
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    database_argument(parser, "outbox_bench_gc")
    parser.add_argument("--keys", type=int, default=5_000_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--duty-cycle", type=float, default=1.0, help="gc's --duty-cycle")
    args = parser.parse_args()
    with scratch_database(args.database_url) as url:
        engine = sa.create_engine(url)
        loaded = time.perf_counter()
        for start in range(1, args.keys + 1, 500_000):
            with engine.begin() as conn:
                conn.execute(SEED, {"start": start, "stop": min(start + 499_999, args.keys)})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE idempotency_keys"))
        print(f"loaded {args.keys:,} expired keys in {time.perf_counter() - loaded:.0f} s")
        before = size(engine)
        baseline = writers(url, args.seconds)
        result: dict[str, Any] = {}
        go = threading.Event()

        def gc() -> None:
            go.wait()
            result["gc"] = admin.run_gc(engine, 7 * 86400.0, duty_cycle=args.duty_cycle)
            result["done"] = time.perf_counter()

        thread = threading.Thread(target=gc)
        thread.start()
        during = writers(url, args.seconds, go)
        window_end = time.perf_counter()
        thread.join()
        covered = result["done"] >= window_end
        after_gc = size(engine)
        after = writers(url, args.seconds)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM idempotency_keys"))
        vacuumed = size(engine)
        engine.dispose()
    res: admin.GcResult = result["gc"]
    rows = [
        ("units of work/s, 4 writers: without gc (before / after)",
         f"{baseline:,.0f} / {after:,.0f}"),
        ("units of work/s, 4 writers: while gc runs",
         f"{during:,.0f} ({during / baseline:.2f}x before gc"
         + ("" if covered else "; gc ended inside the window, raise --keys") + ")"),
        (f"outbox gc --duty-cycle {args.duty_cycle:g}",
         f"{res.deleted:,} keys in {res.seconds:.1f} s "
         f"({res.deleted / res.seconds:,.0f} keys/s, {res.batches:,} batches)"),
        ("idempotency_keys size: before / after gc / after VACUUM",
         f"{before / 2**20:,.0f} / {after_gc / 2**20:,.0f} / {vacuumed / 2**20:,.0f} MB"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print(f"\n{'measurement':{width}}  result")
    print(f"{'-' * width}  {'-' * 40}")
    for name, value in rows:
        print(f"{name:{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
