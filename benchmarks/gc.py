"""Benchmark: ``outbox gc`` removing millions of expired idempotency keys while units of work run.

    python benchmarks/gc.py [--database-url URL] [--keys 5000000] [--window 2]
                            [--duty-cycle 1]

Measured in one run, against one PostgreSQL: ``--keys`` expired keys (last updated 30 days ago)
are loaded; 4 writer processes run units of work (a key and one event each) the whole time,
and ``outbox gc`` deletes the expired keys (``--duty-cycle`` as its flag) in windows of
``--window`` seconds that alternate with windows in which gc waits between two batches. On a
shared machine the writers' rate moves from one moment to the next more than gc moves it, so
each gc window is compared with the quiet window just before it: the median of those per-pair
ratios is the writers' rate while gc runs. Also printed: gc's rate (keys per second of its
working windows) and the keys table's size before, after gc and after a VACUUM (space a VACUUM
returns to the table for new keys, not to the file system).

The database named by ``--database-url`` is created and dropped by the benchmark.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
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


def _worker(url: str, stop: Any, counter: Any, wid: int) -> None:
    """Units of work until ``stop``, counted in ``counter``."""
    ob = outbox.Outbox(
        url,
        engine_options={"pool_size": 1, "max_overflow": 0},
        config=outbox.OutboxConfig(wake_relays=False),
    )
    n = 0
    prefix = f"{wid}-{uuid.uuid4().hex[:8]}"
    while not stop.is_set():
        with ob.unit_of_work(f"{prefix}-{n}", scope="bench") as uow:
            uow.publish("bench-gc", VALUE, key=f"customer-{n % 1000}")
        n += 1
        with counter.get_lock():
            counter.value += 1
    ob.close()


def size(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(sa.text("SELECT pg_total_relation_size('idempotency_keys')")).scalar_one()
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    database_argument(parser, "outbox_bench_gc")
    parser.add_argument("--keys", type=int, default=5_000_000)
    parser.add_argument("--window", type=float, default=2.0)
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

        ctx = mp.get_context("spawn")
        stop, counter = ctx.Event(), ctx.Value("q", 0)
        procs = [ctx.Process(target=_worker, args=(url, stop, counter, w)) for w in range(WRITERS)]
        for p in procs:
            p.start()
        working = threading.Event()  # gc deletes while set; waits between batches otherwise
        result: dict[str, Any] = {}

        def hold(_done: int, _candidates: int) -> None:
            working.wait()

        def gc() -> None:
            result["gc"] = admin.run_gc(
                engine, 7 * 86400.0, duty_cycle=args.duty_cycle, progress=hold
            )

        def window(gc_on: bool) -> float:
            if gc_on:
                working.set()
            else:
                working.clear()
            first = counter.value
            time.sleep(args.window)
            return (counter.value - first) / args.window

        while counter.value < 100 * WRITERS:  # the writers import, connect and warm up
            time.sleep(0.1)
        thread = threading.Thread(target=gc)
        thread.start()
        ratios: list[float] = []
        quiet: list[float] = []
        busy: list[float] = []
        gc_time = 0.0
        while thread.is_alive():
            if not all(p.is_alive() for p in procs):
                raise SystemExit("a writer process died")
            off = window(False)
            started = time.perf_counter()
            on = window(True)
            gc_time += time.perf_counter() - started
            if thread.is_alive():  # gc worked the whole window
                quiet.append(off)
                busy.append(on)
                ratios.append(on / off)
        working.set()
        thread.join()
        stop.set()
        for p in procs:
            p.join()
        after_gc = size(engine)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM idempotency_keys"))
        vacuumed = size(engine)
        engine.dispose()
    res: admin.GcResult = result["gc"]
    rows = [
        (f"units of work/s, 4 writers, {len(ratios)} pairs of {args.window:g} s windows",
         f"without gc {statistics.median(quiet):,.0f}, while gc works "
         f"{statistics.median(busy):,.0f}" if ratios else "gc ended in its first window"),
        ("units of work/s while gc works, median of the per-pair ratios",
         f"{statistics.median(ratios):.2f}x (pairs from {min(ratios):.2f}x to {max(ratios):.2f}x)"
         if ratios else "-"),
        (f"outbox gc --duty-cycle {args.duty_cycle:g}",
         f"{res.deleted:,} keys, {res.deleted / gc_time:,.0f} keys/s of its working windows "
         f"({res.batches:,} batches)"),
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
