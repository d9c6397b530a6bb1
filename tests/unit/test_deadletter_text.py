"""Pure pieces of what the consumer trusts and writes: the default message fingerprint and the
dead-letter error text."""

from __future__ import annotations

from hypothesis import given, strategies as st

from outbox._core.deadletter import MAX_ERROR_TEXT, DeadLetter, Reason
from outbox._core.fingerprint import record_fingerprint
from outbox._core.redact import one_line


@given(st.text(max_size=30), st.none() | st.binary(max_size=30))
def test_fingerprints_differ_whenever_topic_or_value_differ(
    topic: str, value: bytes | None
) -> None:
    same = record_fingerprint(topic, value)
    assert same == record_fingerprint(topic, value) and same.startswith("sha256:")
    assert record_fingerprint(topic + "x", value) != same
    assert record_fingerprint(topic, (value or b"") + b"x") != same
    assert record_fingerprint(topic, None if value is not None else b"") != same


def test_topic_and_value_do_not_run_into_each_other() -> None:
    assert record_fingerprint("ab", b"c") != record_fingerprint("a", b"bc")
    topic_only = record_fingerprint("orders", with_value=False)
    assert topic_only == record_fingerprint("orders", b"anything", with_value=False)
    assert topic_only not in {record_fingerprint("orders", None), record_fingerprint("orders", b"")}
    assert topic_only != record_fingerprint("orders2", with_value=False)


@given(st.text(max_size=200))
def test_dead_letter_error_text_is_one_line_of_plain_text(message: str) -> None:
    error = DeadLetter.from_exception(Reason.PERMANENT_ERROR, ValueError(message), 1).error
    assert len(error) <= MAX_ERROR_TEXT and error.startswith("ValueError")
    assert not any(ch in error for ch in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\x1b\x00")
    assert one_line(ValueError(message)).count("\n") == 0


def test_dead_letter_error_text_hides_url_passwords() -> None:
    exc = RuntimeError("cannot reach postgresql://app:hunter22@db/app\nsecond line")
    error = DeadLetter.from_exception(Reason.RETRIES_EXHAUSTED, exc, 3).error
    assert "hunter22" not in error and "second line" not in error
