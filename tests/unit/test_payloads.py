"""Pure parts of the payload formats: CloudEvents headers and checks, what counts as a registry
out of reach, the serializer settings, and tombstones in the event encoder."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, strategies as st

from outbox import OutboxConfig
from outbox._core import cloudevents, events, validate as _validate
from outbox._core.failures import is_unreachable
from outbox._core.typed_results import TypedResult
from outbox.errors import ConfigurationError, SerializationError
from outbox.payloads import CloudEvent, cloudevent_id

MOMENT = dt.datetime(2026, 11, 27, 23, 30, 5, 123456, tzinfo=dt.timezone(dt.timedelta(hours=1)))


def _headers(event: events.Event) -> dict[str, Any]:
    stored: dict[str, Any] = json.loads(event.headers_json)
    return stored


def test_cloudevent_headers_follow_the_kafka_binding() -> None:
    event = events.encode_event(
        "orders", {"id": 1}, "o-1", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        1 << 20,
        cloudevent=CloudEvent(
            type="com.example.order.created", source="/orders", subject="o-1", time=MOMENT,
            dataschema="https://example.com/order.json", extensions={"tenant": "t1", "n": 3},
        ),
    )  # fmt: skip
    headers = _headers(event)
    assert headers["ce_specversion"] == "1.0"
    assert headers["ce_id"] == str(event.event_id)
    assert headers["ce_source"] == "/orders"
    assert headers["ce_type"] == "com.example.order.created"
    assert headers["ce_time"] == "2026-11-27T22:30:05.123456Z"
    assert headers["ce_subject"] == "o-1"
    assert headers["ce_dataschema"] == "https://example.com/order.json"
    assert headers["ce_tenant"] == "t1" and headers["ce_n"] == "3"
    assert headers["ce_traceparent"] == headers["traceparent"]  # distributed-tracing extension
    assert headers["content-type"] == "application/json"


def test_a_serialized_cloudevent_takes_its_content_type_from_the_attributes() -> None:
    event = events.encode_event(
        "orders", b"\x00\x00\x00\x00\x01", None, None, 1 << 20, serialized=True,
        cloudevent=CloudEvent(type="t", source="s", datacontenttype="application/avro"),
    )  # fmt: skip
    assert _headers(event)["content-type"] == "application/avro"
    assert "ce_traceparent" not in _headers(event)  # no trace context, no extension


def test_without_attributes_a_serialized_value_has_no_content_type() -> None:
    event = events.encode_event("orders", b"\x00", None, None, 1 << 20, serialized=True)
    assert "content-type" not in _headers(event)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "", "source": "s"},
        {"type": "t", "source": None},
        {"type": "t", "source": "s", "time": dt.datetime(2026, 1, 1)},  # naive
        {"type": "t", "source": "s", "extensions": {"Upper": "x"}},
        {"type": "t", "source": "s", "extensions": {"id": "x"}},  # a core attribute
        {"type": "t", "source": "s", "extensions": {"n": 2**31}},
        {"type": "t", "source": "s", "extensions": {"f": 1.5}},
        {"type": "t", "source": "s", "subject": "a\x00b"},
    ],
)
def test_invalid_cloudevent_attributes_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(SerializationError):
        events.encode_event("orders", b"x", None, None, 1 << 20, cloudevent=CloudEvent(**bad))


def test_ce_headers_of_the_publisher_clash_with_the_attributes() -> None:
    with pytest.raises(SerializationError, match="ce_type"):
        events.encode_event(
            "orders", b"x", None, {"ce_type": "mine"}, 1 << 20,
            cloudevent=CloudEvent(type="t", source="s"),
        )  # fmt: skip


@given(
    type_=st.text(min_size=1).filter(lambda s: "\x00" not in s),
    source=st.text(min_size=1).filter(lambda s: "\x00" not in s),
    extensions=st.dictionaries(
        st.from_regex(r"[a-z0-9]{1,20}", fullmatch=True).filter(
            lambda n: n not in {"id", "source", "specversion", "type", "datacontenttype",
                                "dataschema", "subject", "time", "data"}
        ),
        st.text().filter(lambda s: "\x00" not in s) | st.integers(-(2**31), 2**31 - 1)
        | st.booleans(),
        max_size=4,
    ),
)  # fmt: skip
def test_written_attributes_read_back(type_: str, source: str, extensions: dict[str, Any]) -> None:
    try:
        attributes = CloudEvent(type=type_, source=source, extensions=extensions).validate()
    except SerializationError:
        return  # text that is not UTF-8 (lone surrogates): refused, nothing to read
    for value in extensions.values():
        if isinstance(value, str) and value == "":
            return
    sent = cloudevents.headers(attributes, "id-1", "text/plain", {})
    received = cloudevents.read([(k, v.encode()) for k, v in sent.items()])
    assert received is not None
    assert (received.id, received.type, received.source) == ("id-1", type_, source)
    assert received.datacontenttype == "text/plain"
    expected = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in extensions.items()}
    assert received.extensions == expected


def test_records_without_the_required_attributes_are_not_cloudevents() -> None:
    assert cloudevents.read([("ce_id", b"1"), ("ce_type", b"t")]) is None
    assert cloudevents.read(None) is None

    class Message:
        def headers(self) -> list[tuple[str, bytes]]:
            return [(n, v) for n, v in (("ce_specversion", b"1.0"), ("ce_id", b"e-1"),
                                        ("ce_source", b"s"), ("ce_type", b"t"))]  # fmt: skip

    assert cloudevent_id(Message()) == "e-1"


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.http_status_code = status


class ConnectError(Exception):
    """Stands for an HTTP client's transport error (its module is set below)."""


