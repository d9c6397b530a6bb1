"""Pure input checks and encoders: run before any PostgreSQL, Redis or Kafka I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from outbox._core import recordsize
from outbox._core.codec import CONTENT_TYPE_HEADER, IDEMPOTENCY_HEADER, JSON_CONTENT_TYPE
from outbox.errors import (
    ConfigurationError,
    InvalidKeyError,
    InvalidTopicError,
    PayloadTooLargeError,
    SerializationError,
    ValidationError,
)

MAX_KEY_LENGTH = 255
MAX_SCOPE_LENGTH = 100
MAX_FINGERPRINT_LENGTH = 512
MAX_TOPIC_LENGTH = 249
MAX_HEADER_NAME_LENGTH = 255
# Nesting limit of stored results and JSON event values (serde_json's default): deeper values
# would exhaust the stack of a reader, Python's or PostgreSQL's jsonb parser.
MAX_JSON_DEPTH = 128
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
OCTET_CONTENT_TYPE = "application/octet-stream"

# fullmatch() everywhere: "$" would also match before a trailing newline.
_TOPIC = re.compile(r"[A-Za-z0-9._-]+")
_SCOPE = re.compile(r"[A-Za-z0-9._:/-]+")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A NUL character in JSON text: "\u0000" not preceded by an escaping backslash.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def is_utf8(value: str) -> bool:
    """True when ``value`` encodes to UTF-8 (no lone surrogates), as PostgreSQL, Redis and
    Kafka need."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _has_control(value: str) -> bool:
    """Control characters, or lone surrogates (not valid UTF-8, so PostgreSQL cannot store them)."""
    if _CONTROL.search(value):
        return True
    return not value.isascii() and not is_utf8(value)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about refused input."""
    try:
        text = repr(value)
    except Exception:  # an object whose repr fails is still refused, with its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_key(key: object) -> str:
    """An idempotency key: a non-empty ``str`` of at most 255 characters, no control chars."""
    if not isinstance(key, str):
        raise InvalidKeyError(
            f"idempotency key must be a str, got {type(key).__name__}; convert it explicitly "
            "(e.g. str(order_id)) so that equal requests map to equal keys"
        )
    if not key:
        raise InvalidKeyError("idempotency key must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"idempotency key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH} "
            "(hash longer natural keys, e.g. with hashlib.sha256)"
        )
    if _has_control(key):
        raise InvalidKeyError(
            f"idempotency key {shown(key)} contains control characters or invalid UTF-8"
        )
    return key


def check_scope(scope: object) -> str:
    """A scope: 1-100 characters of letters, digits and ``. _ : / -``."""
    if not isinstance(scope, str):
        raise InvalidKeyError(f"scope must be a str, got {type(scope).__name__}")
    if not scope or len(scope) > MAX_SCOPE_LENGTH or not _SCOPE.fullmatch(scope):
        raise InvalidKeyError(
            f"invalid scope {shown(scope)}: use 1-{MAX_SCOPE_LENGTH} letters, digits or '._:/-' "
            "(for example 'payments' or 'billing.v2')"
        )
    return scope


def check_fingerprint(fingerprint: object) -> str | None:
    """An optional request fingerprint (e.g. a hash of the request body)."""
    if fingerprint is None:
        return None
    if not isinstance(fingerprint, str):
        raise InvalidKeyError(
            f"fingerprint must be a str or None, got {type(fingerprint).__name__}"
        )
    if not fingerprint or len(fingerprint) > MAX_FINGERPRINT_LENGTH or _has_control(fingerprint):
        raise InvalidKeyError(
            f"fingerprint must be 1-{MAX_FINGERPRINT_LENGTH} printable characters "
            "(a hex digest of the request works well)"
        )
    return fingerprint


def check_topic(topic: object) -> str:
    """A Kafka topic name the broker accepts: 1-249 of ``[A-Za-z0-9._-]``, not ``.``/``..``."""
    if not isinstance(topic, str):
        raise InvalidTopicError(f"topic must be a str, got {type(topic).__name__}")
    if (
        not topic
        or len(topic) > MAX_TOPIC_LENGTH
        or topic in (".", "..")
        or not _TOPIC.fullmatch(topic)
    ):
        raise InvalidTopicError(
            f"invalid topic name {shown(topic)}: Kafka accepts 1-{MAX_TOPIC_LENGTH} characters of "
            "letters, digits, '.', '_' and '-' (and not '.' or '..')"
        )
    return topic


# json.dumps() with arguments makes an encoder on every call: one, made once, serves them all.
_STRICT_JSON = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def dumps_json(value: Any, what: str) -> str:
    """Strict JSON that PostgreSQL's jsonb accepts and every reader can parse back: no
    NaN/Infinity, no NUL characters, valid UTF-8, at most :data:`MAX_JSON_DEPTH` levels."""
    if value is None:  # most handlers' result: spared the encoder
        return "null"
    try:
        text = _STRICT_JSON.encode(value)
    except RecursionError:
        raise SerializationError(
            f"{what} is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"{what} is not JSON-serializable: {exc}") from exc
    # Each level opens a bracket: only a text with that many brackets can be too deep.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise SerializationError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    if "\\u0000" in text and _JSON_NUL.search(text):
        raise SerializationError(f"{what} contains a NUL character, which jsonb cannot store")
    if not is_utf8(text):
        raise SerializationError(f"{what} contains text that is not valid UTF-8 (a lone surrogate)")
    return text


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (as JSON would write it); stops counting
    once past :data:`MAX_JSON_DEPTH`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def encode_value(value: object) -> tuple[bytes | None, str | None]:
    """Encode an event value; returns the bytes and their content type.

    ``None`` is a tombstone: a record with a null value (no bytes, no content type), which a
    compacted topic reads as "delete this key"."""
    if value is None:
        return None, None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), OCTET_CONTENT_TYPE
    if isinstance(value, str):
        try:
            return value.encode("utf-8"), TEXT_CONTENT_TYPE
        except UnicodeEncodeError as exc:
            raise SerializationError(f"event value is not valid UTF-8 text: {exc}") from exc
    return dumps_json(value, "event value").encode("utf-8"), JSON_CONTENT_TYPE


def serialized_value(value: object) -> bytes | None:
    """What a serializer returned for an event value: ``bytes`` (or ``None``, a tombstone)."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise SerializationError(
        f"a serializer returned {type(value).__name__}, not bytes: it must return the "
        "encoded value (bytes) or None"
    )


