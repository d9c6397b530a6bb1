"""``outbox console``: serve the web console (docs/console.md) with uvicorn.

Needs the ``outbox-kit[console]`` extra (Starlette, Jinja2, uvicorn); the error says so when it
is missing. Binds 127.0.0.1 unless told otherwise, and is read-only unless given an admin token.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from outbox._core import settings as _settings
from outbox.cli._common import (
    EXIT_OK,
    Flag,
    add_flags,
    add_kafka_config,
    integer,
    number,
    ranged,
    require,
)
from outbox.cli._fleet_flags import FLEET_FLAGS
from outbox.errors import ConfigurationError

# This module is imported only when `outbox console` runs; without the console extra the
# command says what to install instead of failing on import.
try:
    import uvicorn

    from outbox.console.app import ConsoleConfig, create_app
    from outbox.console.fleet import FleetSources, create_fleet_app
except ImportError as exc:
    _MISSING: str | None = exc.name or "starlette"
else:
    _MISSING = None

ENV_CONSOLE_HOST = "OUTBOX_CONSOLE_HOST"
ENV_CONSOLE_PORT = "OUTBOX_CONSOLE_PORT"
ENV_CONSOLE_ADMIN_TOKEN = "OUTBOX_CONSOLE_ADMIN_TOKEN"
ENV_CONSOLE_DLQ_LIMIT = "OUTBOX_CONSOLE_DLQ_LIMIT"
ENV_CONSOLE_COUNT_BUDGET = "OUTBOX_CONSOLE_COUNT_BUDGET"

HOST = Flag(
    "--host",
    ENV_CONSOLE_HOST,
    "the address the console listens on; keep 127.0.0.1 and put a proxy with authentication "
    "in front to reach it from elsewhere",
    default="127.0.0.1",
    check=_settings.check_host,
)
PORT = Flag(
    "--port",
    ENV_CONSOLE_PORT,
    "the console's port",
    type=integer,
    kind="an integer",
    default=8080,
    check=ranged(1, _settings.MAX_PORT),
)
ADMIN_TOKEN = Flag(
    "--admin-token",
    ENV_CONSOLE_ADMIN_TOKEN,
    "allow retry and discard to requests carrying this token (HTTP bearer, or basic with it "
    "as password); without it the console is read-only",
    secret=True,
)

DLQ_LIMIT = Flag(
    "--dlq-limit",
    ENV_CONSOLE_DLQ_LIMIT,
    "dead letters still to handle per page of the dead-letters page (handled ones do not "
    "count); a page that stopped links to the next",
    type=integer,
    kind="an integer",
    default=100_000,
    check=ranged(1, 1_000_000),
)

COUNT_BUDGET = Flag(
    "--count-budget",
    ENV_CONSOLE_COUNT_BUDGET,
    "seconds the overview may spend counting the pending rows (a scan of the outbox); a "
    "count that took longer is shown with the time it was made, and the next ones run in the "
    "background (0: always, after the first)",
    type=number,
    kind="a number",
    default=0.05,
    check=lambda name, value: _settings.check_seconds(name, value, 60.0, zero=True),
)


def register(subparsers: Any) -> None:
    """Add ``outbox console``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "console",
        help="serve the web console: backlog, relays, parked events, dead letters, keys",
        description="A web console for the people on call. Read-only unless --admin-token is "
        "set and a request carries it. Needs outbox-kit[console].",
    )
    add_flags(
        p, "database_url", "schema", "bootstrap_servers", "redis_url", "log_level",
        HOST, PORT, ADMIN_TOKEN, DLQ_LIMIT, COUNT_BUDGET,
    )  # fmt: skip
    # Many databases (a relay fleet's): a page of them all, each one's console beside it.
    add_flags(p, *FLEET_FLAGS[:3])
    add_kafka_config(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    if _MISSING is not None:
        raise ConfigurationError(
            f"outbox console needs the console extra ({_MISSING} is missing): "
            "pip install 'outbox-kit[console]'"
        )
    fleet = bool(args.databases_file or args.discover_url or args.discover_pattern)
    settings = ConsoleConfig(
        # A fleet's databases each have their own URL; this one is only the template's.
        database_url=(args.database_url or args.discover_url or "postgresql://localhost/")
        if fleet
        else require(args, "database_url"),
        schema=args.schema,
        bootstrap_servers=args.bootstrap_servers,
        redis_url=args.redis_url,
        admin_token=args.admin_token or None,
        kafka_config=args.kafka_config,
        dead_letters_limit=args.dlq_limit,
        count_budget=args.count_budget,
    ).validate()
    if fleet:
        sources = FleetSources(
            [args.database_url] if args.database_url else [],
            args.databases_file,
            args.discover_url,
            args.discover_pattern,
        ).validate()
        app = create_fleet_app(sources, settings)
    else:
        app = create_app(settings)
    mode = "admin token set" if settings.admin_token else "read-only"
    logging.getLogger("outbox.console").info(
        "outbox console on http://%s:%d/ (%s)", args.host, args.port, mode
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=args.log_level == "DEBUG",
        server_header=False,
        log_config=None,
    )
    return EXIT_OK
