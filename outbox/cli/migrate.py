"""``outbox migrate``: create or upgrade (or downgrade) the outbox tables with alembic."""

from __future__ import annotations

import argparse
from typing import Any

from outbox import migrate
from outbox.cli._common import EXIT_OK, add_flags, require
from outbox.cli._database import command_engine
from outbox.config import redact_url


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "migrate",
        help="create or upgrade the outbox tables (alembic)",
        description="Create or upgrade the outbox tables to REVISION (default: head). "
        "Exit codes: 0 done, 1 database error, 2 bad usage.",
    )
    add_flags(p, "database_url", "schema", "log_level")
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
    if args.revision_down:
        migrate.downgrade(url, args.revision_down, schema=args.schema)
    else:
        migrate.upgrade(url, args.revision, schema=args.schema)
    after = _revision(args)
    where = redact_url(url) + (f" (schema {args.schema})" if args.schema else "")
    if before == after:
        print(f"{where} is already at revision {after or 'base'}: nothing to do")
    else:
        verb = "downgraded" if args.revision_down else "migrated"
        print(f"{verb} {where} from revision {before or 'base'} to {after or 'base'}")
    return EXIT_OK