ConnectError.__module__ = "httpx2._exceptions"


@pytest.mark.parametrize(
    ("exc", "unreachable"),
    [
        (_Status(503), True),
        (_Status(500), True),
        (_Status(429), True),
        (_Status(404), False),  # unknown subject or schema: it will not appear by itself
        (_Status(422), False),  # incompatible schema
        (_Status(409), False),
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (ConnectError("refused"), True),
        (ValueError("record contains more fields"), False),
        (TypeError("must be string"), False),
    ],
)
def test_what_counts_as_a_registry_out_of_reach(exc: BaseException, unreachable: bool) -> None:
    assert is_unreachable(exc) is unreachable


@pytest.mark.parametrize(
    "settings",
    [
        {"serializers": {"bad topic": lambda o, c: b""}},
        {"serializers": {"orders": b"not callable"}},
        {"key_serializers": {"": lambda o, c: b""}},
        {"serializers": [("orders", lambda o, c: b"")]},
    ],
)
def test_serializer_settings_are_checked(settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        OutboxConfig(**settings).validate()


def test_a_tombstone_has_no_value_and_no_content_type() -> None:
    event = events.encode_event("orders", None, "o-1", None, 1 << 20)
    assert event.value is None
    assert "content-type" not in _headers(event)


def test_a_serializer_must_return_bytes() -> None:
    with pytest.raises(SerializationError, match="not bytes"):
        events.encode_event("orders", {"x": 1}, None, None, 1 << 20, serialized=True)


def test_the_package_imports_without_the_optional_format_libraries() -> None:
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "for name in ('fastavro', 'jsonschema', 'google.protobuf', 'pydantic', 'cloudevents',\n"
        "             'confluent_kafka.schema_registry'):\n"
        "    sys.modules[name] = None  # an import of it fails\n"
        "import outbox, outbox.payloads, outbox.consumer\n"
        "from outbox._core import events\n"
        "e = events.encode_event('t', None, 'k', None, 10000,\n"
        "                        cloudevent=outbox.payloads.CloudEvent(type='t', source='s'))\n"
        "print(e.value, sys.modules['confluent_kafka.schema_registry'] is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["None", "False"]


# -- typed results (outbox._core.typed_results): encode to JSON data, decode to the declared type

_OFFSETS = st.builds(
    lambda minutes: dt.timezone(dt.timedelta(minutes=minutes)), st.integers(-23 * 60, 23 * 60)
)


@dataclasses.dataclass(frozen=True)
class _Payment:
    id: uuid.UUID
    amount: Decimal
    at: dt.datetime
    day: dt.date
    rate: float
    lines: list[Decimal]
    by_id: dict[uuid.UUID, int]
    memo: str | None


_PAYMENTS = st.builds(
    _Payment,
    id=st.uuids(),
    amount=st.decimals(allow_nan=False, allow_infinity=False),
    at=st.datetimes(timezones=st.none() | _OFFSETS),
    day=st.dates(),
    rate=st.floats(allow_nan=False, allow_infinity=False),
    lines=st.lists(st.decimals(allow_nan=False, allow_infinity=False), max_size=3),
    by_id=st.dictionaries(st.uuids(), st.integers(-(2**53), 2**53), max_size=3),
    memo=st.none() | st.text().filter(lambda s: "\x00" not in s),
)


@given(_PAYMENTS)
def test_typed_results_round_trip_through_stored_json(payment: _Payment) -> None:
    typed = TypedResult(_Payment)
    stored = _validate.dumps_json(typed.encode(payment), "uow.result")
    again = typed.decode(json.loads(stored))
    assert again == payment
    assert str(again.amount) == str(payment.amount)  # the exponent too: 1.10 stays 1.10
    assert type(again.rate) is float and all(type(x) is Decimal for x in again.lines)
    assert again.at.utcoffset() == payment.at.utcoffset()


def test_a_declared_float_comes_back_a_float_whatever_the_json_layer_reads() -> None:
    # A JSON layer may read 3.0 back as the integer 3: the declared type decides.
    assert type(TypedResult(float).decode(3)) is float
    assert TypedResult(list[float]).decode([1, 2.5]) == [1.0, 2.5]


def test_a_registry_out_of_reach_is_retried_and_a_refused_value_dead_lettered() -> None:
    from outbox._core.deadletter import Reason
    from outbox._core.disposition import Action, classify
    from outbox.errors import SerializerError

    down = SerializerError("registry down", retriable=True)
    assert classify(down, attempts=0, max_attempts=3).action is Action.RETRY
    exhausted = classify(down, attempts=2, max_attempts=3)
    assert (exhausted.action, exhausted.reason) == (Action.DEAD_LETTER, Reason.RETRIES_EXHAUSTED)
    refused = classify(SerializerError("schema says no"), attempts=0, max_attempts=3)
    assert (refused.action, refused.reason) == (Action.DEAD_LETTER, Reason.INVALID_INPUT)
