"""Tracing through the outbox, recorded by the OpenTelemetry SDK's in-memory exporter.

The unit of work and the relay run in-process here, on real PostgreSQL and a real broker; the
trace that crosses processes (HTTP server, relay process, consumer) is in
``tests/e2e/test_tracing_e2e.py``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.errors import SerializationError
from outbox.relay import Relay, RelayConfig
from tests.fixtures.relay import insert_rows, wait_for_records
from tests.fixtures.tracing import finished, traceparent_of

tracer = trace.get_tracer("tests")


def _topic(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _stored_headers(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    """Each outbox row's stored headers, by event id."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT event_id, headers FROM outbox ORDER BY id"))
        return {str(r.event_id): r.headers for r in rows}


def test_publish_under_a_span_stores_the_create_span_context(
    engine: sa.Engine, database_url: str, span_exporter: InMemorySpanExporter
) -> None:
    ob = Outbox(database_url)
    try:
        with tracer.start_as_current_span("request") as request:
            with ob.unit_of_work("traced-1") as uow:
                in_uow = uow.publish("orders.created", {"id": 1}, key="order-1")
            with Session(ob.engine) as session, session.begin():
                keyless = ob.publish(session, "orders.audit", b"raw", key=b"\xff")
    finally:
        ob.close()
    creates = {s.attributes["messaging.message.id"]: s for s in finished(span_exporter)
               if s.name.startswith("create ")}  # fmt: skip
    assert set(creates) == {str(in_uow), str(keyless)}
    stored = _stored_headers(engine)
    root = request.get_span_context()
    for event_id, topic in ((in_uow, "orders.created"), (keyless, "orders.audit")):
        span = creates[str(event_id)]
        assert span.name == f"create {topic}"
        assert span.kind is SpanKind.PRODUCER
        assert span.parent is not None and span.parent.span_id == root.span_id
        context = span.get_span_context()
        assert context.trace_id == root.trace_id
        # The row carries the create span's own context, not the request's.
        assert stored[str(event_id)]["traceparent"] == traceparent_of(context)
        attributes = span.attributes or {}
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.operation.type"] == "create"
    assert creates[str(in_uow)].attributes["messaging.kafka.message.key"] == "order-1"
    assert "messaging.kafka.message.key" not in creates[str(keyless)].attributes  # not UTF-8


def test_publish_without_an_active_span_stores_no_context(
    engine: sa.Engine, database_url: str, span_exporter: InMemorySpanExporter
) -> None:
    ob = Outbox(database_url)
    try:
        with ob.unit_of_work("untraced-1") as uow:
            uow.publish("orders.created", {"id": 1})
    finally:
        ob.close()
    (headers,) = _stored_headers(engine).values()
    assert "traceparent" not in headers
    assert finished(span_exporter) == []


def test_a_traceparent_set_by_the_publisher_is_kept(
    engine: sa.Engine, database_url: str, span_exporter: InMemorySpanExporter
) -> None:
    own = "00-00000000000000000000000000000abc-0000000000000def-01"
    ob = Outbox(database_url)
    try:
        with tracer.start_as_current_span("request"), ob.unit_of_work("explicit-1") as uow:
            uow.publish("orders.created", {"id": 1}, headers={"TraceParent": own})
    finally:
        ob.close()
    (headers,) = _stored_headers(engine).values()
    assert headers["TraceParent"] == own
    assert "traceparent" not in headers and "tracestate" not in headers
    assert [s.name for s in finished(span_exporter)] == ["create orders.created", "request"]


def test_a_failed_publish_is_an_error_on_its_span(
    database_url: str, span_exporter: InMemorySpanExporter
) -> None:
    ob = Outbox(database_url)
    try:
        with tracer.start_as_current_span("request"), ob.unit_of_work("bad-1") as uow:
            with pytest.raises(SerializationError) as refused:
                uow.publish("orders.created", {"n": float("nan")})
            error = refused.value
    finally:
        ob.close()
    (create,) = finished(span_exporter, "create orders.created")
    assert create.status.status_code is StatusCode.ERROR
    assert [e.name for e in create.events] == ["exception"]
    assert create.attributes["error.type"] == type(error).__qualname__


