"""Dead letters for operators (``outbox dlq``, the console): read, group by failure, redrive,
mark handled.

Invariant: a redriven message carries its original key, value and headers, without the
``outbox.dlq.*`` headers of its failure and with ``outbox.redrive-count`` raised by one.
Invariant: a dead letter is recorded as handled (``outbox_dlq_handled``) only once the broker
confirmed its redrive, or when an operator discarded it; input is refused before anything is
written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from outbox._core.deadletter_reading import (
    HANDLED_DISCARDED,
    HANDLED_REDRIVEN,
    MAX_HANDLED_BY_LENGTH,
    REDRIVE_HEADER,
    Group,
    Letter,
    check_how,
    group_letters,
    group_unhandled,
    redrive_headers,
)
from outbox._core.validate import check_topic
from outbox._pg import operations as ops
from outbox.errors import ConfigurationError
from outbox.schema import validate_schema_name

__all__ = [
    "REDRIVE_HEADER",
    "DeadLetters",
    "Group",
    "Letter",
    "discard",
    "mark_handled",
    "read_dead_letters",
    "read_groups",
    "read_handled",
    "redrive",
]


def _kafka() -> ModuleType:
    """The Kafka side of dead letters, loaded on first use."""
    from outbox._kafka import deadletter_reading  # why: status, gc, parked never load Kafka

    return deadletter_reading


def read_groups(
    bootstrap_servers: str,
    topic: str,
    *,
    kafka_config: Mapping[str, Any] | None = None,
    limit: int = 100_000,
) -> list[Group]:
    """The dead letters of ``topic`` (at most ``limit``) grouped by failure, biggest first."""
    check_topic(topic)
    return group_letters(_kafka().read_letters(bootstrap_servers, kafka_config or {}, topic, limit))


@dataclass(frozen=True)
class DeadLetters:
    """A page of a dead-letter topic as an operator sees it: the groups still to handle, how
    many letters were handled (per group in :attr:`Group.handled`), and where reading stopped.

    ``stopped`` maps each partition not read to its end to the offset the next page starts
    from (pass it as ``start``); it is empty when every partition was read to its end.
    """

    topic: str
    groups: list[Group]
    handled: int
    stopped: dict[int, int] = field(default_factory=dict)
    start: dict[int, int] | None = None
    limit: int = 100_000


def read_dead_letters(
    connection: sa.Connection,
    bootstrap_servers: str,
    topic: str,
    *,
    schema: str | None = None,
    kafka_config: Mapping[str, Any] | None = None,
    limit: int = 100_000,
    include_handled: bool = False,
    start: Mapping[int, int] | None = None,
) -> DeadLetters:
    """A page of the dead letters of ``topic`` grouped by failure, biggest first: letters are
    read partition after partition (from ``start``, default the beginning) until ``limit`` of
    them are still to handle; handled ones use none of that budget and are left out unless
    ``include_handled`` (then every letter counts). Each group counts its handled ones."""
    check_topic(topic)
    validate_schema_name(schema)
    if type(limit) is not int or limit < 1:
        raise ConfigurationError(f"limit: a positive integer, got {str(limit)[:40]}")
    began = not connection.in_transaction()
    handled = read_handled(connection, topic, schema)
    if began:
        # No transaction of ours stays open (a snapshot held) while the topic is read.
        connection.rollback()

    def counts(partition: int, offset: int) -> bool:
        return include_handled or (partition, offset) not in handled

    page = _kafka().read_letter_page(
        bootstrap_servers,
        kafka_config or {},
        topic,
        limit,
        start=None if start is None else dict(start),
        counts=counts,
    )
    groups, count = group_unhandled(page.letters, handled, include_handled=include_handled)
    return DeadLetters(
        topic, groups, count, page.stopped, None if start is None else dict(start), limit
    )


def read_handled(
    connection: sa.Connection, topic: str, schema: str | None = None
) -> dict[tuple[int, int], str]:
    """``(partition, offset) -> "discarded" | "redriven"`` of the handled dead letters of
    ``topic``."""
    check_topic(topic)
    return ops.dlq_handled_refs(connection, validate_schema_name(schema), topic)


def _check_by(by: str | None) -> str | None:
    if by is not None and (
        not isinstance(by, str) or len(by) > MAX_HANDLED_BY_LENGTH or not by.isprintable()
    ):
        raise ConfigurationError(
            f"by: at most {MAX_HANDLED_BY_LENGTH} printable characters, e.g. 'cli alice@host'"
        )
    return by


def _places(letters: Iterable[Letter | tuple[int, int]]) -> list[tuple[int, int]]:
    places: list[tuple[int, int]] = []
    for x in letters:
        place: Any = (x.partition, x.offset) if isinstance(x, Letter) else x
        if (
            not isinstance(place, tuple)
            or len(place) != 2
            or not all(type(n) is int for n in place)
            or not (0 <= place[0] < 2**31 and 0 <= place[1] < 2**63)
        ):
            raise ConfigurationError(
                f"{str(place)[:60]} is not a (partition, offset) of a dead letter"
            )
        places.append((place[0], place[1]))
    return places


def mark_handled(
    connection: sa.Connection,
    topic: str,
    letters: Iterable[Letter | tuple[int, int]],
    how: str,
    schema: str | None = None,
    *,
    by: str | None = None,
) -> int:
    """Record dead letters of ``topic`` (letters, or ``(partition, offset)`` pairs) as handled
    ``how`` ("discarded" or "redriven"), ``by`` whom or from where if given, at the database's
    clock; returns how many were not handled before. The caller commits."""
    check_topic(topic)
    try:
        check_how(how)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    places = _places(letters)
    return ops.dlq_handled_mark(
        connection, validate_schema_name(schema), topic, places, how, _check_by(by)
    )


def discard(
    connection: sa.Connection,
    topic: str,
    letters: Iterable[Letter],
    schema: str | None = None,
    *,
    by: str | None = None,
    dry_run: bool = False,
) -> int:
    """Mark ``letters`` of ``topic`` handled as discarded: they stay in Kafka, the listings leave
    them out. Returns how many were not handled before (with ``dry_run``: how many were
    chosen, nothing written). The caller commits."""
    chosen = list(letters)
    if dry_run:
        check_topic(topic)
        _check_by(by)
        return len(_places(chosen))
    return mark_handled(connection, topic, chosen, HANDLED_DISCARDED, schema, by=by)


def redrive(
    bootstrap_servers: str,
    letters: Iterable[Letter],
    *,
    kafka_config: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    connection: sa.Connection | None = None,
    dlq_topic: str | None = None,
    schema: str | None = None,
    by: str | None = None,
) -> int:
    """Send ``letters`` back to their original topics and wait for the broker; returns how
    many. Refuses, before sending any, letters whose original topic is unknown.

    Given a ``connection``, the letters the broker confirmed are then marked handled as
    "redriven" in ``dlq_topic`` (the caller commits), so that the listings leave them out.
    """
    if connection is not None:
        if dlq_topic is None:
            raise ConfigurationError("redrive: name the dlq_topic the letters were read from")
        check_topic(dlq_topic)
        _check_by(by)
        validate_schema_name(schema)
    chosen = list(letters)
    unknown = [x.ref for x in chosen if x.info is None]
    if unknown:
        raise ConfigurationError(
            f"{len(unknown)} chosen record(s) carry no outbox.dlq.* headers, so their original "
            f"topic is unknown (first: {unknown[0]})"
        )
    records = [
        (x.info.topic, x.key, x.value, redrive_headers(x.headers))
        for x in chosen
        if x.info is not None
    ]
    if records and not dry_run:
        _kafka().produce_all(bootstrap_servers, kafka_config or {}, records)
        if connection is not None and dlq_topic is not None:
            mark_handled(connection, dlq_topic, chosen, HANDLED_REDRIVEN, schema, by=by)
    return len(records)
