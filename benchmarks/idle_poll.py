"""What one poll of an idle database costs: backend and client CPU per poll, before and after.

    cd benchmarks && ../.venv/bin/python idle_poll.py [--polls 2000] [--rounds 4] [--baseline DIR]

One relay (the claim engine) on a migrated database whose outbox is empty, every lane owned, no
Kafka needed (an empty poll never produces). Two kinds of poll alternate in rounds of
``--polls`` each, so that both are measured in the same run on the same session:

* **claim**: the poll of a relay just woken (``Reset.WAKEUP`` before it): the low-water
  readings and the claim, as every empty poll was before;
* **check**: the fallback poll of an idle relay: one statement that checks the mark's facts and
  answers "nothing pending";
* **baseline** (with ``--baseline DIR``, a checkout such as ``git worktree add /tmp/base main``):
  the empty poll of the ``outbox`` package in DIR, in a process of its own each round.

Backend CPU is the session's backend's user + system clock ticks (``/proc/<pid>/stat``), client
CPU this thread's own (``time.thread_time``); both are divided by the polls. The figures that
count are the ratio check/claim; the machine's load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/http.py would stand in for the standard library's http, which prometheus_client
# (imported with the relay) needs.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import sqlalchemy as sa  # noqa: E402

from outbox.config import RelayConfig  # noqa: E402
from outbox.relay._engine import Reset  # noqa: E402
from outbox.relay._relay import Relay  # noqa: E402
from outbox.testing.databases import TemplateDatabases  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# A checkout from before the cheap poll has no such reset: its every poll claims.
WAKEUP = getattr(Reset, "WAKEUP", None)


def _process_ticks(pid: int) -> int:
    """User + system clock ticks of one process."""
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def measure(
    relay: Relay, conn: sa.Connection, pid: int, polls: int, woken: bool
) -> tuple[float, float]:
    """Backend and client CPU milliseconds per poll over ``polls`` empty polls."""
    backend = _process_ticks(pid)
    client = time.thread_time()
    for _ in range(polls):
        if woken and WAKEUP is not None:
            relay.batches.reset(WAKEUP)
        result = relay.process_batch(conn)
        assert result.claimed == 0, "the outbox is not empty"
    client = time.thread_time() - client
    backend = _process_ticks(pid) - backend
    return backend / TICK * 1000 / polls, client * 1000 / polls


def run(url: str, polls: int, kinds: list[str], rounds: int) -> dict[str, list[float]]:
    """Backend and client milliseconds per poll of each of ``kinds``, over ``rounds``."""
    relay = Relay(RelayConfig(database_url=url, bootstrap_servers="127.0.0.1:9"))
    totals = {kind: [0.0, 0.0] for kind in kinds}
    try:
        conn = relay.session.connect()
        relay.lanes.rebalance(conn)
        assert relay.lanes.owned == set(range(relay.config.lanes))
        pid = relay.lanes.pid
        assert pid is not None
        relay.process_batch(conn)  # the first claim: the mark moves, the relay is idle
        for _ in range(rounds):
            for kind in kinds:
                backend, client = measure(relay, conn, pid, polls, kind != "check")
                totals[kind][0] += backend / rounds
                totals[kind][1] += client / rounds
    finally:
        relay.session.drop()
        relay.engine.dispose()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    )
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline", type=Path, help="a checkout whose empty poll to measure")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    templates = TemplateDatabases(args.server_url)
    url = templates.create()
    totals: dict[str, list[float]] = {}
    try:
        if args.child:
            print(json.dumps(run(url, args.polls, ["claim"], 1)["claim"]))
            return
        base = [0.0, 0.0]
        for _ in range(args.rounds):
            if args.baseline is not None:
                env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
                out = subprocess.run(
                    [sys.executable, __file__, "--child", "--polls", str(args.polls),
                     "--server-url", args.server_url],
                    env=env, check=True, capture_output=True, text=True,
                )  # fmt: skip
                spent = json.loads(out.stdout.strip().splitlines()[-1])
                base = [b + x / args.rounds for b, x in zip(base, spent, strict=True)]
            for kind, (backend, client) in run(url, args.polls, ["claim", "check"], 1).items():
                mine = totals.setdefault(kind, [0.0, 0.0])
                mine[0] += backend / args.rounds
                mine[1] += client / args.rounds
        if args.baseline is not None:
            totals = {"baseline": base, **totals}
    finally:
        templates.drop(url)
        templates.close()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.rounds} rounds of {args.polls} empty polls of each kind, load average {load}")
    for kind, (backend, client) in totals.items():
        print(f"  {kind:8}: backend {backend:.3f} ms + client {client:.3f} ms per poll")
    check = sum(totals["check"])
    for kind in [k for k in totals if k != "check"]:
        print(f"  check / {kind}: {check / sum(totals[kind]):.2f} (backend + client)")


if __name__ == "__main__":
    main()
