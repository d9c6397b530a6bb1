"""``outbox dlq list|redrive``: a consumer's dead letters, grouped, and sent back to their topic."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from outbox._core.dlq import Group, Letter, group_letters, parse_ref
from outbox._core.validate import check_topic
from outbox._kafka.dlq import read_letters
from outbox.admin import redrive
from outbox.cli._common import (
    EXIT_FAILURE,
    EXIT_OK,
    add_flags,
    add_kafka_config,
    integer,
    ranged,
    require,
)
from outbox.errors import ConfigurationError

MAX_LIMIT = 1_000_000


def _when(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _read(args: argparse.Namespace) -> list[Letter]:
    ranged(1, MAX_LIMIT)("--limit", args.limit)
    check_topic(args.topic)
    return read_letters(
        require(args, "bootstrap_servers"), args.kafka_config, args.topic, args.limit
    )


def _group_json(group: Group) -> dict[str, Any]:
    return {
        "group": group.id,
        "topic": group.topic,
        "reason": group.reason,
        "error_type": group.error_type,
        "error": group.error,
        "count": group.count,
        "first_seen": _when(group.first_seen_ms),
        "last_seen": _when(group.last_seen_ms),
        "messages": [letter.ref for letter in group.letters],
    }


def _cmd_list(args: argparse.Namespace) -> int:
    groups = group_letters(_read(args))
    if args.json:
        print(json.dumps([_group_json(g) for g in groups], indent=2))
        return EXIT_OK
    if not groups:
        print(f"no dead letters in {args.topic}")
        return EXIT_OK
    print(f"{'GROUP':12}  {'COUNT':>6}  {'TOPIC':24}  {'LAST SEEN':25}  ERROR")
    for g in groups:
        last = _when(g.last_seen_ms) or "-"
        print(
            f"{g.id:12}  {g.count:6}  {g.topic[:24]:24}  {last[:25]:25}  {g.error_type}: {g.error}"
        )
    return EXIT_OK


def _cmd_redrive(args: argparse.Namespace) -> int:
    if bool(args.group) == bool(args.message):
        raise ConfigurationError(
            "name what to redrive: --group ID (from `outbox dlq list`) or --message "
            "PARTITION:OFFSET (repeatable), not both"
        )
    wanted: set[tuple[int, int]] = set()
    for ref in args.message:
        try:
            wanted.add(parse_ref(ref))
        except ValueError as exc:
            raise ConfigurationError(f"--message {exc}") from None
    letters = _read(args)
    if args.group:
        chosen = [x for g in group_letters(letters) if g.id in args.group for x in g.letters]
    else:
        chosen = [x for x in letters if (x.partition, x.offset) in wanted]
    count = redrive(
        args.bootstrap_servers, chosen, kafka_config=args.kafka_config, dry_run=args.dry_run
    )
    verb = "would redrive" if args.dry_run else "redriven"
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
    missing = len(wanted) - len(chosen) if not args.group else 0
    if (args.group and not chosen) or missing > 0:
        print("some groups or messages matched nothing: see `outbox dlq list`")
        return EXIT_FAILURE
    return EXIT_OK


def register(subparsers: Any) -> None:
    """Add ``outbox dlq list|redrive``."""
    dlq = subparsers.add_parser("dlq", help="list dead letters by failure, redrive them")
    sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    for name, text, func in (
        ("list", "dead letters of a topic grouped by failure, with counts", _cmd_list),
        ("redrive", "send dead letters back to their original topic", _cmd_redrive),
    ):
        p = sub.add_parser(name, help=text)
        add_flags(p, "bootstrap_servers", "log_level")
        add_kafka_config(p)
        p.add_argument("--topic", required=True, help="the dead-letter topic, e.g. orders.dlq")
        p.add_argument(
            "--limit", type=integer, default=100_000, help="read at most this many (100000)"
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        if name == "redrive":
            p.add_argument("--group", action="append", default=[], metavar="ID")
            p.add_argument("--message", action="append", default=[], metavar="PARTITION:OFFSET")
            p.add_argument("--dry-run", action="store_true", help="say what would be sent")
