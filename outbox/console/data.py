"""What the console's pages show, without the web framework, and the admin actions.

Invariant: a filter or an id an operator typed is checked here, before any I/O, and refused with
a :class:`~outbox.errors.ValidationError` that says what is wrong; the pages turn it into a 400.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from markupsafe import Markup, escape

from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._core.deadletter_reading import Group, check_group_id, parse_cursor
from outbox._core.redact import HIDDEN, is_secret_setting
from outbox._core.validate import MAX_SCOPE_LENGTH, check_scope, check_topic, shown
from outbox._pg import console as sql
from outbox._pg.console import ParkedFilter
from outbox.errors import ValidationError
from outbox.schema import validate_schema_name

PAGE_SIZE = 50
MAX_OFFSET = 10_000_000
MAX_FILTER_LENGTH = 1000
MAX_SELECTION = 1000
# How much of a value a page shows; the size is always stated.
VALUE_SHOWN = 4096
HEX_SHOWN = 1024
KEY_EVENTS_SHOWN = 50

__all__ = ["PAGE_SIZE", "ParkedFilter", "ParkedView", "parse_filter", "warning_html"]

# The commands a status warning names that have a page of their own on the console.
_COMMAND_PAGES = {"outbox parked list": ("/parked", "the Parked page")}
_BACKTICKED = re.compile(r"`([^`]+)`")


def warning_html(text: str) -> Markup:
    """A status warning for a page: a command with a page of its own becomes a link to that
    page, another backticked command is set as code (the CLI writes backticks as plain text)."""

    parts = _BACKTICKED.split(text)  # even: prose, odd: what stood between backticks
    html = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            html.append(str(escape(part)))
        elif part in _COMMAND_PAGES:
            href, label = _COMMAND_PAGES[part]
            html.append(f'<a href="{href}">{escape(label)}</a>')
        else:
            html.append(f"<code>{escape(part)}</code>")
    return Markup("".join(html))


# The overview's pending counts (a scan of the outbox): counted in the request while that is
# quick, else in the background at most every RECOUNT_MIN_SECONDS and never more than
# 1/RECOUNT_FACTOR of the time.
DEFAULT_COUNT_BUDGET = 0.05
RECOUNT_MIN_SECONDS = 5.0
RECOUNT_FACTOR = 10.0


def pending_count_plan(
    last_lanes: int | None,
    lanes: int,
    last_took: float,
    last_age: float,
    budget: float,
    counting: bool,
) -> tuple[bool, bool]:
    """``(count now, count in the background)`` for an overview: count in the request when
    there is no earlier count for ``lanes`` or the last one took at most ``budget`` seconds;
    otherwise show the last count (``last_age`` seconds old, ``last_took`` seconds long) and
    start another in the background when it is due and none is ``counting``."""
    if last_lanes != lanes or last_took <= budget:
        return True, False
    due = last_age >= max(RECOUNT_MIN_SECONDS, RECOUNT_FACTOR * last_took)
    return False, due and not counting


def _text(name: str, value: str | None) -> str | None:
    if value is None or value == "":
        return None
    if len(value) > MAX_FILTER_LENGTH:
        raise ValidationError(
            f"{name} is {len(value)} characters long: at most {MAX_FILTER_LENGTH}"
        )
    if "\x00" in value:
        raise ValidationError(f"{name} holds a NUL character: PostgreSQL text cannot hold one")
    return value


def parse_filter(params: Mapping[str, str]) -> ParkedFilter:
    """The parked-row filter of a query string or form: ``topic``, ``key``, ``error``."""
    topic = _text("topic", params.get("topic"))
    if topic is not None:
        check_topic(topic)
    key = _text("key", params.get("key"))
    error = _text("error", params.get("error"))
    return ParkedFilter(topic=topic, key=None if key is None else key.encode("utf-8"), error=error)


def filter_params(where: ParkedFilter) -> dict[str, str]:
    """The filter as query parameters (for links and hidden form fields)."""
    out: dict[str, str] = {}
    if where.topic is not None:
        out["topic"] = where.topic
    if where.key is not None:
        out["key"] = where.key.decode("utf-8", "replace")
    if where.error is not None:
        out["error"] = where.error
    return out


def describe_filter(where: ParkedFilter) -> str:
    """The filter in words, for confirmations and the admin log."""
    parts = [f"{k}={v!r}" for k, v in filter_params(where).items()]
    return "all topics, keys and errors" if not parts else "with " + ", ".join(parts)


def parse_offset(value: str | None) -> int:
    """A page offset: a whole number from 0."""
    if value is None or value == "":
        return 0
    try:
        offset = int(value)
    except ValueError:
        raise ValidationError(f"offset {shown(value)} is not a whole number") from None
    if not 0 <= offset <= MAX_OFFSET:
        raise ValidationError(f"offset {offset} is out of range 0..{MAX_OFFSET}")
    return offset


def parse_event_ids(values: Sequence[str]) -> list[uuid.UUID]:
    """Event ids from a form's checkboxes; each must be a UUID."""
    if len(values) > MAX_SELECTION:
        raise ValidationError(f"{len(values)} rows selected: at most {MAX_SELECTION} at once")
    ids: list[uuid.UUID] = []
    for value in values:
        try:
            ids.append(uuid.UUID(value))
        except ValueError:
            raise ValidationError(
                f"event id {shown(value)} is not a UUID: pick rows from the parked page"
            ) from None
    return ids


