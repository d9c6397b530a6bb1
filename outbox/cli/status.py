"""``outbox status``: a read-only report of the outbox, the idempotency keys and the relays."""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox import admin
from outbox._core.environment import ENV_RELAY_LANES
from outbox._core.lanes import DEFAULT_LANES, MAX_LANES
from outbox.cli._common import EXIT_OK, add_flags, integer, ranged, resolve_flags
from outbox.cli._database import command_engine
from outbox.cli._fleet_flags import FLEET_FLAGS
from outbox.config import env, env_int
from outbox.errors import ConfigurationError


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="backlog per topic and lane, parked rows, keys by status, live relays",
        description="Read-only report of the outbox, idempotency keys and live relays. "
        "Exit codes: 0 report printed, 1 database error or tables missing, 2 bad usage.",
    )
    add_flags(p, "database_url", "schema", "log_level")
    # Many databases (a relay fleet's): the relay's own sources, the unhealthy ones first.
    add_flags(p, *FLEET_FLAGS[:3])
    # Not from the table: status reads OUTBOX_RELAY_LANES itself, to tell the operator where
    # the lane count came from (flag, variable, live relays or default).
    p.add_argument(
        "--lanes",
        type=integer,
        default=None,
        help=f"lane count to split the backlog by (env {ENV_RELAY_LANES}, the relay's; "
        f"default: what live relays use, else {DEFAULT_LANES})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (format 1)")
    p.set_defaults(func=command)


def fleet_command(args: argparse.Namespace) -> int:
    if (args.discover_url is None) != (args.discover_pattern is None):
        raise ConfigurationError("--discover-url and --discover-pattern go together")
    urls = admin.fleet_urls(
        [args.database_url] if args.database_url else [],
        args.databases_file,
        args.discover_url,
        args.discover_pattern,
    )
    statuses = admin.read_fleet_status(urls, args.schema)
    if args.json:
        print(json.dumps(admin.fleet_status_to_json(statuses), indent=2))
    else:
        print(admin.render_fleet_status(statuses))
    return EXIT_OK


def command(args: argparse.Namespace) -> int:
    resolve_flags(args)
    if args.databases_file or args.discover_url or args.discover_pattern:
        return fleet_command(args)
    lanes_env = env(ENV_RELAY_LANES)
    # Checked here, before the database is opened (read_status decides between them).
    if args.lanes is not None:
        ranged(1, MAX_LANES)("--lanes", args.lanes)
    elif lanes_env is not None:
        ranged(1, MAX_LANES)(ENV_RELAY_LANES, env_int(ENV_RELAY_LANES, None))
    engine = command_engine(args, "outbox status")
    try:
        # One snapshot, read-only: every number in the report is from the same moment.
        with engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn:
            status = admin.read_status(
                conn, args.schema, lanes_flag=args.lanes, lanes_env=lanes_env
            )
            conn.rollback()
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(admin.status_to_json(status, args.database_url), indent=2))
    else:
        print(admin.render_status(status, args.database_url))
    return EXIT_OK
