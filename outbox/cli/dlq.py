"""``outbox dlq list|redrive|discard``: a consumer's dead letters, grouped, sent back to their
topic, or marked handled so that the listings leave them out."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from outbox._core.deadletter_reading import (
    MAX_HANDLED_BY_LENGTH,
    Group,
    Letter,
    check_group_id,
    choose_letters,
    describe_stop,
    format_cursor,
    group_letters,
    parse_cursor,
    parse_ref,
)
from outbox._core.validate import check_topic
from outbox._kafka.deadletter_reading import read_letter_page
from outbox.admin import discard, read_dead_letters, redrive
from outbox.cli._common import (
    EXIT_FAILURE,
    EXIT_OK,
    add_flags,
    add_kafka_config,
    integer,
    ranged,
    require,
)
from outbox.cli._database import command_engine
from outbox.errors import ConfigurationError

MAX_LIMIT = 1_000_000


def _when(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _shown_when(ms: int | None) -> str:
    """A time for the table: to the second, in UTC, said so."""
    return (
        "-" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    )


def _by(command: str) -> str:
    """Who marks dead letters handled: the command, the user and the host, as far as known."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "?"
    text = f"outbox dlq {command} by {user}@{socket.gethostname()}"
    return "".join(c if c.isprintable() else "?" for c in text)[:MAX_HANDLED_BY_LENGTH]


def _check_limit(args: argparse.Namespace) -> dict[int, int] | None:
    """Checks ``--limit`` and ``--topic``; the ``--from`` positions, if given."""
    ranged(1, MAX_LIMIT)("--limit", args.limit)
    check_topic(args.topic)
    if args.start is None:
        return None
    try:
        return parse_cursor(args.start)
    except ValueError as exc:
        raise ConfigurationError(f"--from {exc}") from None


def _groups(
    args: argparse.Namespace, connection: sa.Connection | None, include_handled: bool
) -> tuple[list[Group], int]:
    """The groups of ``--topic``'s page (from ``--from``, ``--limit`` letters to handle);
    without the handled letters when a database is at hand and ``include_handled`` is false.
    Returns them and how many letters were handled; says where reading stopped if it did."""
    start = _check_limit(args)
    bootstrap = require(args, "bootstrap_servers")
    if connection is None:
        page = read_letter_page(bootstrap, args.kafka_config, args.topic, args.limit, start=start)
        groups, handled, stopped = group_letters(page.letters), 0, page.stopped
    else:
        dead = read_dead_letters(
            connection,
            bootstrap,
            args.topic,
            schema=args.schema,
            kafka_config=args.kafka_config,
            limit=args.limit,
            include_handled=include_handled,
            start=start,
        )
        groups, handled, stopped = dead.groups, dead.handled, dead.stopped
    if stopped:
        # On stderr: the listing (or the JSON) on stdout stays what it was.
        print(
            f"note: {describe_stop(stopped, args.limit)}: go on with --from "
            f"{format_cursor(stopped)}",
            file=sys.stderr,
        )
    return groups, handled


def _group_json(group: Group) -> dict[str, Any]:
    return {
        "group": group.id,
        "topic": group.topic,
        "reason": group.reason,
        "error_type": group.error_type,
        "error": group.error,
        "count": group.count,
        "handled": group.handled,
        "first_seen": _when(group.first_seen_ms),
        "last_seen": _when(group.last_seen_ms),
        "messages": [letter.ref for letter in group.letters],
    }


def _cmd_list(args: argparse.Namespace) -> int:
    if args.database_url is None:
        print(
            "note: without --database-url every dead letter is listed, handled ones too",
            file=sys.stderr,
        )
        groups, handled = _groups(args, None, True)
    else:
        with command_engine(args, "outbox dlq").connect() as conn:
            groups, handled = _groups(args, conn, args.all)
            conn.rollback()
    if args.json:
        print(json.dumps([_group_json(g) for g in groups], indent=2))
        return EXIT_OK
    hidden = 0 if args.all else handled
    if not groups:
        print(
            f"no dead letters to handle in {args.topic}" + (" on this page" if args.start else "")
        )
    else:
        print(
            f"{'GROUP':12}  {'COUNT':>6}  {'HANDLED':>7}  {'REASON':16}  {'TOPIC':24}  "
            f"{'LAST SEEN (UTC)':20}  ERROR"
        )
    for g in groups:
        # The error text starts with its exception type already.
        print(
            f"{g.id:12}  {g.count:6}  {g.handled:7}  {g.reason[:16]:16}  {g.topic[:24]:24}  "
            f"{_shown_when(g.last_seen_ms):20}  {g.error}"
        )
    if hidden:
        print(f"{hidden} handled dead letter(s) hidden (--all shows them)")
    return EXIT_OK