def parse_group_ids(values: Sequence[str]) -> list[str]:
    """Dead-letter group ids from a form (a button's or the ticked checkboxes); each must be
    one the dead-letters page shows (12 hex digits)."""
    if not values:
        raise ValidationError("no group chosen: pick one on the dead-letters page")
    if len(values) > MAX_SELECTION:
        raise ValidationError(f"{len(values)} groups chosen: at most {MAX_SELECTION} at once")
    try:
        return sorted({check_group_id(value) for value in values})
    except ValueError as exc:
        raise ValidationError(f"group {exc}") from None


_DONE = re.compile(
    r"\d{1,9} (row\(s\) put back in line|row\(s\) discarded|"
    r"dead letter\(s\) (redriven|marked handled))"
)


def done_message(value: str | None) -> str | None:
    """The outcome an action's redirect carries, shown only when it is one the console wrote
    (a crafted link cannot put other words on the page)."""
    return value if value is not None and _DONE.fullmatch(value) else None


def parse_key_lookup(params: Mapping[str, str]) -> tuple[str, str] | None:
    """``(scope, key)`` of the keys page, ``None`` when the form is empty."""
    scope = params.get("scope") or ""
    key = params.get("key") or ""
    if not scope and not key:
        return None
    if not scope or not key:
        raise ValidationError("give both the scope and the key")
    check_scope(scope[: MAX_SCOPE_LENGTH + 1])
    if _text("key", key) is None:  # pragma: no cover - key is not empty here
        raise ValidationError("give the key")
    return scope, key


MAX_DEAD_LETTERS = 100_000


def parse_dlq_cursor(value: str | None) -> dict[int, int] | None:
    """Where a page of dead letters starts (the ``from`` of a next-page link), ``None`` for
    the topic's beginning."""
    if not value:
        return None
    try:
        return parse_cursor(value)
    except ValueError as exc:
        raise ValidationError(f"from: {exc}") from None


def check_dlq_topic(topic: str) -> str:
    """A dead-letter topic name from a form or query string."""
    if len(topic) > MAX_FILTER_LENGTH:
        raise ValidationError(f"topic is {len(topic)} characters long: at most 249")
    return check_topic(topic)


@dataclass(frozen=True)
class GroupView:
    """A group of dead letters on the page, with one example."""

    id: str
    topic: str
    reason: str
    error_type: str
    error: str
    count: int
    first_seen: datetime | None
    last_seen: datetime | None
    example_ref: str
    example_key: str
    example_error: str
    example_value: Shown
    example_headers: list[tuple[str, str]]


def _stamp(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC)


def group_view(group: Group) -> GroupView:
    first = group.letters[0]
    return GroupView(
        id=group.id,
        topic=group.topic,
        reason=group.reason,
        error_type=group.error_type,
        error=group.error,
        count=group.count,
        first_seen=_stamp(group.first_seen_ms),
        last_seen=_stamp(group.last_seen_ms),
        example_ref=first.ref,
        example_key=key_text(first.key),
        example_error=first.info.error if first.info is not None else "",
        example_value=show_bytes(first.value),
        example_headers=[
            (n, HIDDEN if _secret_header(n) else show_bytes(v, limit=512).text)
            for n, v in first.headers[:40]
        ],
    )


# -- display ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """A byte string as a page shows it: ``kind`` is json, text, hex or null."""

    kind: str
    text: str
    size: int
    cut: bool


def show_bytes(data: bytes | None, size: int | None = None, limit: int = VALUE_SHOWN) -> Shown:
    """JSON pretty-printed, UTF-8 as text, anything else as hex; at most ``limit`` bytes."""
    if data is None:
        return Shown("null", "", 0, False)
    size = len(data) if size is None else size
    cut = size > len(data) or len(data) > limit
    head = data[:limit]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        hexed = head[:HEX_SHOWN].hex(" ")
        return Shown("hex", hexed, size, cut or size > HEX_SHOWN)
    if not cut:
        try:
            return Shown(
                "json", json.dumps(json.loads(text), indent=2, ensure_ascii=False), size, cut
            )
        except ValueError:
            pass
    return Shown("text", text, size, cut)


def _secret_header(name: str) -> bool:
    return is_secret_setting(name) or name.lower() in ("authorization", "cookie")


