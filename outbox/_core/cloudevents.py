"""CloudEvents in binary content mode, per the CloudEvents Kafka protocol binding (v1.0.2).

An event's attributes travel as record headers named ``ce_<attribute>`` with UTF-8 values, its
data as the record's value unchanged, and ``datacontenttype`` as the ``content-type`` header.
The event id is the outbox's own event id, so ``ce_id`` equals the ``X-Idempotency-Key`` the
relay sends unless the publisher set that header itself. With a trace context stored with the
event (``traceparent``, ``tracestate``: tracing on), the distributed-tracing extension carries
it as ``ce_traceparent`` and ``ce_tracestate`` too.

Pure: the checks and the headers of :class:`CloudEvent`; reading them back from a consumed
record is :func:`read` (headers in, attributes out).
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox._core.codec import CONTENT_TYPE_HEADER, TRACEPARENT_HEADER, TRACESTATE_HEADER
from outbox.errors import SerializationError

SPEC_VERSION = "1.0"
PREFIX = "ce_"
ID_HEADER = "ce_id"
# Attributes of the specification that are not extensions; "data" is the record's value.
_CORE = frozenset(
    {"id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject", "time"}
)
_RESERVED = _CORE | {"data"}
# Extension names: lower-case ASCII letters and digits (the specification's rule; it
# recommends at most 20 characters, which SDKs enforce).
_NAME = re.compile(r"[a-z0-9]{1,20}")
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True, slots=True)
class CloudEvent:
    """The CloudEvents attributes of a publish (``uow.publish(..., cloudevent=CloudEvent(...))``).

    ``type`` and ``source`` are required; ``id`` is the event id the outbox draws; ``time``
    defaults to the moment of the publish (UTC); ``datacontenttype`` defaults to the value's
    content type (``application/json`` for JSON values; none for bytes from a serializer).
    ``extensions`` maps lower-case alphanumeric names to ``str``, ``int`` or ``bool`` values
    (``ce_<name>`` headers).
    """

    type: str
    source: str
    subject: str | None = None
    time: _dt.datetime | None = None
    dataschema: str | None = None
    datacontenttype: str | None = None
    extensions: Mapping[str, str | int | bool] = field(default_factory=dict)

    def validate(self) -> CloudEvent:
        """Refuse attributes the specification does not allow (before any I/O)."""
        for name in ("type", "source"):
            _text(name, getattr(self, name), required=True)
        for name in ("subject", "dataschema", "datacontenttype"):
            _text(name, getattr(self, name), required=False)
        if self.time is not None and (
            not isinstance(self.time, _dt.datetime) or self.time.utcoffset() is None
        ):
            raise SerializationError(
                f"CloudEvent time must be a timezone-aware datetime, got {self.time!r} "
                "(e.g. datetime.now(timezone.utc))"
            )
        if not isinstance(self.extensions, Mapping):
            raise SerializationError("CloudEvent extensions must be a dict of name to value")
        for name, value in self.extensions.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
                raise SerializationError(
                    f"CloudEvent extension name {name!r}: use lower-case letters and digits, "
                    "and not a name of the specification's own attributes"
                )
            if isinstance(value, str):
                _text(f"extension {name!r}", value, required=False)
            elif isinstance(value, bool):
                pass
            elif isinstance(value, int):
                if not _INT32[0] <= value <= _INT32[1]:
                    raise SerializationError(
                        f"CloudEvent extension {name!r}: integers are 32-bit signed"
                    )
            else:
                raise SerializationError(
                    f"CloudEvent extension {name!r} must be str, int or bool, "
                    f"got {type(value).__name__}"
                )
        return self


def _text(name: str, value: object, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value or "\x00" in value:
        raise SerializationError(
            f"CloudEvent {name} must be a non-empty str without NUL, got {value!r}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SerializationError(f"CloudEvent {name} is not valid UTF-8 text") from None


def timestamp(moment: _dt.datetime) -> str:
    """RFC 3339 text of a timezone-aware ``moment`` (UTC, ``Z``)."""
    text = moment.astimezone(_dt.UTC).isoformat()
    return text.removesuffix("+00:00") + "Z"


def headers(
    event: CloudEvent,
    event_id: str,
    content_type: str | None,
    published: Mapping[str, str | bytes],
) -> dict[str, str]:
    """The ``ce_*`` headers (and ``content-type``) of ``event`` with id ``event_id``;
    ``published`` are the record's other headers, which must not set any of them."""
    taken = {name.lower() for name in published}
    clash = sorted(n for n in taken if n.startswith(PREFIX))
    if clash:
        raise SerializationError(
            f"header {clash[0]!r} is set by cloudevent=; leave ce_* headers to it "
            "(extensions go in CloudEvent(extensions=...))"
        )
    out = {
        "ce_specversion": SPEC_VERSION,
        ID_HEADER: event_id,
        "ce_source": event.source,
        "ce_type": event.type,
        "ce_time": timestamp(event.time or _dt.datetime.now(_dt.UTC)),
    }
    if event.subject is not None:
        out["ce_subject"] = event.subject
    if event.dataschema is not None:
        out["ce_dataschema"] = event.dataschema
    for name, extension in event.extensions.items():
        out[PREFIX + name] = _extension_text(extension)
    for name in (TRACEPARENT_HEADER, TRACESTATE_HEADER):  # the distributed-tracing extension
        stored = next((v for n, v in published.items() if n.lower() == name), None)
        if stored is not None:
            out[PREFIX + name] = stored.decode("utf-8") if isinstance(stored, bytes) else stored
    wanted = event.datacontenttype or content_type
    if wanted is not None:
        if CONTENT_TYPE_HEADER in taken and event.datacontenttype is not None:
            raise SerializationError(
                "both a content-type header and CloudEvent(datacontenttype=...) were given; "
                "pass one"
            )
        if CONTENT_TYPE_HEADER not in taken:
            out[CONTENT_TYPE_HEADER] = wanted
    return out


def _extension_text(value: str | int | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True, slots=True)
class Received:
    """The CloudEvents attributes of a consumed record (:func:`read`): ``attributes`` holds
    every one by name (``id``, ``source``, ``type``, ``time``..., extensions), as text."""

    attributes: Mapping[str, str]

    @property
    def id(self) -> str:
        return self.attributes["id"]

    @property
    def source(self) -> str:
        return self.attributes["source"]

    @property
    def type(self) -> str:
        return self.attributes["type"]

    @property
    def subject(self) -> str | None:
        return self.attributes.get("subject")

    @property
    def time(self) -> _dt.datetime | None:
        text = self.attributes.get("time")
        return _dt.datetime.fromisoformat(text) if text is not None else None

    @property
    def datacontenttype(self) -> str | None:
        return self.attributes.get("datacontenttype")

    @property
    def extensions(self) -> dict[str, str]:
        return {k: v for k, v in self.attributes.items() if k not in _CORE}


def read(record_headers: Sequence[tuple[str, Any]] | Mapping[str, Any] | None) -> Received | None:
    """The CloudEvent a record carries in binary content mode (``ce_specversion``, ``ce_id``,
    ``ce_source`` and ``ce_type`` present), or None for a record that is not one."""
    items = record_headers.items() if isinstance(record_headers, Mapping) else record_headers or ()
    attributes: dict[str, str] = {}
    for name, value in items:
        lowered = name.lower()
        if value is None:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if lowered.startswith(PREFIX):
            attributes[lowered[len(PREFIX) :]] = text
        elif lowered == CONTENT_TYPE_HEADER:
            attributes["datacontenttype"] = text
    if not {"specversion", "id", "source", "type"} <= attributes.keys():
        return None
    return Received(attributes)
