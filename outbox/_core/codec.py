"""Pure encoding helpers shared by the unit of work (writer) and the relay (reader).

Outbox rows store headers as a JSON object: a ``str`` header value is stored as a JSON string,
a ``bytes`` value as ``{"base64": "..."}``. Both round-trip exactly to what the publisher gave.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Mapping
from typing import Any

CONTENT_TYPE_HEADER = "content-type"
JSON_CONTENT_TYPE = "application/json"
IDEMPOTENCY_HEADER = "X-Idempotency-Key"
# W3C trace context (https://www.w3.org/TR/trace-context/): stored with an event, sent with it.
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"


def key_hash(key: bytes | None, event_id_bytes: bytes) -> int:
    """Stable non-negative 31-bit hash of a message key.

    Key-less rows hash their event id instead, which spreads them over all lanes (they have no
    order to keep).
    """
    return zlib.crc32(key if key is not None else event_id_bytes) & 0x7FFFFFFF


def encode_headers(headers: Mapping[str, str | bytes]) -> dict[str, Any]:
    """Turn publisher headers into the JSON object stored in ``outbox.headers``."""
    stored: dict[str, Any] = {}
    for name, value in headers.items():
        if isinstance(value, bytes):
            stored[name] = {"base64": base64.b64encode(value).decode("ascii")}
        else:
            stored[name] = value
    return stored


def decode_headers(stored: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    """Turn a stored ``outbox.headers`` object into Kafka record headers."""
    out: list[tuple[str, bytes]] = []
    for name, value in stored.items():
        if isinstance(value, dict):
            out.append((name, base64.b64decode(value["base64"])))
        else:
            out.append((name, str(value).encode("utf-8")))
    return out