def encode_message_key(key: object) -> bytes | None:
    """Encode a Kafka message key (``str``, ``bytes`` or ``None``)."""
    if key is None:
        return None
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, str):
        try:
            return key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SerializationError(f"message key is not valid UTF-8 text: {exc}") from exc
    raise SerializationError(f"message key must be str, bytes or None, got {type(key).__name__}")


def check_headers(headers: object) -> dict[str, str | bytes]:
    """Headers: a mapping of non-empty ``str`` names to ``str`` or ``bytes`` values."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise SerializationError(
            f"headers must be a dict of str to str|bytes, got {type(headers).__name__}"
        )
    out: dict[str, str | bytes] = {}
    for name, value in headers.items():
        check_header_name(name, SerializationError)
        if isinstance(value, bytes | bytearray | memoryview):
            out[name] = bytes(value)
        elif isinstance(value, str):
            if "\x00" in value:
                raise SerializationError(
                    f"header {shown(name)}: str values must not contain NUL; pass bytes instead"
                )
            if not is_utf8(value):
                raise SerializationError(
                    f"header {shown(name)}: str value is not valid UTF-8 text (a lone "
                    "surrogate); pass bytes instead"
                )
            out[name] = value
        else:
            raise SerializationError(
                f"header {shown(name)} must be str or bytes, got {type(value).__name__}"
            )
    return out


def check_header_name(
    name: object, error: type[ValidationError | ConfigurationError] = SerializationError
) -> str:
    """A Kafka header name: a non-empty ``str`` of valid UTF-8 text without NUL, at most
    :data:`MAX_HEADER_NAME_LENGTH` characters."""
    if not isinstance(name, str) or not name:
        raise error(f"header name must be a non-empty str, got {shown(name)}")
    if "\x00" in name:
        raise error(f"header name {shown(name)} contains a NUL character")
    if len(name) > MAX_HEADER_NAME_LENGTH:
        raise error(f"header name is longer than {MAX_HEADER_NAME_LENGTH} characters")
    if not is_utf8(name):
        raise error(f"header name {shown(name)} is not valid UTF-8 text (a lone surrogate)")
    return name


def check_idempotency_header(headers: Mapping[str, str | bytes]) -> None:
    """A publisher's own ``X-Idempotency-Key`` header (any case) must hold a valid idempotency
    key: consumers use it as theirs, and one they cannot use would be dead-lettered there."""
    wanted = IDEMPOTENCY_HEADER.lower()
    for name, value in headers.items():
        if name.lower() != wanted:
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidKeyError(
                    f"header {name!r} must be UTF-8 text: consumers use it as their idempotency key"
                ) from exc
        try:
            check_key(value)
        except InvalidKeyError as exc:
            raise InvalidKeyError(
                f"header {name!r}: {exc} (consumers use it as their idempotency key; leave it "
                "out and the event id is sent instead)"
            ) from exc


def check_size(
    key: bytes | None, value: bytes | None, headers: Mapping[str, str | bytes], limit: int
) -> None:
    """Refuse an event whose record, as the relay's producer measures it (key, value, headers
    with ``X-Idempotency-Key``, framing: :func:`outbox._core.recordsize.wire_size`), exceeds
    ``limit`` bytes -- the producer's ``message.max.bytes``."""
    size = recordsize.wire_size(key, value, headers)
    if size > limit:
        raise PayloadTooLargeError(
            f"event is {size} bytes as a Kafka record (key + value + headers + "
            f"{recordsize.RECORD_OVERHEAD} bytes of framing); the limit is {limit} bytes, the "
            "relay's producer's message.max.bytes. Store large payloads elsewhere and publish "
            "a reference, or raise message.max.bytes for the relay (OUTBOX_KAFKA_CONFIG, or "
            "OutboxConfig.max_payload_bytes with --kafka-config) and the broker's limit"
        )


def with_content_type(headers: dict[str, str | bytes], content_type: str) -> dict[str, str | bytes]:
    """Record the value's content type unless the publisher set one."""
    if not any(name.lower() == CONTENT_TYPE_HEADER for name in headers):
        headers[CONTENT_TYPE_HEADER] = content_type
    return headers
