"""Serializers at the door: confluent-kafka's Schema Registry serializers (Avro, Protobuf, JSON
Schema, against its ``mock://`` registry) run inside the unit of work; what they refuse is
refused before anything is written; the relay's records read back with a plain
``DeserializingConsumer``; the consumer runner decodes with deserializers and dead-letters what
it cannot decode."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import OFFSET_BEGINNING, DeserializingConsumer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import StringDeserializer, StringSerializer
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox import Outbox, OutboxConfig
from outbox._core.deadletter import HEADER_REASON
from outbox.consumer import ConsumerRunner
from outbox.errors import SerializerError
from outbox.relay import Relay, RelayConfig
from tests.fixtures.consumer import KAFKA, Running, produce
from tests.fixtures.kafka import create_topic, read_to_end
from tests.fixtures.relay import outbox_count

AVRO_ORDER = """{
  "type": "record", "name": "Order", "namespace": "shop",
  "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "long"}]
}"""
JSON_ORDER = """{
  "title": "Order", "type": "object",
  "properties": {"id": {"type": "string"}, "amount": {"type": "integer"}},
  "required": ["id", "amount"], "additionalProperties": false
}"""


def _protobuf_order() -> Any:
    """A protobuf message class ``shop.Order`` built at run time (no generated module)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"order_{uuid.uuid4().hex[:8]}.proto", package="shop", syntax="proto3"
    )
    message = proto.message_type.add(name="Order")
    field = descriptor_pb2.FieldDescriptorProto
    message.field.add(name="id", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    message.field.add(name="amount", number=2, type=field.TYPE_INT64, label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.Order"))


def _registry() -> Any:
    return SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})


@dataclass
class Format:
    """One wire format: its serializer, the deserializer that reads it back, a value to send,
    and how a decoded value compares with a plain dict."""

    serializer: Callable[..., Any]
    deserializer: Callable[..., Any]
    value: Any
    plain: Callable[[Any], dict[str, Any]]


def _format(name: str, registry: Any) -> Format:
    if name == "avro":
        return Format(
            AvroSerializer(registry, AVRO_ORDER), AvroDeserializer(registry),
            {"id": "o-1", "amount": 42}, dict,
        )  # fmt: skip
    if name == "json-schema":
        reader = JSONDeserializer(None, schema_registry_client=registry)
        return Format(
            JSONSerializer(JSON_ORDER, registry), reader, {"id": "o-1", "amount": 42}, dict
        )
    order = _protobuf_order()
    conf = {"use.deprecated.format": False}
    return Format(
        ProtobufSerializer(order, registry, conf), ProtobufDeserializer(order, conf),
        order(id="o-1", amount=42), lambda m: {"id": m.id, "amount": m.amount},
    )  # fmt: skip


def _read_back(bootstrap: str, topic: str, value_deserializer: Any, count: int) -> list[Any]:
    """``count`` records of ``topic`` read by a plain confluent-kafka ``DeserializingConsumer``."""
    consumer = DeserializingConsumer({
        "bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "key.deserializer": StringDeserializer("utf_8"),
        "value.deserializer": value_deserializer,
    })  # fmt: skip
    got: list[Any] = []
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                got.append(message)
    finally:
        consumer.close()
    assert len(got) == count, f"read {len(got)} of {count} records from {topic}"
    return got


