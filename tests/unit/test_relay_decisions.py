"""The relay's other pure parts: Kafka records of claimed rows, producer settings, backoff,
config (the per-batch decisions are in test_delivery.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from outbox._core.delivery import ClaimedRow
from outbox._core.retry import backoff_delay
from outbox._kafka.producer import NOT_SENT, is_undeliverable, producer_config
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
    assert config["enable.gapless.guarantee"] == "true"
    for bad in (
        {"acks": "1"},
        {"enable.idempotence": "false"},
        {"enable.gapless.guarantee": "false"},
        {"transactional.id": "x"},
        {"partitioner": "random"},  # a key's records would spread over partitions
    ):
        with pytest.raises(ConfigurationError):
            producer_config("b", bad)
    with pytest.raises(ConfigurationError, match=r"message\.timeout\.ms=0 is not allowed"):
        producer_config("b", {"message.timeout.ms": "0"})
    with pytest.raises(ConfigurationError, match=r"message\.timeout\.ms=0 is not allowed"):
        producer_config("b", {"delivery.timeout.ms": "0"})  # librdkafka's alias
    aliased = producer_config("b", {"delivery.timeout.ms": "45000"})
    assert aliased["message.timeout.ms"] == "45000" and "delivery.timeout.ms" not in aliased
    assert producer_config("b", {"acks": "-1"})["acks"] == "all"


def test_undeliverable_error_codes() -> None:
    from confluent_kafka import KafkaError

    assert is_undeliverable(KafkaError.MSG_SIZE_TOO_LARGE)
    assert is_undeliverable(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert not is_undeliverable(KafkaError._MSG_TIMED_OUT)
    assert not is_undeliverable(KafkaError.NOT_LEADER_FOR_PARTITION)


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
    """The relay enforces message.timeout.ms on a send: then everything outstanding is purged;
    a record whose fate is still unknown is failed as a retriable outage with a stale producer,
    never counted as confirmed."""
    import threading

    from confluent_kafka import KafkaError

    from outbox._kafka.producer import KafkaProducer

    class Silent:  # accepts records and never reports them
        purged = 0

        def produce(self, *args: object, **kwargs: object) -> None:
            return None

        def flush(self, timeout: float) -> int:
            return 1

        def purge(self, **kwargs: object) -> None:
            self.purged += 1

    producer = KafkaProducer("127.0.0.1:9", {})
    silent = Silent()
    producer._producer = silent  # type: ignore[assignment]
    producer.message_timeout = 0.1
    outcomes = producer.send([("t", b"k", b"v", [])], threading.Event())
    assert len(outcomes) == 1 and outcomes[0] is not None and not outcomes[0].ok
    assert outcomes[0].code == KafkaError._MSG_TIMED_OUT
    assert outcomes[0].stale_producer and not outcomes[0].permanent
    assert silent.purged == 1
    stopped = threading.Event()
    stopped.set()
    assert producer.send([("t", b"k", b"v", [])], stopped, grace=0.05) == [NOT_SENT]


def test_a_record_refused_on_the_spot_holds_back_the_later_records_of_its_key() -> None:
    """No gap: once produce() refused a record, no later record of its key goes out in the
    same send; other keys and key-less records do."""
    import threading

    from confluent_kafka import KafkaError, KafkaException

    from outbox._kafka.producer import KafkaProducer

    class Refusing:
        produced: list[bytes] = []

        def produce(self, topic: str, value: bytes, key: bytes | None, **kw: object) -> None:
            if value == b"big":
                raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            self.produced.append(value)

        def flush(self, timeout: float) -> int:
            return 0

    producer = KafkaProducer("127.0.0.1:9", {})
    fake = Refusing()
    producer._producer = fake  # type: ignore[assignment]
    records = [
        ("t", b"a", b"a1", []),
        ("t", b"a", b"big", []),
        ("t", b"b", b"b1", []),
        ("t", b"a", b"a3", []),
        ("t", None, b"n", []),
    ]
    outcomes = producer.send(records, threading.Event())  # type: ignore[arg-type]
    assert fake.produced == [b"a1", b"b1", b"n"]
    assert outcomes[1] is not None and outcomes[1].permanent
    assert outcomes[3] is None
    assert [o is not None and o.ok for o in outcomes] == [True, False, True, False, True]


def test_a_closed_producer_ends_its_client_threads_at_once() -> None:
    """close() releases the librdkafka client itself: its threads end then, not whenever the
    garbage collector gets to the reference cycle of the client and its callbacks (a fleet's
    pool closes its spare producers and relies on it)."""
    import contextlib
    import gc
    import time
    from pathlib import Path

    from outbox._kafka.producer import KafkaProducer

    def client_threads() -> int:
        count = 0
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                count += (task / "comm").read_text().startswith("rdk:")
        return count

    def settled(predicate: Callable[[int], bool]) -> bool:
        # Clients of earlier tests may still be ending theirs.
        deadline = time.monotonic() + 10
        while not predicate(client_threads()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    gc.collect()
    gc.disable()  # the collector must not be what ends them
    try:
        before = client_threads()
        producer = KafkaProducer("127.0.0.1:9", {})
        assert client_threads() > before
        producer.close(timeout=0.0)
        assert settled(lambda n: n <= before), "the closed client's threads still run"
        producer.close(timeout=0.0)  # twice: nothing more to release
    finally:
        gc.enable()
