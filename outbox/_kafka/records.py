"""Kafka records from claimed outbox rows: the publisher's headers plus ``X-Idempotency-Key``.

Every record carries ``X-Idempotency-Key`` (docs/concepts.md I6): the event id, unless the publisher
set that header itself, so consumers can drop re-sends. No I/O here; the relay calls
:func:`build_records` once per batch, and it is its main per-row Python cost.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from outbox._core.codec import IDEMPOTENCY_HEADER, decode_headers
from outbox._core.delivery import ClaimedRow
from outbox._kafka.producer import Headers, Record, RecordTuple


def build_records(rows: Sequence[ClaimedRow]) -> list[RecordTuple]:
    """The Kafka records of claimed rows, in the same order (see :func:`build_record`)."""
    headers_of = _headers_of_json
    records: list[RecordTuple] = []
    append = records.append
    # One loop with local names: ~1 us per row, the relay's main per-row Python cost.
    for _, _, topic, key, value, stored, event_id, _ in rows:
        headers, has_idempotency_key = headers_of(stored)
        if not has_idempotency_key:
            headers = [*headers, (IDEMPOTENCY_HEADER, event_id)]
        append((topic, key, value, headers))
    return records


def build_records_checked(
    rows: Sequence[ClaimedRow],
) -> tuple[list[RecordTuple | None], dict[int, str]]:
    """:func:`build_records` for a batch in which some row cannot become a record (stored
    headers that are not what ``uow.publish`` writes, e.g. from hand-written SQL): those rows
    get ``None`` and an error text, by index; the others their records."""
    records: list[RecordTuple | None] = []
    broken: dict[int, str] = {}
    for index, row in enumerate(rows):
        try:
            records.append(build_records([row])[0])
        except Exception as exc:
            records.append(None)
            broken[index] = f"row cannot be turned into a record: {type(exc).__name__}: {exc}"
    return records, broken


def build_record(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    stored_headers: Mapping[str, Any],
    event_id: str,
) -> Record:
    """The Kafka record of an outbox row: the publisher's headers plus ``X-Idempotency-Key``
    (the event id, unless the publisher set that header itself)."""
    headers, has_idempotency_key = _headers(stored_headers)
    if not has_idempotency_key:
        headers = [*headers, (IDEMPOTENCY_HEADER, event_id.encode("ascii"))]
    return Record(topic, key, value, headers)


@functools.lru_cache(maxsize=4096)
def _headers_of_json(stored_json: str) -> tuple[Headers, bool]:
    # Most rows of an outbox carry the same few header sets (content type, source): decoding
    # each distinct JSON text once saves a JSON parse and a base64 pass per record. The cached
    # list is shared by many records and must never be mutated (confluent-kafka only reads it):
    # a row that needs the idempotency key gets a new list.
    return _headers(json.loads(stored_json))


def _headers(stored: Mapping[str, Any]) -> tuple[Headers, bool]:
    headers: Headers = list(decode_headers(stored))
    wanted = IDEMPOTENCY_HEADER.lower()
    return headers, any(name.lower() == wanted for name, _ in headers)
