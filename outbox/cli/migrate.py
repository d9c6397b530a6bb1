"""``outbox migrate``: create or upgrade (or downgrade) the outbox tables with alembic."""

from __future__ import annotations

import argparse
from typing import Any

from outbox import migrate
from outbox._core.environment import ENV_MIGRATE_LOCK_ATTEMPTS, ENV_MIGRATE_LOCK_TIMEOUT
from outbox.cli._common import EXIT_OK, Flag, add_flags, integer, number, ranged, require
from outbox.cli._database import command_engine
from outbox.config import redact_url
from outbox.errors import ConfigurationError


def _lock_timeout(name: str, value: object) -> object:
    try:
        return migrate.check_lock_timeout(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}: {exc}") from None


LOCK_TIMEOUT = Flag(
    "--lock-timeout",
    ENV_MIGRATE_LOCK_TIMEOUT,
    "seconds a revision waits for a table lock before it lets the writers queued behind it "
    "through and tries again",
    type=number,
    kind="a number",
    metavar="SECONDS",
    default=migrate.DEFAULT_LOCK_TIMEOUT,
    check=_lock_timeout,
)
LOCK_ATTEMPTS = Flag(
    "--lock-attempts",
    ENV_MIGRATE_LOCK_ATTEMPTS,
    "how often a revision is tried (with a growing pause between) before the command fails "
    "naming the session that holds the lock",
    type=integer,
    kind="an integer",
    metavar="N",
    default=migrate.DEFAULT_LOCK_ATTEMPTS,
    check=ranged(1, migrate.MAX_LOCK_ATTEMPTS),
)


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (alembic)",
        description="Create or upgrade the outbox tables to REVISION (default: head). "
        "Each revision runs in a transaction of its own whose statements wait at most "
        "--lock-timeout for a lock. Exit codes: 0 done, 1 database error (or a lock still "
        "held after --lock-attempts), 2 bad usage.",
    )
    add_flags(p, "database_url", "schema", "log_level", LOCK_TIMEOUT, LOCK_ATTEMPTS)
    p.add_argument("--revision", default="head", help="target revision (default: head)")
    p.add_argument(
        "--downgrade",
        dest="revision_down",
        metavar="REVISION",
        help="migrate down to REVISION instead ('base' removes every table)",
    )
    p.set_defaults(func=command)


def _revision(args: argparse.Namespace) -> str | None:
    engine = command_engine(args, "outbox migrate")
    try:
        with engine.connect() as conn:
            return migrate.current_revision(conn, args.schema)
    finally:
        engine.dispose()


def command(args: argparse.Namespace) -> int:
    url = require(args, "database_url")
    migrate.check_revision(args.revision_down or args.revision)
    before = _revision(args)
    limits = {"lock_timeout": args.lock_timeout, "lock_attempts": args.lock_attempts}
    if args.revision_down:
        migrate.downgrade(url, args.revision_down, schema=args.schema, **limits)
    else:
        migrate.upgrade(url, args.revision, schema=args.schema, **limits)
    after = _revision(args)
    where = redact_url(url) + (f" (schema {args.schema})" if args.schema else "")
    if before == after:
        print(f"{where} is already at revision {after or 'base'}: nothing to do")
    else:
        verb = "downgraded" if args.revision_down else "migrated"
        print(f"{verb} {where} from revision {before or 'base'} to {after or 'base'}")
    return EXIT_OK