def _selection(args: argparse.Namespace, action: str) -> tuple[set[str], set[tuple[int, int]]]:
    """The ``--group`` ids and ``--message`` refs, checked before any I/O."""
    if not args.group and not args.message:
        raise ConfigurationError(
            f"name what to {action}: --group ID (from `outbox dlq list`) and/or --message "
            "PARTITION:OFFSET (both repeatable)"
        )
    try:
        groups = {check_group_id(g) for g in args.group}
    except ValueError as exc:
        raise ConfigurationError(f"--group {exc}") from None
    refs: set[tuple[int, int]] = set()
    for ref in args.message:
        try:
            refs.add(parse_ref(ref))
        except ValueError as exc:
            raise ConfigurationError(f"--message {exc}") from None
    return groups, refs


def _report(args: argparse.Namespace, count: int, chosen: list[Letter], verb: str) -> None:
    if args.json:
        print(
            json.dumps(
                {
                    "dry_run": args.dry_run,
                    "count": count,
                    "messages": [x.ref for x in chosen],
                    "topics": sorted({x.info.topic for x in chosen if x.info is not None}),
                },
                indent=2,
            )
        )
    else:
        print(f"{count} dead letter(s) {verb}")


def _finish(missing: int) -> int:
    if missing:
        print("some groups or messages matched nothing to handle: see `outbox dlq list --all`")
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_redrive(args: argparse.Namespace) -> int:
    wanted, refs = _selection(args, "redrive")
    bootstrap = require(args, "bootstrap_servers")
    if args.database_url is None:
        groups, _ = _groups(args, None, True)
        chosen, missing = choose_letters(groups, wanted, refs)
        count = redrive(bootstrap, chosen, kafka_config=args.kafka_config, dry_run=args.dry_run)
    else:
        with command_engine(args, "outbox dlq").connect() as conn:
            groups, _ = _groups(args, conn, args.all)
            conn.rollback()  # no transaction stays open while the broker confirms
            chosen, missing = choose_letters(groups, wanted, refs)
            count = redrive(
                bootstrap,
                chosen,
                kafka_config=args.kafka_config,
                dry_run=args.dry_run,
                connection=conn,
                dlq_topic=args.topic,
                schema=args.schema,
                by=_by("redrive"),
            )
            conn.commit()
    _report(args, count, chosen, "would redrive" if args.dry_run else "redriven")
    return _finish(missing)


def _cmd_discard(args: argparse.Namespace) -> int:
    wanted, refs = _selection(args, "discard")
    with command_engine(args, "outbox dlq").connect() as conn:
        groups, _ = _groups(args, conn, False)
        conn.rollback()  # no transaction stays open while Kafka is read
        chosen, missing = choose_letters(groups, wanted, refs)
        count = discard(
            conn, args.topic, chosen, args.schema, by=_by("discard"), dry_run=args.dry_run
        )
        conn.commit()
    _report(args, count, chosen, "would discard" if args.dry_run else "discarded")
    return _finish(missing)


def register(subparsers: Any) -> None:
    """Add ``outbox dlq list|redrive|discard``."""
    dlq = subparsers.add_parser(
        "dlq",
        help="list dead letters by failure, redrive them or mark them handled",
        description="List dead letters by failure, redrive them or mark them handled. "
        "Without an ACTION: list.",
    )
    sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    database_help = {
        "list": "PostgreSQL URL, postgresql+psycopg://user:pass@host/db: leaves out the dead "
        "letters marked handled (without it every one is listed)",
        "redrive": "PostgreSQL URL, postgresql+psycopg://user:pass@host/db: marks the redriven "
        "dead letters handled once the broker confirmed them",
        "discard": "PostgreSQL URL, postgresql+psycopg://user:pass@host/db (required)",
    }
    for name, text, func in (
        ("list", "dead letters of a topic grouped by failure, with counts", _cmd_list),
        ("redrive", "send dead letters back to their original topic", _cmd_redrive),
        (
            "discard",
            "mark dead letters handled without sending them: the listings leave them out",
            _cmd_discard,
        ),
    ):
        p = sub.add_parser(name, help=text)
        add_flags(
            p,
            "bootstrap_servers",
            "database_url",
            "schema",
            "log_level",
            database_url={"help": database_help[name]},
        )
        add_kafka_config(p)
        p.add_argument("--topic", required=True, help="the dead-letter topic, e.g. orders.dlq")
        p.add_argument(
            "--limit",
            type=integer,
            default=100_000,
            help="stop reading once this many dead letters still to handle were read; handled "
            "ones do not count (100000); a listing that stopped says where to go on",
        )
        p.add_argument(
            "--from",
            dest="start",
            metavar="PARTITION:OFFSET[,...]",
            help="go on reading where a listing stopped (it names the positions); only the "
            "partitions named are read",
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name in ("list", "redrive"):
            p.add_argument(
                "--all", action="store_true", help="include the dead letters marked handled"
            )
        if name in ("redrive", "discard"):
            p.add_argument(
                "--group",
                action="append",
                default=[],
                metavar="ID",
                help="a group id from `outbox dlq list` (repeatable)",
            )
            p.add_argument(
                "--message",
                action="append",
                default=[],
                metavar="PARTITION:OFFSET",
                help="one dead letter by its place in --topic (repeatable)",
            )
            p.add_argument("--dry-run", action="store_true", help="say what would be done")
