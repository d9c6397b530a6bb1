"""Parked rows: outbox rows the relay gave up on, and ``outbox parked list|retry|discard``.

A row is parked after a permanent Kafka error (record too large, invalid or unknown topic,
authorization refused) or after ``--max-attempts`` failed deliveries. It stays in the outbox
with its error and attempt count, and every later row of its key waits behind it (per-key
order). ``retry`` puts it back in line with a fresh attempt count; ``discard`` deletes it, which
lets the rows behind it flow.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError
from outbox.schema import tables


@dataclass(frozen=True)
class ParkedRow:
    """A parked outbox row as an operator sees it."""

    id: int
    event_id: uuid.UUID
    topic: str
    key: bytes | None
    attempts: int
    error: str | None
    parked_at: datetime
    created_at: datetime

    def key_text(self) -> str:
        """The key as text when it is UTF-8, else as a bytes literal; ``-`` when absent."""
        if self.key is None:
            return "-"
        try:
            return self.key.decode("utf-8")
        except UnicodeDecodeError:
            return repr(self.key)


def _selection(
    table: sa.Table, event_ids: Sequence[uuid.UUID] | None, topic: str | None
) -> list[sa.ColumnElement[bool]]:
    where: list[sa.ColumnElement[bool]] = [table.c.parked_at.is_not(None)]
    if event_ids:
        where.append(table.c.event_id.in_(list(event_ids)))
    if topic is not None:
        where.append(table.c.topic == topic)
    return where


def list_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    topic: str | None = None,
    limit: int = 100,
) -> list[ParkedRow]:
    """Parked rows, oldest first (at most ``limit``)."""
    t = tables(schema).outbox
    query = (
        sa.select(
            t.c.id, t.c.event_id, t.c.topic, t.c.key, t.c.attempts, t.c.last_error,
            t.c.parked_at, t.c.created_at,
        )
        .where(*_selection(t, None, topic))
        .order_by(t.c.id)
        .limit(limit)
    )  # fmt: skip
    return [ParkedRow(*row) for row in connection.execute(query)]


def retry_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    event_ids: Sequence[uuid.UUID] | None = None,
    topic: str | None = None,
) -> int:
    """Put parked rows back in line with a fresh attempt count; returns how many.

    Without ``event_ids`` every parked row (of ``topic``, if given) is retried. The caller
    commits.
    """
    t = tables(schema).outbox
    result = connection.execute(
        sa.update(t).where(*_selection(t, event_ids, topic)).values(parked_at=None, attempts=0)
    )
    return int(result.rowcount)


def discard_parked(
    connection: sa.Connection,
    schema: str | None = None,
    *,
    event_ids: Sequence[uuid.UUID] | None = None,
    topic: str | None = None,
) -> int:
    """Delete parked rows (they are never sent); returns how many. The caller commits."""
    t = tables(schema).outbox
    result = connection.execute(sa.delete(t).where(*_selection(t, event_ids, topic)))
    return int(result.rowcount)


# --------------------------------------------------------------------------------------------
# CLI: outbox parked list|retry|discard
# --------------------------------------------------------------------------------------------


def _engine(args: argparse.Namespace) -> sa.Engine:
    from outbox.cli_old import require
    from outbox.config import ENV_DATABASE_URL

    url = normalize_database_url(require(args.database_url, "--database-url", ENV_DATABASE_URL))
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def _event_ids(values: Sequence[str]) -> list[uuid.UUID]:
    ids: list[uuid.UUID] = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError as exc:
            raise ConfigurationError(
                f"--event-id {value!r} is not a UUID: copy it from `outbox parked list`"
            ) from exc
    return ids


def _cmd_list(args: argparse.Namespace) -> int:
    engine = _engine(args)
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
        return 0
    if not rows:
        print("no parked rows")
        return 0
    print(f"{'EVENT ID':36}  {'TOPIC':24}  {'KEY':20}  ATTEMPTS  PARKED AT                  ERROR")
    for r in rows:
        print(
            f"{r.event_id!s:36}  {r.topic[:24]:24}  {r.key_text()[:20]:20}  {r.attempts:8}  "
            f"{r.parked_at.isoformat(timespec='seconds'):25}  {r.error or ''}"
        )
    return 0


def _cmd_change(args: argparse.Namespace) -> int:
    if not args.event_id and not args.all:
        raise ConfigurationError(
            f"name the rows to {args.action}: --event-id ID (repeatable) or --all "
            "(optionally with --topic)"
        )
    if args.event_id and args.all:
        raise ConfigurationError("use either --event-id or --all, not both")
    ids = _event_ids(args.event_id)
    action = retry_parked if args.action == "retry" else discard_parked
    engine = _engine(args)
    try:
        with engine.begin() as conn:
            count = action(conn, args.schema, event_ids=ids or None, topic=args.topic)
    finally:
        engine.dispose()
    verb = "back in line" if args.action == "retry" else "discarded"
    print(f"{count} parked row{'s' if count != 1 else ''} {verb}")
    if ids and count < len(ids):
        print(f"{len(ids) - count} event id(s) matched no parked row")
        return 1
    return 0


def register_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``outbox parked list|retry|discard``."""
    from outbox.cli_old import add_database_url, add_log_level

    parked = subparsers.add_parser("parked", help="show and manage rows the relay parked")
    sub = parked.add_subparsers(dest="parked_command", required=True, metavar="ACTION")

    p = sub.add_parser("list", help="parked rows with event id, topic, key and error")
    add_database_url(p)
    add_log_level(p)
    p.add_argument("--topic", help="only rows of this topic")
    p.add_argument("--limit", type=int, default=100, help="at most this many rows (default 100)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_list)

    for action, text in (
        ("retry", "put parked rows back in line (attempts reset to 0)"),
        ("discard", "delete parked rows for good; later rows of their keys then flow"),
    ):
        p = sub.add_parser(action, help=text)
        add_database_url(p)
        add_log_level(p)
        p.add_argument("--event-id", action="append", default=[], metavar="ID", help="repeatable")
        p.add_argument("--all", action="store_true", help="every parked row (see --topic)")
        p.add_argument("--topic", help="only rows of this topic")
        p.set_defaults(func=_cmd_change, action=action)
