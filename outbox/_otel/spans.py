"""The spans of the outbox, on the global tracer provider (the only importer of opentelemetry).

Names, kinds and attributes follow the OpenTelemetry messaging semantic conventions:

* ``create {topic}`` (PRODUCER) -- ``publish()`` inside an active span: its W3C context
  (``traceparent``, ``tracestate``) is stored in the outbox row's headers
  (:func:`encode_event`);
* ``send {topic}`` (PRODUCER) -- the relay, one per batch and topic, *linked* to the stored
  contexts of the records it sends; the records carry their stored context, never the relay's
  (:func:`start_send`, :func:`end_send`);
* ``process {topic}`` (CONSUMER) -- the consumer runner, one per message, with the record's
  context as parent or as a link (:func:`process`);
* ``{method}`` (SERVER) -- the HTTP middleware, for a request that carries a ``traceparent``
  while no span is active (:func:`request`).

The W3C propagator is used directly (not the global one): the stored headers are the same
whatever propagators the application configured.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox._core import codec, events, validate
from outbox._core.cloudevents import CloudEvent
from outbox._core.delivery import HEADERS, TOPIC, ClaimedRow, DeliveryFate
from outbox._core.redact import one_line, redact_text

_W3C = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("outbox")

SYSTEM = "kafka"
# Attribute names (semantic conventions, messaging).
A_SYSTEM = "messaging.system"
A_DESTINATION = "messaging.destination.name"
A_OPERATION_TYPE = "messaging.operation.type"
A_OPERATION_NAME = "messaging.operation.name"
A_PARTITION = "messaging.destination.partition.id"
A_OFFSET = "messaging.kafka.offset"
A_KEY = "messaging.kafka.message.key"
A_MESSAGE_ID = "messaging.message.id"
A_BODY_SIZE = "messaging.message.body.size"
A_BATCH_COUNT = "messaging.batch.message_count"
A_GROUP = "messaging.consumer.group.name"
A_KAFKA_GROUP = "messaging.kafka.consumer.group"
A_ERROR_TYPE = "error.type"
A_OUTCOME = "outbox.consumer.outcome"  # the runner's verdict on the message


def _base(topic: str, operation: str) -> dict[str, Any]:
    return {
        A_SYSTEM: SYSTEM,
        A_DESTINATION: topic,
        A_OPERATION_TYPE: operation,
        A_OPERATION_NAME: operation,
    }


def _key_text(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _failed(span: Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` (an ``exception`` event, ERROR status), the way the logs
    describe errors: the first line of the message, URL passwords and secret settings hidden --
    never a driver's multi-line text with its bound parameters. Never raises: tracing must not
    turn a failure the caller handles (a retry, a dead letter) into another one."""
    try:
        message = redact_text(one_line(exc, with_type=False))
        span.add_event(
            "exception",
            {
                "exception.type": type(exc).__qualname__,
                "exception.message": message,
                "exception.stacktrace": "".join(traceback.format_tb(exc.__traceback__)),
            },
        )
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))
        span.set_attribute(A_ERROR_TYPE, type(exc).__qualname__)
    except Exception:  # the span loses its error; the caller's handling goes on
        pass


@contextmanager
def _current(
    name: str,
    parent: Context | None,
    kind: SpanKind,
    attributes: dict[str, Any],
    links: list[Link] | None = None,
) -> Iterator[Span]:
    """A current span that records an exception leaving it the project's way (:func:`_failed`:
    one redacted line, ERROR), not the SDK's (whose message could carry secrets)."""
    with _tracer.start_as_current_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _failed(span, exc)
            raise


def active() -> bool:
    """True when a span (recording or not) is current: a trace to continue."""
    return trace.get_current_span().get_span_context().is_valid


# ---------------------------------------------------------------------------------- create


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
    """:func:`outbox._core.events.encode_event`, inside a ``create {topic}`` span whose context
    is stored with the event -- when a span is active; otherwise exactly that function.

    A ``traceparent`` header the publisher set is kept as given (the span still describes
    the publish, in the current trace)."""
    if not active():
        return events.encode_event(
            topic, value, key, headers, max_payload_bytes,
            serialized=serialized, cloudevent=cloudevent,
        )  # fmt: skip
    validate.check_topic(topic)  # the span's name: refuse a bad topic before it is used
    span = _tracer.start_span(
        f"create {topic}", kind=SpanKind.PRODUCER, attributes=_base(topic, "create")
    )
    try:
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=trace.set_span_in_context(span))
        event = events.encode_event(
            topic, value, key, headers, max_payload_bytes, carrier,
            serialized=serialized, cloudevent=cloudevent,
        )  # fmt: skip
        if span.is_recording():
            span.set_attribute(A_MESSAGE_ID, str(event.event_id))
            span.set_attribute(A_BODY_SIZE, len(event.value or b""))
            text = _key_text(event.key)
            if text is not None:
                span.set_attribute(A_KEY, text)
        return event
    except BaseException as exc:
        _failed(span, exc)
        raise
    finally:
        span.end()


