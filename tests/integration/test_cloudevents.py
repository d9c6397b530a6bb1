"""CloudEvents in binary content mode through the real broker, checked with the ``cloudevents``
SDK's own Kafka binding both ways: what the relay produced parses as a CloudEvent, and what the
SDK writes runs through the consumer runner keyed by its ``ce_id``."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from typing import Any

from cloudevents.core.bindings.kafka import KafkaMessage, from_binary, to_binary
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkCloudEvent
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox import Outbox
from outbox.consumer import ConsumerRunner
from outbox.payloads import CloudEvent, read_cloudevent
from outbox.relay import Relay, RelayConfig
from tests.fixtures.consumer import KAFKA, Running, produce
from tests.fixtures.kafka import create_topic, read_to_end
from tests.fixtures.tracing import finished, traceparent_of

MOMENT = dt.datetime(2026, 11, 27, 23, 59, 1, 250000, tzinfo=dt.UTC)


def test_a_relayed_cloudevent_parses_with_the_sdk(
    database_url: str, kafka_bootstrap: str, span_exporter: InMemorySpanExporter
) -> None:
    topic = f"ce-out-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    attributes = CloudEvent(
        type="com.example.order.created", source="/services/orders", subject="order-7",
        time=MOMENT, extensions={"tenant": "acme", "priority": 2},
    )  # fmt: skip
    ob = Outbox(database_url)
    try:
        with trace.get_tracer("test").start_as_current_span("request"), ob.unit_of_work("c") as uow:
            event_id = uow.publish(
                topic, {"order": 7, "total": "9.90"}, key="order-7", cloudevent=attributes
            )
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    finally:
        ob.close()
    (record,) = read_to_end(kafka_bootstrap, topic, at_least=1)
    message = KafkaMessage(
        headers={name: bytes(value) for name, value in record.headers()},
        key=record.key(),
        value=record.value(),
    )
    event = from_binary(message, JSONFormat())
    assert event.get_id() == str(event_id)
    assert event.get_specversion() == "1.0"
    assert event.get_type() == "com.example.order.created"
    assert event.get_source() == "/services/orders"
    assert event.get_subject() == "order-7"
    assert event.get_time() == MOMENT
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == {"order": 7, "total": "9.90"}
    assert event.get_extension("tenant") == "acme" and event.get_extension("priority") == "2"
    assert event.get_extension("partitionkey") == "order-7"
    (create,) = finished(span_exporter, f"create {topic}")
    assert event.get_extension("traceparent") == traceparent_of(create.context)  # tracing ext.


def test_an_sdk_cloudevent_runs_through_the_consumer_runner_keyed_by_its_id(
    database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"ce-in-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    sdk_event = SdkCloudEvent(
        attributes={
            "id": "evt-42", "source": "/billing", "type": "com.example.invoice.paid",
            "specversion": "1.0", "time": MOMENT, "datacontenttype": "application/json",
            "partitionkey": "inv-1",
        },
        data={"invoice": 1},
    )  # fmt: skip
    message = to_binary(sdk_event, JSONFormat())
    record = {"key": message.key, "value": message.value, "headers": list(message.headers.items())}
    produce(kafka_bootstrap, topic, [record, record])  # the same event delivered twice
    marker = {"key": None, "value": b"{}", "headers": [("ce_id", b"marker"),
              ("ce_specversion", b"1.0"), ("ce_source", b"/t"), ("ce_type", b"t")]}  # fmt: skip
    produce(kafka_bootstrap, topic, [marker])
    calls: list[Any] = []
    done = threading.Event()

    def handle(uow: Any, received: Any) -> dict[str, str]:
        event = read_cloudevent(received)
        assert event is not None
        if event.id == "marker":
            done.set()
        else:
            calls.append((uow.key, event.type, event.source, event.time, received.value()))
        return {"seen": event.id}

    ob = Outbox(database_url)
    runner = ConsumerRunner(
        ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA, key_header="ce_id",
    )  # fmt: skip
    running = Running(runner, None)  # type: ignore[arg-type]
    try:
        assert done.wait(30), "the runner never reached the last record"
    finally:
        running.stop()
        ob.close()
    assert calls == [
        ("evt-42", "com.example.invoice.paid", "/billing", MOMENT, b'{"invoice": 1}')
    ]  # the duplicate was replayed by its ce_id, not handled again
