"""One trace from a client's request to the consumer of the event it caused, across processes.

client span (this process) -> HTTP server process (uvicorn or gunicorn, behind the idempotency
middleware, its spans written to a file) -> the outbox row -> ``outbox-relay`` in a process of
its own (no SDK: it must pass the stored context on untouched) -> the Kafka record -> the
consumer runner's ``process`` span (this process, in-memory exporter).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox import Outbox
from outbox.consumer import ConsumerRunner
from tests.fixtures.common import ServiceUnavailable, unavailable, wait_for
from tests.fixtures.consumer import KAFKA, Running
from tests.fixtures.kafka import create_topic
from tests.fixtures.processes import stop_process
from tests.fixtures.relay import start_relay
from tests.fixtures.tracing import finished, read_span_file, traceparent_of
from tests.fixtures.uow import create_orders
from tests.fixtures.web import HOW_HTTP, SERVERS, WebServer

tracer = trace.get_tracer("tests")
TOPIC = "orders.created"  # what the test apps publish


@pytest.fixture(params=["asgi", "wsgi"])
def traced_app(
    request: pytest.FixtureRequest, engine: sa.Engine, database_url: str, tmp_path: Path
) -> Iterator[tuple[WebServer, Path]]:
    create_orders(engine)
    spans_file = tmp_path / "server-spans.jsonl"
    argv = [a.replace("http_asgi:app", "http_asgi:outer") for a in SERVERS[request.param][1]]
    server = WebServer(
        request.param,
        {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": "",
         "OUTBOX_TEST_SPANS_FILE": str(spans_file)},
        argv,
    )  # fmt: skip
    try:
        server.start()
    except ServiceUnavailable as exc:
        server.close()
        unavailable(f"HTTP server ({request.param})", str(exc), HOW_HTTP)
    try:
        yield server, spans_file
    finally:
        server.stop()
        server.close()


@pytest.mark.slow
def test_one_trace_from_the_request_through_the_relay_process_to_the_consumer(
    traced_app: tuple[WebServer, Path],
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    span_exporter: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    server, spans_file = traced_app
    create_topic(kafka_bootstrap, TOPIC)
    create_topic(kafka_bootstrap, TOPIC + ".dlq")

    # 1. A client request under a span of this process.
    with tracer.start_as_current_span("client", kind=SpanKind.CLIENT) as client:
        headers = {"Idempotency-Key": f"trace-{uuid.uuid4().hex}"}
        TraceContextTextMapPropagator().inject(headers)
        answer = httpx.post(f"{server.url}/orders", json={"amount": 7}, headers=headers)
    assert answer.status_code == 201, answer.text
    trace_id = client.get_span_context().trace_id

    # 2. The server continued the request's trace, and the row stores the create span's context.
    with engine.connect() as conn:
        event_id, stored = conn.execute(sa.text("SELECT event_id, headers FROM outbox")).one()
    wait_for(
        lambda: {"POST", f"create {TOPIC}"} <= {s.name for s in read_span_file(spans_file)},
        10,
        "the server's spans",
    )
    server_spans = read_span_file(spans_file)
    (request,) = [s for s in server_spans if s.name == "POST"]  # the middleware's own
    (create,) = [s for s in server_spans if s.name == f"create {TOPIC}"]
    assert request.kind == "SERVER"
    assert request.trace_id == trace_id
    assert request.parent_id == client.get_span_context().span_id
    assert request.attributes["http.request.method"] == "POST"
    assert request.attributes["http.response.status_code"] == 201
    assert create.kind == "PRODUCER" and create.trace_id == trace_id
    # The create span descends from the client's span. Flask adds no span of its own: the path
    # goes through the middleware's request span. Recent FastAPI versions open a request span
    # from the incoming traceparent header, beside the middleware's.
    by_id = {s.span_id: s for s in server_spans}
    top = create
    while top.parent_id in by_id:
        top = by_id[top.parent_id]
    assert top.parent_id == client.get_span_context().span_id
    if server.flavour == "wsgi":
        assert top is request
    assert stored["traceparent"].startswith(f"00-{trace_id:032x}-{create.span_id:016x}-")

    # 3. The relay, a process of its own, sends the record with the stored context.
    handled: dict[str, dict[str, bytes]] = {}
    lock = threading.Lock()

    def handle(uow: Any, message: Any) -> None:
        with lock:
            handled[uow.key] = dict(message.headers() or [])

    relay = start_relay(database_url, kafka_bootstrap, log_path=tmp_path / "relay.log")
    ob = Outbox(database_url)
    runner = ConsumerRunner(
        ob, handle, topics=[TOPIC], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
    )  # fmt: skip
    running = Running(runner, None)  # type: ignore[arg-type]
    try:
        wait_for(lambda: str(event_id) in handled, 60, "the event at the consumer")
    finally:
        running.stop()
        ob.close()
        stop_process(relay, 15)
    assert handled[str(event_id)]["traceparent"].decode() == stored["traceparent"]

    # 4. The consumer's process span continues the same trace, under the create span.
    process = [
        s
        for s in finished(span_exporter, f"process {TOPIC}")
        if s.attributes["messaging.kafka.offset"] is not None
        and s.get_span_context().trace_id == trace_id
    ]
    assert len(process) == 1
    assert process[0].parent is not None and process[0].parent.span_id == create.span_id
    assert traceparent_of(process[0].parent).split("-")[1] == f"{trace_id:032x}"