# ------------------------------------------------------------------------------------ send


def stored_context(headers_json: str) -> SpanContext | None:
    """The span context an outbox row's stored headers carry, if a valid one."""
    if codec.TRACEPARENT_HEADER not in headers_json.lower():
        return None  # most rows: no JSON parse
    try:
        pairs = codec.decode_headers(json.loads(headers_json))
        carrier = {name.lower(): value.decode("utf-8") for name, value in pairs}
    except Exception:  # any stored shape at all: the row is sent, without a link
        return None
    return _context_of(carrier)


def _context_of(carrier: Mapping[str, str]) -> SpanContext | None:
    span_context = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


Sending = list[tuple[Span, list[int]]]


def start_send(rows: Sequence[ClaimedRow], todo: Sequence[int]) -> Sending:
    """One ``send {topic}`` span per topic among ``rows[todo]``, each linked to the stored
    contexts of its rows. Returned with, per span, the positions in ``todo`` of its rows.

    The spans are never made current: the records go out with their stored headers only.
    Never raises: a relay sends whatever becomes of its spans."""
    sending: Sending = []
    try:
        by_topic: dict[str, list[int]] = {}
        topics = {rows[index][TOPIC] for index in todo}
        if len(topics) == 1:
            by_topic[topics.pop()] = list(range(len(todo)))  # most sends: one topic
        else:
            for position, index in enumerate(todo):
                by_topic.setdefault(rows[index][TOPIC], []).append(position)
        for topic, positions in by_topic.items():
            attributes = _base(topic, "send")
            attributes[A_BATCH_COUNT] = len(positions)
            span = _tracer.start_span(
                f"send {topic}", kind=SpanKind.PRODUCER, attributes=attributes
            )
            sending.append((span, positions))
            if span.is_recording():
                for position in positions:
                    linked = stored_context(rows[todo[position]][HEADERS])
                    if linked is not None:
                        span.add_link(linked)
    except Exception:  # spans lost, records sent all the same
        pass
    return sending


def end_send(
    sending: Sending,
    fates: Sequence[DeliveryFate | None] | None,
    error: BaseException | None = None,
) -> None:
    """End the send spans: ERROR status on a span with records Kafka did not confirm (or
    when sending raised ``error``). Never raises."""
    for span, positions in sending:
        try:
            _report_send(span, positions, fates, error)
        except Exception:  # the span loses its status, the relay goes on
            pass
        finally:
            span.end()


_Report = TypeVar("_Report", bound=DeliveryFate)


def traced_send(
    rows: Sequence[ClaimedRow],
    send: Callable[[list[int]], list[_Report | None]],
) -> Callable[[list[int]], list[_Report | None]]:
    """``send`` inside ``send {topic}`` spans linked to the rows' stored contexts (one relay
    engine or the other); the records carry those stored contexts (their headers), never these
    spans'."""

    def traced(todo: list[int]) -> list[_Report | None]:
        sending = start_send(rows, todo)
        try:
            fates = send(todo)
        except BaseException as exc:
            end_send(sending, None, exc)
            raise
        end_send(sending, fates)
        return fates

    return traced


def _report_send(
    span: Span,
    positions: list[int],
    fates: Sequence[DeliveryFate | None] | None,
    error: BaseException | None,
) -> None:
    if error is not None:
        _failed(span, error)
    elif fates is not None:
        if len(positions) == len(fates) and all(o is not None and o.error is None for o in fates):
            return  # most sends: everything confirmed
        failed = [o for p in positions if (o := fates[p]) is not None and o.error is not None]
        unsent = sum(1 for p in positions if fates[p] is None)
        if failed:
            first = failed[0]
            span.set_status(
                Status(
                    StatusCode.ERROR,
                    f"{len(failed)} of {len(positions)} records failed: {first.error}",
                )
            )
            span.set_attribute(
                A_ERROR_TYPE, str(first.code) if first.code is not None else "delivery"
            )
        elif unsent:
            span.set_status(Status(StatusCode.ERROR, f"{unsent} records were not sent"))
            span.set_attribute(A_ERROR_TYPE, "not_sent")


# --------------------------------------------------------------------------------- process


