"""Benchmark: the Redis guard against a plain ``SET NX`` + ``GET`` loop on the same Redis.

    python benchmarks/guard.py [--redis-url URL] [--ops 20000] [--rounds 3]

In one run, on one connection, one operation at a time, it measures:

* **plain new key**: ``SET key value NX PX`` then ``GET key`` -- a lock-and-read with no
  owner token, no lease check, no fence and no stored result (two round trips);
* **guard claim-and-complete**: ``with guard.claim(key) as c: c.result = {...}`` on a new key
  (the claim script, then the finish script);
* **plain duplicate**: ``GET`` of an existing key (one round trip);
* **guard duplicate**: a claim of a completed key, which replays its result.

The four kinds take turns every 500 operations, so that a change in the machine's load hits them
alike. Each figure is the best of ``--rounds`` rounds; the ratios are guard / plain. The
round trips per operation are counted by the server (``INFO commandstats``), so the run uses a
``redis-server`` of its own on a free port unless ``--redis-url`` names one (where other
clients' commands would blur the count).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis

from outbox.guard import RedisGuard


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH: install Redis or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    workdir = tempfile.mkdtemp(prefix="outbox-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


CHUNK = 500  # operations of one kind before the next kind runs: load changes hit all kinds


@dataclass
class Figure:
    ops_per_s: float
    p50_us: float
    p99_us: float
    round_trips: float


@dataclass
class Tally:
    """One kind of operation over one round, gathered chunk by chunk."""

    elapsed: float = 0.0
    calls: int = 0
    samples: list[int] = field(default_factory=list)

    def run(self, op: Callable[[int], object], start: int, counter: Callable[[], int]) -> None:
        calls = counter()
        began = time.perf_counter()
        for i in range(start, start + CHUNK):
            t0 = time.perf_counter_ns()
            op(i)
            self.samples.append(time.perf_counter_ns() - t0)
        self.elapsed += time.perf_counter() - began
        self.calls += counter() - calls

    def figure(self) -> Figure:
        samples = sorted(self.samples)
        n = len(samples)
        return Figure(
            n / self.elapsed, samples[n // 2] / 1000, samples[int(n * 0.99)] / 1000, self.calls / n
        )


def best(figures: list[Figure]) -> Figure:
    return max(figures, key=lambda f: f.ops_per_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: start a private one)")
    parser.add_argument(
        "--ops",
        type=int,
        default=20000,
        help=f"operations per kind and round (a multiple of {CHUNK})",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best counts")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(private_redis())
        run(url, args.ops, args.rounds)


def run(url: str, n: int, rounds: int) -> None:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    plain = redis.Redis.from_url(url)
    admin = redis.Redis.from_url(url)
    guard = RedisGuard(url, prefix=prefix, lease=30)

    def commands(*names: str) -> Callable[[], int]:
        def count() -> int:
            stats = admin.info("commandstats")
            return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)

        return count

    plain_count = commands("set", "get")
    guard_count = commands("evalsha", "eval")

    # The plain loop's "lock" and the guard's claim, on keys never seen before.
    def plain_new(r: int) -> Callable[[int], object]:
        def op(i: int) -> object:
            key = f"{prefix}:plain:{r}:{i}"
            plain.set(key, "owner", nx=True, px=30000)
            return plain.get(key)

        return op

    def guard_new(r: int) -> Callable[[int], object]:
        def op(i: int) -> object:
            with guard.claim(f"new-{r}-{i}") as claim:
                claim.result = {"i": i}
            return claim.fence

        return op

    n = max(CHUNK, n - n % CHUNK)
    for i in range(n):  # the keys duplicates read
        plain.set(f"{prefix}:dup:{i}", '{"i": 1}')
        with guard.claim(f"dup-{i}") as claim:
            claim.result = {"i": i}

    def plain_dup(i: int) -> object:
        return plain.get(f"{prefix}:dup:{i}")

    def guard_dup(i: int) -> object:
        with guard.claim(f"dup-{i}") as claim:
            assert claim.replayed
            return claim.result

    # Warm up connections and the script cache.
    Tally().run(plain_new(-1), 0, plain_count)
    Tally().run(guard_new(-1), 0, guard_count)
    results: dict[str, list[Figure]] = {k: [] for k in ("pn", "gn", "pd", "gd")}
    for r in range(rounds):
        tallies = {k: Tally() for k in results}
        for start in range(0, n, CHUNK):  # the four kinds take turns, CHUNK operations each
            tallies["pn"].run(plain_new(r), start, plain_count)
            tallies["gn"].run(guard_new(r), start, guard_count)
            tallies["pd"].run(plain_dup, start, plain_count)
            tallies["gd"].run(guard_dup, start, guard_count)
        for k, tally in tallies.items():
            results[k].append(tally.figure())
    pn, gn, pd, gd = (best(results[k]) for k in ("pn", "gn", "pd", "gd"))

    print(f"Redis guard vs plain commands: {n} ops per kind and round, best of {rounds}, 1 client")
    print()
    print(f"{'operation':<36} {'ops/s':>9} {'p50 us':>8} {'p99 us':>8} {'round trips':>12}")
    for name, fig in (
        ("plain new key (SET NX + GET)", pn),
        ("guard claim-and-complete", gn),
        ("plain duplicate (GET)", pd),
        ("guard duplicate (replayed)", gd),
    ):
        print(
            f"{name:<36} {fig.ops_per_s:>9,.0f} {fig.p50_us:>8.1f} {fig.p99_us:>8.1f} "
            f"{fig.round_trips:>12.2f}"
        )
    print()
    print(f"new key:   guard / plain ops/s = {gn.ops_per_s / pn.ops_per_s:.2f}  (target >= 0.5)")
    print(f"duplicate: guard / plain ops/s = {gd.ops_per_s / pd.ops_per_s:.2f}, "
          f"p50 {gd.p50_us / pd.p50_us:.2f}x the plain GET")  # fmt: skip
    print(f"round trips: claim-and-complete {gn.round_trips:.2f} (target <= 2), "
          f"duplicate {gd.round_trips:.2f} (target 1)")  # fmt: skip
    spread = statistics.pstdev(f.ops_per_s for f in results["gn"]) / gn.ops_per_s
    print(f"spread of the guard's rounds: {100 * spread:.1f}% of the best")
    stats = admin.info("commandstats")
    server = {
        name: float(stats[f"cmdstat_{name}"]["usec_per_call"])
        for name in ("evalsha", "set", "get")
        if f"cmdstat_{name}" in stats
    }
    print("server time per call (us): " + ", ".join(f"{k} {v:.2f}" for k, v in server.items()))

    keys = list(admin.scan_iter(match=f"{prefix}:*", count=1000))  # plain and guard keys
    for start in range(0, len(keys), 500):
        admin.unlink(*keys[start : start + 500])
    guard.close()
    plain.close()
    admin.close()


if __name__ == "__main__":
    main()
