"""The relay's other pure parts: Kafka records of claimed rows, producer settings, backoff,
config (the per-batch decisions are in test_delivery.py)."""

from __future__ import annotations

import random

import pytest

from outbox._core.delivery import ClaimedRow
from outbox._core.retry import backoff_delay
from outbox._kafka.producer import NOT_SENT, is_permanent, producer_config
from outbox._kafka.records import build_record, build_records, build_records_checked
from outbox.errors import ConfigurationError
from outbox.relay import RelayConfig


def test_backoff_is_capped_exponential_with_jitter() -> None:
    rng = random.Random(1)
    for failures, upper in [(1, 0.2), (2, 0.4), (5, 3.2), (20, 30.0)]:
        d = backoff_delay(failures, 0.2, 30.0, rng.random)
        assert upper / 2 <= d <= upper


def test_record_gets_the_event_id_unless_the_publisher_set_one() -> None:
    r = build_record("t", b"k", b"v", {"a": "1"}, "e-1")
    assert r.headers == [("a", b"1"), ("X-Idempotency-Key", b"e-1")]
    own = build_record("t", None, b"v", {"x-idempotency-key": "mine"}, "e-2")
    assert own.headers == [("x-idempotency-key", b"mine")]


def test_producer_config_keeps_the_guarantees() -> None:
    config = producer_config("b:9092", {"linger.ms": "50", "security.protocol": "SASL_SSL"})
    assert config["enable.idempotence"] == "true" and config["acks"] == "all"
    assert config["partitioner"] == "murmur2_random" and config["linger.ms"] == "50"
    assert producer_config("b", {"partitioner": "consistent_random"})["partitioner"] == (
        "consistent_random"
    )
    for bad in ({"acks": "1"}, {"enable.idempotence": "false"}, {"transactional.id": "x"}):
        with pytest.raises(ConfigurationError):
            producer_config("b", bad)
    with pytest.raises(ConfigurationError, match=r"message\.timeout\.ms=0 is not allowed"):
        producer_config("b", {"message.timeout.ms": "0"})
    with pytest.raises(ConfigurationError, match=r"message\.timeout\.ms=0 is not allowed"):
        producer_config("b", {"delivery.timeout.ms": "0"})  # librdkafka's alias
    aliased = producer_config("b", {"delivery.timeout.ms": "45000"})
    assert aliased["message.timeout.ms"] == "45000" and "delivery.timeout.ms" not in aliased
    assert producer_config("b", {"acks": "-1"})["acks"] == "all"


def test_permanent_error_codes() -> None:
    from confluent_kafka import KafkaError

    assert is_permanent(KafkaError.MSG_SIZE_TOO_LARGE)
    assert is_permanent(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert not is_permanent(KafkaError._MSG_TIMED_OUT)
    assert not is_permanent(KafkaError.NOT_LEADER_FOR_PARTITION)


@pytest.mark.parametrize(
    ("field", "value"),
    [("batch_size", 0), ("lanes", 0), ("max_attempts", 0), ("poll_interval", 0.0)],
)
def test_config_validation_says_which_flag(field: str, value: object) -> None:
    config = RelayConfig("postgresql://h/db", "b:9092", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="--" + field.replace("_", "-")):
        config.validate()


def _row(row_id: int, key: bytes | None, headers: str = "{}") -> ClaimedRow:
    return (row_id, 0, "t", key, b"v", headers, f"e-{row_id}".encode(), False)


def test_records_of_claimed_rows_share_cached_headers_safely() -> None:
    rows = [_row(1, b"k", '{"a": "1"}'), _row(2, None, '{"a": "1"}')]
    first, second = build_records(rows)
    assert first == ("t", b"k", b"v", [("a", b"1"), ("X-Idempotency-Key", b"e-1")])
    assert second[3] == [("a", b"1"), ("X-Idempotency-Key", b"e-2")]
    own = build_records([_row(3, b"k", '{"X-Idempotency-Key": "mine"}')])[0]
    assert own[3] == [("X-Idempotency-Key", b"mine")]
    assert build_records(rows)[0][3] == first[3]  # the cached header list was not mutated


def test_rows_that_cannot_become_records_are_told_apart_by_index() -> None:
    good, bad = _row(1, b"a", '{"a": "1"}'), _row(2, b"a", '{"h": {}}')
    records, broken = build_records_checked([good, bad, _row(3, None, "not json")])
    assert records[0] == build_records([good])[0]
    assert records[1] is None and records[2] is None
    assert set(broken) == {1, 2}
    assert broken[1].startswith("row cannot be turned into a record: ")


def test_records_without_a_report_by_the_deadline_are_retriable_and_rebuild_the_producer() -> None:
    """librdkafka reports every record within message.timeout.ms; should it not, the records
    are failed as a retriable outage with a stale producer, never left without an outcome."""
    import threading

    from confluent_kafka import KafkaError

    from outbox._kafka.producer import KafkaProducer

    class Silent:  # accepts records and never reports them
        def produce(self, *args: object, **kwargs: object) -> None:
            return None

        def flush(self, timeout: float) -> int:
            return 1

    producer = KafkaProducer("127.0.0.1:9", {})
    producer._producer = Silent()  # type: ignore[assignment]
    producer.message_timeout = -4.9  # the deadline is message_timeout + 5 s: 0.1 s from now
    outcomes = producer.send([("t", b"k", b"v", [])], threading.Event())
    assert len(outcomes) == 1 and not outcomes[0].ok
    assert outcomes[0].code == KafkaError._MSG_TIMED_OUT
    assert outcomes[0].stale_producer and not outcomes[0].permanent
    stopped = threading.Event()
    stopped.set()
    assert producer.send([("t", b"k", b"v", [])], stopped, grace=0.05) == [NOT_SENT]
