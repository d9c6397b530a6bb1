"""``outbox-relay`` (also ``python -m outbox.cli.relay``): carry committed outbox rows to Kafka.

Exit codes: 0 when stopped by SIGTERM/SIGINT, drained (``--once``) or the check passed; 1 on a
runtime error or a failed ``--check``; 2 on bad flags or settings.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Mapping, Sequence

from outbox._core.environment import ENV_DATABASE_URL
from outbox._core.stopping import stop_on_signals
from outbox._core.urls import check_database_url
from outbox._kafka.config import producer_config
from outbox._metrics_server import MetricsServer
from outbox.cli._common import (
    EXIT_FAILURE,
    EXIT_OK,
    SECRETS_EPILOG,
    Parser,
    add_flags,
    add_kafka_config,
    require,
    resolve_flags,
    run,
    tune_collector,
)
from outbox.cli._fleet_flags import FLEET_FLAGS
from outbox.config import FleetConfig, RelayConfig, env
from outbox.errors import ConfigurationError
from outbox.relay import Fleet, Relay, RunResult, relay_max_silence

log = logging.getLogger("outbox.relay")

PROG = "outbox-relay"
EXIT_CODES: Mapping[RunResult, int] = {RunResult.FINISHED: EXIT_OK}


def build_parser() -> argparse.ArgumentParser:
    """The ``outbox-relay`` parser: every setting also reads its ``OUTBOX_*`` variable."""
    parser = Parser(
        prog=PROG,
        description="Relay committed outbox rows to Kafka: no loss, per-key order, many relays.",
        epilog=SECRETS_EPILOG,
    )
    d = RelayConfig("", "")
    parser.add_argument(
        "--database-url",
        dest="database_urls",
        action="append",
        default=[],
        metavar="URL",
        help="PostgreSQL URL, postgresql+psycopg://user:pass@host/db; repeat it to serve many "
        f"databases (env {ENV_DATABASE_URL}: one URL, preferred: a flag's value shows in ps)",
    )
    add_flags(parser, *FLEET_FLAGS)
    add_flags(parser, "schema", "bootstrap_servers")
    add_kafka_config(parser)
    add_flags(
        parser,
        "log_level",
        "batch_size",
        "poll_interval",
        "lanes",
        "max_attempts",
        "rebalance_interval",
        "engine",
        "metrics_port",
        "metrics_host",
        batch_size={"default": d.batch_size},
        poll_interval={"default": d.poll_interval, "default_text": f"{d.poll_interval:g}"},
        lanes={"default": d.lanes},
        max_attempts={"default": d.max_attempts},
        rebalance_interval={
            "default": d.rebalance_interval,
            "default_text": f"{d.rebalance_interval:g}",
        },
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="drain what is pending, then exit 0")
    mode.add_argument(
        "--check",
        action="store_true",
        help="verify the schema is migrated and the broker answers, then exit",
    )
    return parser


def database_urls(args: argparse.Namespace) -> list[str]:
    """The ``--database-url`` flags given, else ``OUTBOX_DATABASE_URL``; each checked."""
    urls = list(args.database_urls or [])
    from_env = env(ENV_DATABASE_URL)
    if not urls and from_env:
        urls = [from_env]
    for url in urls:
        check_database_url(url)
    # For the error messages' redaction (outbox.cli._common.run).
    args.database_url = urls[0] if urls else None
    return urls


def is_fleet(args: argparse.Namespace) -> bool:
    """Many databases: more than one URL, a databases file or a discovery query."""
    resolve_flags(args)
    return bool(len(database_urls(args)) > 1 or args.databases_file or args.discover_url)


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    """Flags first, then ``OUTBOX_*`` environment variables, then defaults."""
    resolve_flags(args)
    urls = database_urls(args)
    if not urls and (args.databases_file or args.discover_url):
        # Many databases: each relay gets its own URL (Fleet); this one is a placeholder.
        urls = [args.membership_url or args.discover_url or "postgresql://localhost/postgres"]
    if urls:
        args.database_url = urls[0]
    return RelayConfig(
        database_url=require(args, "database_url"),
        bootstrap_servers=require(args, "bootstrap_servers"),
        schema=args.schema,
        kafka_config=args.kafka_config,
        batch_size=args.batch_size,
        poll_interval=args.poll_interval,
        lanes=args.lanes,
        max_attempts=args.max_attempts,
        rebalance_interval=args.rebalance_interval,
        engine=args.engine,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    ).validate()


def fleet_config_from_args(args: argparse.Namespace) -> FleetConfig:
    """The settings of a relay serving many databases."""
    relay = config_from_args(args)
    return FleetConfig(
        relay=relay,
        database_urls=tuple(database_urls(args)),
        databases_file=args.databases_file,
        discover_url=args.discover_url,
        discover_pattern=args.discover_pattern,
        member_id=args.member_id or socket.gethostname(),
        membership_url=args.membership_url,
        refresh_interval=args.refresh_interval,
    ).validate()


def fleet_command(args: argparse.Namespace) -> int:
    for flag, given in (
        ("--once", args.once),
        ("--check", args.check),
    ):
        if given:
            raise ConfigurationError(
                f"{flag} serves one database: give a single --database-url with it"
            )
    config = fleet_config_from_args(args)
    producer_config(config.relay.bootstrap_servers, config.relay.kafka_config)
    fleet = Fleet(config)
    tune_collector()
    with stop_on_signals(fleet.stop):
        server = None
        if args.metrics_port is not None:
            # Every served database's series, with a database label (outbox.relay._fleet_metrics).
            server = MetricsServer(
                fleet.metrics,
                args.metrics_port,
                host=config.relay.metrics_host,
                max_silence=relay_max_silence(config.relay),
            ).start()
            log.info("event=metrics_listening host=%s port=%d", server.host, server.port)
        try:
            return EXIT_CODES[fleet.run()]
        finally:
            if server is not None:
                server.close()


def command(args: argparse.Namespace) -> int:
    if is_fleet(args):
        return fleet_command(args)
    config = config_from_args(args)
    # The producer's settings are checked now, before the first connection, not when the
    # relay builds its producer after claiming its first batch.
    producer_config(config.bootstrap_servers, config.kafka_config)
    relay = Relay(config)
    if args.check:
        problems = relay.check()
        relay.engine.dispose()
        for problem in problems:
            print(f"{PROG}: check failed: {problem}", file=sys.stderr)
        if problems:
            return EXIT_FAILURE
        print(f"{PROG}: check passed: table {relay.table_name} migrated, brokers answer")
        return EXIT_OK
    tune_collector()
    with stop_on_signals(relay.stop):
        server = None
        if config.metrics_port is not None:
            server = MetricsServer(
                relay.metrics,
                config.metrics_port,
                host=config.metrics_host,
                max_silence=relay_max_silence(config),
            ).start()
            log.info("event=metrics_listening host=%s port=%d", server.host, server.port)
        try:
            return EXIT_CODES[relay.run(once=args.once)]
        finally:
            if server is not None:
                server.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``outbox-relay`` console script."""
    return run(PROG, command, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
