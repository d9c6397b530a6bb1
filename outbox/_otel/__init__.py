"""OpenTelemetry tracing, on when ``opentelemetry`` can be imported.

Invariant: without opentelemetry, tracing costs one comparison and loads nothing. ``spans`` is
:mod:`outbox._otel.spans` -- the only module that imports ``opentelemetry`` -- or ``None`` when
that import fails (for any ``ImportError``), and callers skip every tracing step on ``None``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox._core import events
from outbox._core.cloudevents import CloudEvent

try:
    from outbox._otel import spans as spans
except ImportError:  # tracing off: nothing of opentelemetry is loaded
    spans = None  # type: ignore[assignment]


def encode_event(
    topic: str,
    value: Any,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    max_payload_bytes: int,
    *,
    serialized: bool = False,
    cloudevent: CloudEvent | None = None,
) -> events.Event:
    """:func:`outbox._core.events.encode_event`; with tracing on and a span active, inside a
    ``create {topic}`` span whose context is stored with the event (:func:`spans.encode_event`)."""
    if spans is None:
        return events.encode_event(
            topic, value, key, headers, max_payload_bytes,
            serialized=serialized, cloudevent=cloudevent,
        )  # fmt: skip
    return spans.encode_event(
        topic, value, key, headers, max_payload_bytes, serialized=serialized, cloudevent=cloudevent
    )
