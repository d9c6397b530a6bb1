"""Dead letters: their headers, their error text and their producer's configuration."""

from __future__ import annotations

from outbox._core.deadletter import (
    HEADER_ATTEMPTS,
    HEADER_OFFSET,
    HEADER_REASON,
    DeadLetter,
    DeadLetterInfo,
    Reason,
    dead_letter_headers,
)
from outbox._kafka.config import producer_config


def test_dead_letter_headers_keep_the_original_and_replace_stale_ones() -> None:
    letter = DeadLetter(Reason.RETRIES_EXHAUSTED, "Boom: down", "Boom", 5)
    original = [("X-Idempotency-Key", b"k1"), ("outbox.dlq.reason", b"old"), ("bin", b"\x00")]
    headers = dead_letter_headers(original, topic="orders", partition=3, offset=42,
                                  group="billing", letter=letter)  # fmt: skip
    assert headers[:2] == [("X-Idempotency-Key", b"k1"), ("bin", b"\x00")]
    assert (HEADER_REASON, b"retries-exhausted") in headers
    assert (HEADER_ATTEMPTS, b"5") in headers and (HEADER_OFFSET, b"42") in headers
    info = DeadLetterInfo.from_headers(headers)
    assert (info.reason, info.topic, info.partition, info.offset, info.group) == (
        "retries-exhausted", "orders", 3, 42, "billing",
    )  # fmt: skip
    assert (info.error, info.error_type, info.attempts, info.idempotency_key) == (
        "Boom: down", "Boom", 5, "k1",
    )  # fmt: skip


def test_dead_letter_from_exception_truncates_long_errors() -> None:
    letter = DeadLetter.from_exception(Reason.PERMANENT_ERROR, ValueError("x" * 10_000), 1)
    assert letter.error.startswith("ValueError: x") and len(letter.error) == 1000
    assert letter.error_type == "ValueError"


def test_producer_config_drops_consumer_properties_and_forces_idempotence() -> None:
    cfg = producer_config(
        "k:9092",
        {"session.timeout.ms": 6000, "group.instance.id": "a", "auto.offset.reset": "latest",
         "security.protocol": "SASL_SSL", "enable.idempotence": False, "acks": "1"},
        purpose="dead-letter",
    )  # fmt: skip
    assert cfg == {"security.protocol": "SASL_SSL", "bootstrap.servers": "k:9092",
                   "enable.idempotence": "true", "acks": "all", "linger.ms": 0}  # fmt: skip