def show_headers(stored: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """Stored headers as ``(name, shown value)``; a value whose name says secret is hidden."""
    out: list[tuple[str, str]] = []
    for name, value in (stored or {}).items():
        if _secret_header(name):
            out.append((name, HIDDEN))
            continue
        if isinstance(value, dict) and "base64" in value:
            try:
                raw = base64.b64decode(value["base64"], validate=True)
            except (binascii.Error, TypeError, ValueError):
                out.append((name, str(value)))
                continue
            out.append((name, show_bytes(raw, limit=512).text))
        else:
            out.append((name, str(value)))
    return out


def key_text(key: bytes | None) -> str:
    if key is None:
        return "-"
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + key.hex()


@dataclass(frozen=True)
class ParkedView:
    """A parked row on the page."""

    event_id: uuid.UUID
    topic: str
    key: str
    attempts: int
    error: str
    parked_at: datetime
    created_at: datetime
    headers: list[tuple[str, str]]
    value: Shown


def _parked_view(row: Any) -> ParkedView:
    return ParkedView(
        event_id=row.event_id,
        topic=row.topic,
        key=key_text(row.key),
        attempts=row.attempts,
        error=row.last_error or "",
        parked_at=row.parked_at,
        created_at=row.created_at,
        headers=show_headers(row.headers),
        value=show_bytes(None if row.value_head is None else bytes(row.value_head), row.value_size),
    )


def search_parked(
    connection: sa.Connection, schema: str | None, where: ParkedFilter, offset: int
) -> tuple[list[ParkedView], int]:
    """One page of parked rows matching ``where`` and how many match in all."""
    schema = validate_schema_name(schema)
    rows = sql.parked_search(connection, schema, where, PAGE_SIZE, offset)
    return [_parked_view(r) for r in rows], sql.parked_count(connection, schema, where)


def count_parked(
    connection: sa.Connection,
    schema: str | None,
    where: ParkedFilter,
    event_ids: Sequence[uuid.UUID] | None,
) -> int:
    """How many parked rows an action on ``where`` (and ``event_ids``) would touch."""
    return sql.parked_count(connection, validate_schema_name(schema), where, event_ids)


def change_parked(
    connection: sa.Connection,
    schema: str | None,
    action: str,
    where: ParkedFilter,
    event_ids: Sequence[uuid.UUID] | None,
) -> int:
    """Retry or discard the parked rows of ``where`` (and ``event_ids``); the caller commits."""
    schema = validate_schema_name(schema)
    if action == "retry":
        return sql.parked_retry(connection, schema, where, event_ids)
    if action == "discard":
        return sql.parked_discard(connection, schema, where, event_ids)
    raise ValidationError(f"unknown action {shown(action)}: retry or discard")


@dataclass(frozen=True)
class KeyView:
    scope: str
    key: str
    status: str
    fingerprint: str | None
    result: str | None
    error: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class KeyEvent:
    event_id: uuid.UUID
    topic: str
    key: str
    attempts: int
    error: str
    parked: bool
    created_at: datetime
    # "unit": written by the key's unit of work; "named": its message key or
    # X-Idempotency-Key header is the key (an event of another unit of work that names it).
    link: str = "unit"


@dataclass(frozen=True)
class KeyEvents:
    """What the outbox still holds of a key's unit of work, and what it cannot say."""

    events: list[KeyEvent]
    # Keys completed by the same transaction (a consumer micro-batch writes many at once).
    keys_in_transaction: int

    @property
    def of_unit(self) -> list[KeyEvent]:
        return [e for e in self.events if e.link == "unit"]

    @property
    def named(self) -> list[KeyEvent]:
        return [e for e in self.events if e.link == "named"]


def _key_event(r: Any, link: str) -> KeyEvent:
    return KeyEvent(
        event_id=r.event_id,
        topic=r.topic,
        key=key_text(r.key),
        attempts=r.attempts,
        error=r.last_error or "",
        parked=r.parked_at is not None,
        created_at=r.created_at,
        link=link,
    )


def lookup_key(
    connection: sa.Connection, schema: str | None, scope: str, key: str
) -> tuple[KeyView | None, KeyEvents]:
    """The idempotency key, the outbox rows its unit of work wrote that are still there
    (pending or parked; delivered ones have left), and other rows naming the key (by message
    key or by the ``X-Idempotency-Key`` header)."""
    schema = validate_schema_name(schema)
    row = sql.idempotency_key(connection, schema, scope, key)
    view = None
    if row is not None:
        view = KeyView(
            scope=row.scope,
            key=row.key,
            status=row.status,
            fingerprint=row.fingerprint,
            result=None
            if row.result is None
            else json.dumps(row.result, indent=2, ensure_ascii=False),
            error=row.error,
            attempts=row.attempts,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )
    written_at = row.updated_at if row is not None and row.status == "completed" else None
    completed = written_at is not None
    rows = sql.outbox_rows_of_key(
        connection, schema, key, IDEMPOTENCY_HEADER, written_at, 2 * KEY_EVENTS_SHOWN
    )
    events = [_key_event(r, "unit") for r in rows if r.of_unit][:KEY_EVENTS_SHOWN]
    events += [_key_event(r, "named") for r in rows if not r.of_unit][:KEY_EVENTS_SHOWN]
    sharing = sql.keys_in_transaction(connection, schema, scope, key) if completed else 0
    return view, KeyEvents(events, sharing)
