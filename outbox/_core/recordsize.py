"""The largest event the relay's producer can send, measured as librdkafka measures it.

``publish()`` refuses an event that the relay could not send, before it commits: a refusal at
the door, rather than a row the relay parks as ``MSG_SIZE_TOO_LARGE`` after the transaction
that wrote it is long gone. librdkafka refuses a record locally when its largest v2 wire size
-- the key, the value, every header's name and value with their zigzag-varint lengths, and
:data:`RECORD_OVERHEAD` bytes of per-record framing -- is over the producer's
``message.max.bytes`` (``rd_kafka_msg_new0``). :func:`wire_size` computes the same number; the
relay adds ``X-Idempotency-Key`` (the event id) to a record that has none, and the door counts
it.

The limit is the relay's producer's ``message.max.bytes``: where it is set in
``OUTBOX_KAFKA_CONFIG`` -- the variable ``outbox-relay`` reads it from -- that value
(:func:`producer_limit`), else librdkafka's default :data:`DEFAULT_MESSAGE_MAX_BYTES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox.errors import ConfigurationError

DEFAULT_MESSAGE_MAX_BYTES: Final = 1_000_000
"""librdkafka's default ``message.max.bytes``."""
MIN_MESSAGE_MAX_BYTES: Final = 1_000
MAX_MESSAGE_MAX_BYTES: Final = 1_000_000_000
"""The range of ``message.max.bytes`` librdkafka accepts."""
MESSAGE_MAX_BYTES: Final = "message.max.bytes"

# RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD: the record's length (varint, at most 5 bytes), attributes
# (1), timestamp delta (varint of an int64, at most 10), offset delta, key length, value length
# and header count (varints of int32s, at most 5 each).
RECORD_OVERHEAD: Final = 5 + 1 + 10 + 5 + 5 + 5 + 5
# The event id as the relay sends it: a UUID's 36 characters.
_EVENT_ID_LENGTH: Final = 36


def _varint_size(length: int) -> int:
    """Bytes of a length as a zigzag varint (how a v2 record writes header lengths)."""
    value = length << 1
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def _header_size(name: bytes, value: bytes) -> int:
    return len(name) + len(value) + _varint_size(len(name)) + _varint_size(len(value))


_IDEMPOTENCY_HEADER_SIZE: Final = _header_size(IDEMPOTENCY_HEADER.encode(), b"-" * _EVENT_ID_LENGTH)


def wire_size(key: bytes | None, value: bytes | None, headers: Mapping[str, str | bytes]) -> int:
    """The size librdkafka checks against ``message.max.bytes`` for the record the relay makes
    of this event (``X-Idempotency-Key`` included when the publisher did not set it; a
    tombstone's value is ``None``)."""
    size = RECORD_OVERHEAD + (len(value) if value is not None else 0)
    size += len(key) if key is not None else 0
    wanted = IDEMPOTENCY_HEADER.lower()
    has_idempotency_key = False
    for name, header in headers.items():
        raw = header if isinstance(header, bytes) else header.encode("utf-8")
        size += _header_size(name.encode("utf-8"), raw)
        has_idempotency_key = has_idempotency_key or name.lower() == wanted
    if not has_idempotency_key:
        size += _IDEMPOTENCY_HEADER_SIZE
    return size


def producer_limit(kafka_config: str | None) -> int:
    """``message.max.bytes`` of ``OUTBOX_KAFKA_CONFIG`` (``KEY=VALUE`` pairs separated by commas
    or newlines, as ``outbox-relay`` reads them), or librdkafka's default where it is not set.

    A value librdkafka would refuse is refused here, without quoting the variable (it may hold
    secrets).
    """
    if not kafka_config:
        return DEFAULT_MESSAGE_MAX_BYTES
    found: str | None = None
    for chunk in kafka_config.splitlines():
        for pair in chunk.split(","):
            name, equals, value = pair.strip().partition("=")
            if equals and name.strip() == MESSAGE_MAX_BYTES:
                found = value.strip()  # the last one wins, as in outbox-relay
    if found is None:
        return DEFAULT_MESSAGE_MAX_BYTES
    if (
        not found.isascii()
        or not found.isdigit()
        or not MIN_MESSAGE_MAX_BYTES <= int(found) <= MAX_MESSAGE_MAX_BYTES
    ):
        raise ConfigurationError(
            f"OUTBOX_KAFKA_CONFIG: {MESSAGE_MAX_BYTES} must be a whole number of bytes from "
            f"{MIN_MESSAGE_MAX_BYTES} to {MAX_MESSAGE_MAX_BYTES}, as librdkafka accepts"
        )
    return int(found)
