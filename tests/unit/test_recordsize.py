"""The payload limit at the door is the relay's producer's: librdkafka's record size and its
``message.max.bytes`` (outbox._core.recordsize, OutboxConfig.max_payload_bytes)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox import OutboxConfig
from outbox._core import recordsize, validate
from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox.errors import ConfigurationError, PayloadTooLargeError


def test_the_record_size_is_librdkafkas() -> None:
    # 36 bytes of framing; X-Idempotency-Key (17) with a 36-character event id, each length a
    # one-byte varint: 55 bytes that the relay adds to a record without one.
    assert recordsize.RECORD_OVERHEAD == 36
    assert recordsize.wire_size(None, b"", {}) == 36 + 55
    assert recordsize.wire_size(b"k" * 50, b"v" * 999_900, {}) == 36 + 55 + 50 + 999_900
    # A header's lengths are zigzag varints: 63 fits one byte, 64 takes two.
    assert recordsize.wire_size(None, b"", {"n": "x" * 63}) == 36 + 55 + 1 + 63 + 1 + 1
    assert recordsize.wire_size(None, b"", {"n": b"x" * 64}) == 36 + 55 + 1 + 64 + 1 + 2
    own = {IDEMPOTENCY_HEADER.lower(): "mine"}  # the publisher's own: nothing added
    assert recordsize.wire_size(None, b"", own) == 36 + 17 + 4 + 1 + 1
    assert recordsize.wire_size(None, b"", {"é": "é"}) == 36 + 55 + 2 + 2 + 1 + 1  # UTF-8 bytes


@given(size=st.integers(0, 3000), key=st.one_of(st.none(), st.binary(max_size=20)))
def test_an_event_at_the_limit_passes_and_one_byte_more_is_refused(
    size: int, key: bytes | None
) -> None:
    headers = {"content-type": "application/octet-stream"}
    limit = recordsize.wire_size(key, b"x" * size, headers)
    validate.check_size(key, b"x" * size, headers, limit)
    with pytest.raises(PayloadTooLargeError, match=f"the limit is {limit - 1} bytes"):
        validate.check_size(key, b"x" * size, headers, limit - 1)


@pytest.mark.parametrize(
    ("variable", "limit"),
    [
        (None, 1_000_000),
        ("", 1_000_000),
        ("acks=all,linger.ms=5", 1_000_000),
        ("acks=all,message.max.bytes=2000000", 2_000_000),
        ("message.max.bytes = 5000\nsasl.password=x,y", 5_000),
        ("message.max.bytes=3000,message.max.bytes=4000", 4_000),  # the last wins
    ],
)
def test_the_limit_follows_the_relays_configuration(
    monkeypatch: pytest.MonkeyPatch, variable: str | None, limit: int
) -> None:
    assert recordsize.producer_limit(variable) == limit
    if variable is None:
        monkeypatch.delenv("OUTBOX_KAFKA_CONFIG", raising=False)
    else:
        monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", variable)
    assert OutboxConfig().payload_limit == limit
    assert OutboxConfig().validate().max_payload_bytes == limit
    assert OutboxConfig(max_payload_bytes=1234).validate().payload_limit == 1234  # set: it wins


@pytest.mark.parametrize("value", ["big", "999", "1000000001", "-5", "1e6", "٣٠٠٠"])
def test_a_limit_librdkafka_would_refuse_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", f"sasl.password=hunter2,message.max.bytes={value}")
    with pytest.raises(ConfigurationError, match=r"message\.max\.bytes must be") as info:
        OutboxConfig().validate()
    assert "hunter2" not in str(info.value)
