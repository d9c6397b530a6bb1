"""The consumer runner's ``process`` spans (sync and asyncio runners, alone and in micro-batches),
recorded by the OpenTelemetry SDK's in-memory exporter, on a real broker and database."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from outbox import AsyncOutbox, Outbox, PermanentError
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, batch_handler
from outbox.guard import RedisGuard
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA, Running, produce, topic_with_dead_letters
from tests.fixtures.guard import new_prefix
from tests.fixtures.tracing import finished, traceparent_of

tracer = trace.get_tracer("tests")


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    return topic_with_dead_letters(kafka_bootstrap, "traced", partitions=1)


Start = Callable[..., Running]


@pytest.fixture(params=["sync-alone", "sync-batches", "async-batches"])
def start(
    request: pytest.FixtureRequest, kafka_bootstrap: str, database_url: str
) -> Iterator[Start]:
    """Start a runner of the flavour and batch size the parameter names."""
    flavour, batching = request.param.split("-")
    running: list[Running] = []

    def make(handler: Any, topic: str, **options: Any) -> Running:
        options.setdefault("group", f"g-{uuid.uuid4().hex[:8]}")
        options["batch_size"] = 1 if batching == "alone" else 500
        registry = options.setdefault("metrics_registry", CollectorRegistry())
        if flavour == "async":
            runner: Any = AsyncConsumerRunner(
                AsyncOutbox(database_url), _async(handler), topics=[topic],
                bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA, **options,
            )  # fmt: skip
        else:
            ob = Outbox(database_url)
            closing.append(ob)
            runner = ConsumerRunner(
                ob, handler, topics=[topic], bootstrap_servers=kafka_bootstrap,
                kafka_config=KAFKA, **options,
            )  # fmt: skip
        r = Running(runner, registry)
        running.append(r)
        return r

    closing: list[Outbox] = []
    try:
        yield make
    finally:
        for r in running:
            r.stop()
        for ob in closing:
            ob.close()


def _async(handler: Any) -> Any:
    if getattr(handler, "__outbox_batch_handler__", False):

        @batch_handler
        async def handle_batch(batch: Any) -> Any:
            return handler(batch)

        return handle_batch

    async def handle(uow: Any, message: Any) -> Any:
        return handler(uow, message)

    return handle


def _produce_traced(bootstrap: str, topic: str, n: int) -> list[trace.SpanContext]:
    """``n`` records, each produced under a span of its own trace; their contexts."""
    contexts = []
    records = []
    for i in range(n):
        with tracer.start_as_current_span(f"producer-{i}") as span:
            context = span.get_span_context()
        contexts.append(context)
        records.append(
            {
                "value": f"v{i}".encode(),
                "headers": [
                    ("X-Idempotency-Key", f"key-{i}".encode()),
                    ("traceparent", traceparent_of(context).encode()),
                ],
            }
        )
    produce(bootstrap, topic, records)
    return contexts


def _process_spans(exporter: InMemorySpanExporter, topic: str, n: int) -> list[ReadableSpan]:
    wait_for(lambda: len(finished(exporter, f"process {topic}")) >= n, 30, "process spans")
    return sorted(
        finished(exporter, f"process {topic}"), key=lambda s: s.attributes["messaging.kafka.offset"]
    )


def test_each_message_is_processed_in_a_child_span_of_its_record_context(
    kafka_bootstrap: str,
    topic: str,
    engine: sa.Engine,
    start: Start,
    span_exporter: InMemorySpanExporter,
) -> None:
    contexts = _produce_traced(kafka_bootstrap, topic, 3)
    seen: list[tuple[int, int]] = []

    def handle(uow: Any, message: Any) -> None:
        current = trace.get_current_span().get_span_context()
        seen.append((current.trace_id, current.span_id))
        uow.publish("replies", {"to": message.value().decode()})

    running = start(handle, topic, group="tracing-group")
    spans = _process_spans(span_exporter, topic, 3)
    running.stop()
    creates = {s.parent.span_id: s for s in finished(span_exporter, "create replies") if s.parent}
    with engine.connect() as conn:
        stored = list(conn.execute(sa.text("SELECT headers FROM outbox")).scalars())
    stored_parents = {h["traceparent"] for h in stored}
    assert len(spans) == 3
    for offset, (span, producer) in enumerate(zip(spans, contexts, strict=True)):
        context = span.get_span_context()
        assert span.kind is SpanKind.CONSUMER
        assert context.trace_id == producer.trace_id  # one trace from the producer on
        assert span.parent is not None and span.parent.span_id == producer.span_id
        assert (context.trace_id, context.span_id) in seen  # the handler ran inside it
        attributes = span.attributes or {}
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == topic
        assert attributes["messaging.destination.partition.id"] == "0"
        assert attributes["messaging.kafka.offset"] == offset
        assert attributes["messaging.consumer.group.name"] == "tracing-group"
        assert attributes["messaging.kafka.consumer.group"] == "tracing-group"
        assert attributes["outbox.consumer.outcome"] == "processed"
        # The event the handler published continues the same trace, under this span.
        create = creates[context.span_id]
        assert create.get_span_context().trace_id == producer.trace_id
        assert traceparent_of(create.get_span_context()) in stored_parents


def test_link_mode_starts_a_trace_linked_to_the_record_context(
    kafka_bootstrap: str, topic: str, start: Start, span_exporter: InMemorySpanExporter
) -> None:
    contexts = _produce_traced(kafka_bootstrap, topic, 2)
    running = start(lambda uow, message: None, topic, trace_context="link")
    spans = _process_spans(span_exporter, topic, 2)
    running.stop()
    for span, producer in zip(spans, contexts, strict=True):
        assert span.parent is None
        assert span.get_span_context().trace_id != producer.trace_id
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (producer.trace_id, producer.span_id)
        ]


def test_failures_are_recorded_on_the_process_span(
    kafka_bootstrap: str, topic: str, start: Start, span_exporter: InMemorySpanExporter
) -> None:
    class Refused(PermanentError):
        pass

    calls = {"transient": 0}

    def handle(uow: Any, message: Any) -> None:
        if message.value() == b"v0":
            raise Refused("never valid")
        calls["transient"] += 1
        if calls["transient"] == 1:
            raise RuntimeError("try again")

    _produce_traced(kafka_bootstrap, topic, 2)
    running = start(handle, topic, retry_backoff=0.01)
    spans = _process_spans(span_exporter, topic, 3)  # v0 once; v1 failed, then processed
    running.stop()
    outcomes = [(s.attributes["messaging.kafka.offset"], s.attributes["outbox.consumer.outcome"],
                 s.status.status_code) for s in spans]  # fmt: skip
    assert outcomes[0] == (0, "dead_lettered", StatusCode.ERROR)
    assert (1, "retry", StatusCode.ERROR) in outcomes
    assert outcomes[-1] == (1, "processed", StatusCode.UNSET)
    dead = spans[0]
    assert dead.attributes["error.type"].endswith("Refused")
    assert [e.name for e in dead.events] == ["exception"]


def test_a_batch_handler_runs_in_one_span_linked_to_every_message(
    kafka_bootstrap: str,
    topic: str,
    start: Start,
    span_exporter: InMemorySpanExporter,
    request: pytest.FixtureRequest,
) -> None:
    batching = request.node.callspec.params["start"].endswith("-batches")
    contexts = _produce_traced(kafka_bootstrap, topic, 4)
    sizes: list[int] = []

    @batch_handler
    def handle(batch: Any) -> None:
        sizes.append(len(list(batch)))

    # All four are in the topic before the runner starts, and a batching runner waits up to
    # its poll timeout to fill a batch: it hands them over in one call.
    running = start(handle, topic, batch_wait=1.0, poll_timeout=1.0)
    wait_for(lambda: sum(sizes) >= 4, 30, "the batch handler's calls")
    running.stop()
    groups = [s for s in finished(span_exporter, f"process {topic}") if s.links]
    linked = {(link.context.trace_id, link.context.span_id) for s in groups for link in s.links}
    if batching:  # one call with the four messages: one span, a link per message
        assert sizes == [4]
        assert [s.attributes["messaging.batch.message_count"] for s in groups] == [4]
    else:
        assert sizes == [1, 1, 1, 1]
    assert {(c.trace_id, c.span_id) for c in contexts} <= linked | {
        (s.parent.trace_id, s.parent.span_id)
        for s in finished(span_exporter, f"process {topic}")
        if s.parent is not None
    }


def test_a_guarded_consumer_processes_each_message_in_its_record_s_trace(
    kafka_bootstrap: str, topic: str, redis_url: str, span_exporter: InMemorySpanExporter
) -> None:
    contexts = _produce_traced(kafka_bootstrap, topic, 2)
    # A redelivery of the first record: the guard replays it, in a span of its own trace too.
    produce(kafka_bootstrap, topic, [{"value": b"v0", "headers": [
        ("X-Idempotency-Key", b"key-0"), ("traceparent", traceparent_of(contexts[0]).encode()),
    ]}])  # fmt: skip
    seen: list[int] = []

    def handle(claim: Any, message: Any) -> str:
        seen.append(trace.get_current_span().get_span_context().trace_id)
        return message.value().decode()

    guard = RedisGuard(redis_url, prefix=new_prefix())
    registry = CollectorRegistry()
    runner = ConsumerRunner(guard, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
                            bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
                            metrics_registry=registry)  # fmt: skip
    running = Running(runner, registry)
    try:
        spans = _process_spans(span_exporter, topic, 3)
    finally:
        running.stop()
        guard.close()
    outcomes = [(s.get_span_context().trace_id, s.attributes["outbox.consumer.outcome"])
                for s in spans]  # fmt: skip
    assert outcomes == [
        (contexts[0].trace_id, "processed"),
        (contexts[1].trace_id, "processed"),
        (contexts[0].trace_id, "replayed"),
    ]
    assert seen == [contexts[0].trace_id, contexts[1].trace_id]  # the handler ran inside them
