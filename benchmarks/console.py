"""Benchmark: how long ``outbox console`` takes to render its pages over a big backlog.

    python benchmarks/console.py [--database-url URL] [--pending 1000000] [--parked 10000]
                                 [--requests 20]

A scratch database gets ``--pending`` pending rows over 20 topics and ``--parked`` parked rows
over 5 topics (analyzed), then a real ``outbox console`` process (uvicorn, from the package this
script imports) serves it and each page is fetched ``--requests`` times over HTTP, one at a
time after a first, untimed-in-the-median request. Printed per page: the first request's time
(the overview's first one counts the pending rows; later ones show that count and count again
in the background), the median and the 95th percentile of the full request time, and the
median as a ratio of ``/healthz`` (the same server answering without the database) measured in
the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from scratch import database_argument, scratch_database

# benchmarks/http.py would shadow the standard library's http package, which httpx imports.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import httpx  # noqa: E402

ROOT = HERE.parent

PENDING = """
INSERT INTO outbox (event_id, topic, key, value, headers, key_hash)
SELECT gen_random_uuid(), 'orders-' || (i % 20), convert_to('k' || (i % 100000), 'UTF8'),
       convert_to('{"order": ' || i || ', "note": "pending"}', 'UTF8'), '{"source": "bench"}',
       ((i::bigint * 7919) % 2147483647)::int
FROM generate_series(1, :n) AS i
"""
PARKED = """
INSERT INTO outbox (event_id, topic, key, value, headers, key_hash, attempts, last_error,
                    parked_at)
SELECT gen_random_uuid(), 'payments-' || (i % 5), convert_to('p' || i, 'UTF8'),
       convert_to(repeat('x', 200 + i % 5000), 'UTF8'), '{"source": "bench"}',
       ((i::bigint * 104729) % 2147483647)::int, 10,
       CASE WHEN i % 3 = 0 THEN 'MSG_SIZE_TOO_LARGE: Broker: Message size too large'
            WHEN i % 3 = 1 THEN 'TOPIC_AUTHORIZATION_FAILED: not authorized'
            ELSE 'UNKNOWN_TOPIC_OR_PART: unknown topic' END,
       now() - make_interval(secs => i)
FROM generate_series(1, :n) AS i
"""

PAGES = [
    ("/healthz", "baseline: no database"),
    ("/", "overview"),
    ("/parked", "parked, first page"),
    ("/parked?topic=payments-3", "parked, by topic"),
    ("/parked?error=authorization", "parked, by error text"),
    ("/parked?key=p4242", "parked, by key"),
    ("/parked?topic=payments-1&error=size&offset=500", "parked, topic+error, page 11"),
    ("/keys?scope=checkout&key=k42", "key lookup"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    database_argument(parser, "outbox_bench_console")
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--parked", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--port", type=int, default=18631)
    args = parser.parse_args()

    with scratch_database(args.database_url) as url:
        engine = sa.create_engine(url)
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(sa.text(PENDING), {"n": args.pending})
            conn.execute(sa.text(PARKED), {"n": args.parked})
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE outbox"))
        engine.dispose()
        print(
            f"{args.pending:,} pending and {args.parked:,} parked rows written in "
            f"{time.perf_counter() - started:.1f} s"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(OUTBOX_DATABASE_URL=url, PYTHONPATH=str(ROOT), OUTBOX_LOG_LEVEL="WARNING")
        server = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "console", "--port", str(args.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        base = f"http://127.0.0.1:{args.port}"
        try:
            with httpx.Client(base_url=base, timeout=60) as client:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit("outbox console did not start")
                    time.sleep(0.2)
                results: dict[str, list[float]] = {}
                first: dict[str, float] = {}
                for path, _label in PAGES:
                    t0 = time.perf_counter()
                    assert client.get(path).status_code == 200, path  # warm-up, and a check
                    first[path] = time.perf_counter() - t0
                    times = []
                    for _ in range(args.requests):
                        t0 = time.perf_counter()
                        response = client.get(path)
                        times.append(time.perf_counter() - t0)
                        assert response.status_code == 200, path
                    results[path] = times
        finally:
            server.terminate()
            server.wait(timeout=30)

    baseline = statistics.median(results["/healthz"])
    print(f"\n{'page':44}  {'first ms':>8}  {'median ms':>9}  {'p95 ms':>7}  {'x /healthz':>10}")
    for path, label in PAGES:
        times = sorted(results[path])
        median = statistics.median(times)
        p95 = times[min(len(times) - 1, int(len(times) * 0.95))]
        print(
            f"{label:44}  {first[path] * 1000:8.1f}  {median * 1000:9.1f}  {p95 * 1000:7.1f}  "
            f"{median / baseline:10.1f}"
        )


if __name__ == "__main__":
    main()
