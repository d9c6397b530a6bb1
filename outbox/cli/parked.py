"""``outbox parked list|retry|discard``: show and manage rows the relay parked."""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Sequence
from typing import Any

from outbox._core.validate import check_topic, shown
from outbox.admin import discard_parked, list_parked, retry_parked
from outbox.cli._common import EXIT_FAILURE, EXIT_OK, add_flags, integer, ranged
from outbox.cli._database import command_engine
from outbox.errors import ConfigurationError


def _event_ids(values: Sequence[str]) -> list[uuid.UUID]:
    ids: list[uuid.UUID] = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            raise ConfigurationError(
                f"--event-id {shown(value)} is not a UUID: copy it from `outbox parked list`"
            ) from None
    return ids


MAX_LIMIT = 100_000


def _check_topic(args: argparse.Namespace) -> None:
    if args.topic is not None:
        check_topic(args.topic)


def _cmd_list(args: argparse.Namespace) -> int:
    ranged(1, MAX_LIMIT)("--limit", args.limit)
    _check_topic(args)
    engine = command_engine(args)
    try:
        with engine.connect() as conn:
            rows = list_parked(conn, args.schema, topic=args.topic, limit=args.limit)
    finally:
        engine.dispose()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "id": r.id,
                        "event_id": str(r.event_id),
                        "topic": r.topic,
                        "key": r.key_text() if r.key is not None else None,
                        "attempts": r.attempts,
                        "error": r.error,
                        "parked_at": r.parked_at.isoformat(),
                        "created_at": r.created_at.isoformat(),
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return EXIT_OK
    if not rows:
        print("no parked rows")
        return EXIT_OK
    print(f"{'EVENT ID':36}  {'TOPIC':24}  {'KEY':20}  ATTEMPTS  PARKED AT                  ERROR")
    for r in rows:
        print(
            f"{r.event_id!s:36}  {r.topic[:24]:24}  {r.key_text()[:20]:20}  {r.attempts:8}  "
            f"{r.parked_at.isoformat(timespec='seconds'):25}  {r.error or ''}"
        )
    return EXIT_OK


def _cmd_change(args: argparse.Namespace) -> int:
    if not args.event_id and not args.all:
        raise ConfigurationError(
            f"name the rows to {args.action}: --event-id ID (repeatable) or --all "
            "(optionally with --topic)"
        )
    if args.event_id and args.all:
        raise ConfigurationError("use either --event-id or --all, not both")
    ids = _event_ids(args.event_id)
    _check_topic(args)
    action = retry_parked if args.action == "retry" else discard_parked
    engine = command_engine(args)
    try:
        with engine.begin() as conn:
            count = action(conn, args.schema, event_ids=ids or None, topic=args.topic)
    finally:
        engine.dispose()
    verb = "back in line" if args.action == "retry" else "discarded"
    print(f"{count} parked row{'s' if count != 1 else ''} {verb}")
    if ids and count < len(ids):
        print(f"{len(ids) - count} event id(s) matched no parked row")
        return EXIT_FAILURE
    return EXIT_OK


def register(subparsers: Any) -> None:
    """Add ``outbox parked list|retry|discard``."""
    parked = subparsers.add_parser(
        "parked",
        help="show and manage rows the relay parked",
        description="Show and manage rows the relay parked. Without an ACTION: list.",
    )
    sub = parked.add_subparsers(dest="parked_command", required=True, metavar="ACTION")

    p = sub.add_parser("list", help="parked rows with event id, topic, key and error")
    add_flags(p, "database_url", "schema", "log_level")
    p.add_argument("--topic", help="only rows of this topic")
    p.add_argument(
        "--limit", type=integer, default=100, help="at most this many rows (default 100)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_list)

    for action, text in (
        ("retry", "put parked rows back in line (attempts reset to 0)"),
        ("discard", "delete parked rows for good; later rows of their keys then flow"),
    ):
        p = sub.add_parser(action, help=text)
        add_flags(p, "database_url", "schema", "log_level")
        p.add_argument("--event-id", action="append", default=[], metavar="ID", help="repeatable")
        p.add_argument("--all", action="store_true", help="every parked row (see --topic)")
        p.add_argument("--topic", help="only rows of this topic")
        p.set_defaults(func=_cmd_change, action=action)
