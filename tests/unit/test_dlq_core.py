"""Dead letters grouped by failure and the headers of a redrive (pure parts of ``outbox dlq``)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from outbox._core.deadletter import DeadLetterInfo
from outbox._core.deadletter_reading import (
    REDRIVE_HEADER,
    Letter,
    group_letters,
    normalize_error,
    parse_ref,
    redrive_headers,
)


def letter(offset: int, error: str, error_type: str = "KeyError") -> Letter:
    info = DeadLetterInfo("permanent-error", error, error_type, 1, "orders", 0, offset, "g", None)
    return Letter(0, offset, 1000 + offset, b"k", b"v", (), info)


def test_varying_parts_of_an_error_are_one_group() -> None:
    assert (
        normalize_error("'order-17' missing after 3 tries") == "'order-<n>' missing after <n> tries"
    )
    assert normalize_error("id 0b6f9c1e-8d47-4a8e-9a1c-2f0e5d3b7a61") == "id <uuid>"
    groups = group_letters(
        [letter(0, "'a-1' missing"), letter(1, "'a-22' missing"), letter(2, "bad", "ValueError")]
    )
    assert [(g.error_type, g.count) for g in groups] == [("KeyError", 2), ("ValueError", 1)]
    assert groups[0].first_seen_ms == 1000 and groups[0].last_seen_ms == 1001


def test_redrive_counts_and_drops_the_dead_letter_headers() -> None:
    once = redrive_headers([("a", b"1"), ("outbox.dlq.error", b"x")])
    assert once == [("a", b"1"), (REDRIVE_HEADER, b"1")]
    assert redrive_headers(once)[-1] == (REDRIVE_HEADER, b"2")
    assert redrive_headers([(REDRIVE_HEADER, b"junk")])[-1] == (REDRIVE_HEADER, b"1")


@given(st.text(max_size=20))
def test_a_message_ref_is_two_whole_numbers_or_a_value_error(text: str) -> None:
    try:
        partition, offset = parse_ref(text)
    except ValueError as exc:
        assert "PARTITION:OFFSET" in str(exc)
    else:
        assert text == f"{text.split(':')[0]}:{text.split(':', 1)[1]}"
        assert (int(text.split(":")[0]), int(text.split(":", 1)[1])) == (partition, offset)