def _carrier(headers: Sequence[tuple[str, bytes | None]] | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        lowered = name.lower()
        if value is not None and lowered in (codec.TRACEPARENT_HEADER, codec.TRACESTATE_HEADER):
            try:
                carrier[lowered] = value.decode("utf-8")
            except UnicodeDecodeError:
                continue
    return carrier


def _record_context(message: Any) -> SpanContext | None:
    """The trace context a Kafka record carries (``traceparent``/``tracestate`` headers)."""
    carrier = _carrier(message.headers())
    return _context_of(carrier) if carrier else None


_SILENT = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


def recording() -> bool:
    """False while no tracer provider is set (the API's own proxy, or its no-op provider):
    then no span is recorded, and a span only passes on a context it was given."""
    return type(trace.get_tracer_provider()) not in _SILENT


def carries_context(message: Any) -> bool:
    """True when ``message`` has a ``traceparent`` header: a context that its ``process``
    span passes on to the handler's spans and events, even when nothing is recorded."""
    for name, value in message.headers() or ():
        if value is not None and name.lower() == codec.TRACEPARENT_HEADER:
            return True
    return False


@contextmanager
def process(message: Any, group: str, link: bool) -> Iterator[Span]:
    """A current ``process {topic}`` span around the handling of ``message`` (a
    confluent-kafka ``Message``): the record's context is the parent, or with ``link`` a link
    of a new trace.

    An exception that leaves the block is recorded on the span (ERROR) and re-raised; a
    failure the caller handles is marked with :func:`failed`."""
    topic = message.topic()
    remote = _record_context(message)
    attributes = _base(topic, "process")
    attributes[A_PARTITION] = str(message.partition())
    attributes[A_OFFSET] = message.offset()
    attributes[A_GROUP] = group
    attributes[A_KAFKA_GROUP] = group
    text = _key_text(message.key())
    if text is not None:
        attributes[A_KEY] = text
    parent: Context | None = None
    links: list[Link] | None = None
    if remote is not None:
        if link:
            parent, links = Context(), [Link(remote)]  # a new trace, linked to the producer's
        else:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    with _current(f"process {topic}", parent, SpanKind.CONSUMER, attributes, links) as span:
        yield span


@contextmanager
def process_batch(messages: Sequence[Any], group: str) -> Iterator[Span]:
    """A current ``process {topic}`` span around one call of a batch handler, linked to the
    context of every message in the batch (a new trace: the messages have many parents)."""
    topics = sorted({m.topic() for m in messages})
    if len(topics) == 1:
        name, attributes = f"process {topics[0]}", _base(topics[0], "process")
    else:  # no one destination
        name = "process"
        attributes = {A_SYSTEM: SYSTEM, A_OPERATION_TYPE: "process", A_OPERATION_NAME: "process"}
    attributes[A_BATCH_COUNT] = len(messages)
    attributes[A_GROUP] = group
    attributes[A_KAFKA_GROUP] = group
    links = [Link(c) for c in map(_record_context, messages) if c is not None]
    with _current(name, Context(), SpanKind.CONSUMER, attributes, links) as span:
        yield span


def processed(span: Span, outcome: str) -> None:
    """Record what became of the message (``processed``, ``replayed``, ``retry``...)."""
    span.set_attribute(A_OUTCOME, outcome)


def failed(span: Span, exc: BaseException) -> None:
    """Mark ``span`` as failed by ``exc`` (recorded, ERROR): for a failure the caller
    handles, e.g. a message dead-lettered or retried."""
    _failed(span, exc)


# ------------------------------------------------------------------------------------ http


@contextmanager
def request(method: str, path: str, headers: Mapping[str, str]) -> Iterator[Span | None]:
    """Continue an incoming request's trace: with a ``traceparent`` header and no active span
    (no HTTP instrumentation ran before), a current SERVER span, child of that context."""
    traceparent = headers.get(codec.TRACEPARENT_HEADER)
    if traceparent is None or active():
        yield None
        return
    carrier = {codec.TRACEPARENT_HEADER: traceparent}
    tracestate = headers.get(codec.TRACESTATE_HEADER)
    if tracestate is not None:
        carrier[codec.TRACESTATE_HEADER] = tracestate
    remote = _context_of(carrier)
    if remote is None:
        yield None
        return
    parent = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    attributes: dict[str, Any] = {"http.request.method": method, "url.path": path}
    with _current(method, parent, SpanKind.SERVER, attributes) as span:
        yield span


def responded(span: Span | None, status: int) -> None:
    """Record the response status on the request's span (ERROR for a 5xx)."""
    if span is None or not status:
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
        span.set_attribute(A_ERROR_TYPE, str(status))