def test_the_relay_links_send_spans_and_sends_the_stored_contexts(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    span_exporter: InMemorySpanExporter,
) -> None:
    first, second = _topic("traced-a"), _topic("traced-b")
    ob = Outbox(database_url)
    published: dict[str, str] = {}
    try:
        for n, topic in enumerate((first, first, second)):
            with tracer.start_as_current_span(f"request-{n}"), ob.unit_of_work(f"k{n}") as uow:
                published[str(uow.publish(topic, {"n": n}, key=f"key-{n}"))] = topic
        untraced = insert_rows(engine, first, [("plain", b"no context")])
    finally:
        ob.close()
    stored = _stored_headers(engine)
    span_exporter.clear()
    # Even a span current around the relay never reaches the records.
    with tracer.start_as_current_span("around-the-relay") as around:
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0

    in_first = [e for e, t in published.items() if t == first]
    in_second = [e for e, t in published.items() if t == second]
    records = wait_for_records(kafka_bootstrap, first, [*untraced, *in_first])
    records += wait_for_records(kafka_bootstrap, second, in_second)
    by_id = {r.event_id: r for r in records}
    for event_id in published:
        assert by_id[event_id].headers["traceparent"].decode() == stored[event_id]["traceparent"]
    assert "traceparent" not in by_id[str(untraced[0])].headers
    around_trace = around.get_span_context().trace_id
    assert all(f"{around_trace:032x}" not in r.headers.get("traceparent", b"").decode()
               for r in records)  # fmt: skip

    sends = {s.name: s for s in finished(span_exporter) if s.name.startswith("send ")}
    assert set(sends) == {f"send {first}", f"send {second}"}
    for topic, count in ((first, 3), (second, 1)):
        span = sends[f"send {topic}"]
        assert span.kind is SpanKind.PRODUCER
        attributes = span.attributes or {}
        assert attributes["messaging.operation.type"] == "send"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.batch.message_count"] == count
        linked = {traceparent_of(link.context) for link in span.links}
        expected = {stored[e]["traceparent"] for e, t in published.items() if t == topic}
        assert linked == expected
        assert span.status.status_code is StatusCode.UNSET


def test_a_send_span_of_a_refused_record_is_an_error(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    span_exporter: InMemorySpanExporter,
) -> None:
    topic = _topic("traced-big")
    ob = Outbox(database_url)
    try:
        with tracer.start_as_current_span("request"), ob.unit_of_work("big-1") as uow:
            uow.publish(topic, b"x" * 200_000, key="big")
    finally:
        ob.close()
    config = RelayConfig(
        database_url, kafka_bootstrap, kafka_config={"message.max.bytes": "100000"}
    )
    assert Relay(config).run(once=True) == 0
    (send,) = finished(span_exporter, f"send {topic}")
    assert send.status.status_code is StatusCode.ERROR
    assert "MSG_SIZE_TOO_LARGE" in (send.status.description or "")
    with engine.connect() as conn:
        parked = conn.execute(sa.text("SELECT count(*) FROM outbox WHERE parked_at IS NOT NULL"))
        assert parked.scalar_one() == 1


def test_stored_headers_stay_json_objects(
    engine: sa.Engine, database_url: str, span_exporter: InMemorySpanExporter
) -> None:
    """The context is stored like any header: the relay reads it with the others."""
    ob = Outbox(database_url)
    try:
        with tracer.start_as_current_span("request"), ob.unit_of_work("json-1") as uow:
            uow.publish("t", {"a": 1}, headers={"source": "api"})
    finally:
        ob.close()
    with engine.connect() as conn:
        text = conn.execute(sa.text("SELECT headers::text FROM outbox")).scalar_one()
    stored = json.loads(text)
    assert set(stored) == {"source", "content-type", "traceparent"}