@pytest.mark.parametrize("name", ["avro", "protobuf", "json-schema"])
def test_relayed_records_read_back_with_a_plain_deserializing_consumer(
    name: str, database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"orders-{name}-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    wire = _format(name, _registry())
    config = OutboxConfig(
        serializers={topic: wire.serializer}, key_serializers={topic: StringSerializer("utf_8")}
    )
    ob = Outbox(database_url, config=config)
    try:
        with ob.unit_of_work(f"req-{name}") as uow:
            event_id = uow.publish(topic, wire.value, key="o-1")
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    finally:
        ob.close()
    (message,) = _read_back(kafka_bootstrap, topic, wire.deserializer, 1)
    assert message.key() == "o-1"
    assert wire.plain(message.value()) == {"id": "o-1", "amount": 42}
    headers = dict(message.headers() or [])
    assert headers["X-Idempotency-Key"] == str(event_id).encode()
    assert "content-type" not in headers  # the bytes are the serializer's, not JSON


def test_a_call_serializer_wins_over_the_topics_and_tombstones_skip_it(
    database_url: str, engine: sa.Engine
) -> None:
    registry = _registry()
    config = OutboxConfig(serializers={"orders": lambda obj, ctx: b"topic's"})
    ob = Outbox(database_url, config=config)
    try:
        with ob.unit_of_work("req-call") as uow:
            uow.publish("orders", {"id": "o-1", "amount": 1},
                        serializer=AvroSerializer(registry, AVRO_ORDER))  # fmt: skip
            uow.publish("orders", {"ignored": True})
            uow.publish("orders", None, key="o-1")
    finally:
        ob.close()
    with engine.connect() as conn:
        values = conn.execute(sa.text("SELECT value FROM outbox ORDER BY id")).scalars().all()
    assert values[0][:1] == b"\x00"  # the magic byte, then the schema id
    assert values[1:] == [b"topic's", None]


@pytest.fixture
def refusing(database_url: str) -> Iterator[Outbox]:
    ob = Outbox(database_url)
    try:
        yield ob
    finally:
        ob.close()


# What fastavro refuses (it writes a float or a bool given for a long as an integer, so those
# are not among them): a wrong type for the string, a missing or an extra field, a long out of
# range, something other than a record.
_NOT_AN_ORDER = st.one_of(
    st.fixed_dictionaries(
        {"id": st.integers() | st.none() | st.lists(st.integers()), "amount": st.integers(-10, 10)}
    ),
    st.fixed_dictionaries({"id": st.text(), "amount": st.text() | st.none()}),
    st.fixed_dictionaries({"id": st.text(), "amount": st.integers(min_value=2**63)}),
    st.fixed_dictionaries({"id": st.text()}),
    st.fixed_dictionaries({"id": st.text(), "amount": st.integers(), "extra": st.integers()}),
    st.integers() | st.lists(st.integers(), min_size=1),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=_NOT_AN_ORDER)
def test_values_that_violate_their_avro_schema_are_refused_before_commit(
    value: Any, refusing: Outbox, engine: sa.Engine
) -> None:
    serializer = AvroSerializer(_registry(), AVRO_ORDER, conf={"validate.strict": True})
    with pytest.raises(SerializerError) as caught:  # noqa: SIM117 -- the raise leaves the body
        with refusing.unit_of_work(f"bad-{uuid.uuid4().hex}") as uow:
            uow.publish("orders", value, serializer=serializer)
            uow.connection.execute(sa.text("SELECT 1"))  # never reached
    assert not caught.value.retriable
    assert "orders" in str(caught.value)
    assert outbox_count(engine) == 0
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one() == 0


def test_an_unknown_schema_is_refused_before_commit(refusing: Outbox, engine: sa.Engine) -> None:
    serializer = AvroSerializer(_registry(), AVRO_ORDER, conf={"auto.register.schemas": False})
    with pytest.raises(SerializerError, match="refused by its serializer") as caught:  # noqa: SIM117
        with refusing.unit_of_work("unknown-schema") as uow:
            uow.publish("orders", {"id": "o-1", "amount": 1}, serializer=serializer)
    assert not caught.value.retriable
    assert outbox_count(engine) == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_registry_is_a_retriable_refusal_before_commit(
    refusing: Outbox, engine: sa.Engine
) -> None:
    registry = SchemaRegistryClient(
        {"url": f"http://127.0.0.1:{_closed_port()}", "max.retries": 0, "timeout": 5}
    )
    with pytest.raises(SerializerError, match="could not reach its schema registry") as caught:  # noqa: SIM117
        with refusing.unit_of_work("registry-down") as uow:
            uow.publish("orders", {"id": "o-1", "amount": 1},
                        serializer=AvroSerializer(registry, AVRO_ORDER))  # fmt: skip
    assert caught.value.retriable
    assert outbox_count(engine) == 0


def test_the_keyless_publish_serializes_too(database_url: str, engine: sa.Engine) -> None:
    serializer = AvroSerializer(_registry(), AVRO_ORDER)
    ob = Outbox(database_url)
    try:
        with pytest.raises(SerializerError), ob.engine.begin() as conn:
            ob.publish(conn, "orders", {"id": 1}, serializer=serializer)
        with ob.engine.begin() as conn:
            ob.publish(conn, "orders", {"id": "o-1", "amount": 1}, serializer=serializer)
    finally:
        ob.close()
    with engine.connect() as conn:
        values = conn.execute(sa.text("SELECT value FROM outbox")).scalars().all()
    assert len(values) == 1 and values[0][:1] == b"\x00"


def test_the_consumer_runner_decodes_and_dead_letters_what_it_cannot_decode(
    database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"avro-in-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    registry = _registry()
    good = AvroSerializer(registry, AVRO_ORDER)
    from confluent_kafka.serialization import MessageField, SerializationContext

    encoded = good({"id": "o-1", "amount": 7}, SerializationContext(topic, MessageField.VALUE))
    produce(kafka_bootstrap, topic, [
        {"key": b"o-0", "value": b"not avro at all", "headers": [("X-Idempotency-Key", b"m-0")]},
        {"key": b"o-1", "value": encoded, "headers": [("X-Idempotency-Key", b"m-1")]},
        {"key": b"o-2", "value": None, "headers": [("X-Idempotency-Key", b"m-2")]},
    ])  # fmt: skip
    seen: list[Any] = []
    done = threading.Event()

    def handle(uow: Any, message: Any) -> None:
        seen.append((message.key(), message.value()))
        if len(seen) == 2:
            done.set()

    ob = Outbox(database_url)
    runner = ConsumerRunner(
        ob, handle, topics=[topic], group=f"g-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
        value_deserializer=AvroDeserializer(registry), key_deserializer=StringDeserializer(),
    )  # fmt: skip
    running = Running(runner, None)  # type: ignore[arg-type]
    try:
        assert done.wait(30), f"the decodable messages never reached the handler: {seen}"
        letters = read_to_end(kafka_bootstrap, topic + ".dlq", at_least=1)
    finally:
        running.stop()
        ob.close()
    assert seen == [("o-1", {"id": "o-1", "amount": 7}), ("o-2", None)]
    assert [m.value() for m in letters] == [b"not avro at all"]  # the original bytes
    assert dict(letters[0].headers())[HEADER_REASON] == b"permanent-error"


def test_a_registry_out_of_reach_while_decoding_is_retried_then_dead_lettered(
    database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"avro-down-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, topic, partitions=1)
    create_topic(kafka_bootstrap, topic + ".dlq", partitions=1)
    wire_format = b"\x00\x00\x00\x00\x01\x02a\x06"  # magic byte, schema id 1, a record
    produce(kafka_bootstrap, topic, [
        {"key": b"o-1", "value": wire_format, "headers": [("X-Idempotency-Key", b"m-1")]},
    ])  # fmt: skip
    registry = SchemaRegistryClient(
        {"url": f"http://127.0.0.1:{_closed_port()}", "max.retries": 0, "timeout": 5}
    )
    called: list[Any] = []
    ob = Outbox(database_url)
    runner = ConsumerRunner(
        ob, lambda uow, message: called.append(message), topics=[topic],
        group=f"g-{uuid.uuid4().hex[:8]}", bootstrap_servers=kafka_bootstrap, kafka_config=KAFKA,
        max_attempts=3, retry_backoff=0.05, retry_backoff_max=0.1,
        value_deserializer=AvroDeserializer(registry),
    )  # fmt: skip
    running = Running(runner, None)  # type: ignore[arg-type]
    try:
        letters = read_to_end(kafka_bootstrap, topic + ".dlq", at_least=1)
    finally:
        running.stop()  # the runner kept running: no crash, no endless loop
        ob.close()
    assert called == []
    headers = dict(letters[0].headers())
    assert headers[HEADER_REASON] == b"retries-exhausted"  # retried, not refused at once
    assert letters[0].value() == wire_format
