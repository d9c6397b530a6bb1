"""Where a page of dead letters stopped: the cursor's text form round-trips, and anything else
is refused with a message saying the expected form."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox._core.deadletter_reading import (
    MAX_OFFSET,
    MAX_PARTITION,
    describe_stop,
    format_cursor,
    parse_cursor,
)

positions = st.dictionaries(
    st.integers(0, MAX_PARTITION), st.integers(0, MAX_OFFSET), min_size=1, max_size=20
)


@given(positions)
def test_a_cursor_reads_back_as_the_positions_it_was_made_from(found: dict[int, int]) -> None:
    assert parse_cursor(format_cursor(found)) == found


@given(st.text(max_size=60))
def test_anything_but_a_cursor_is_refused_with_the_expected_form(text: str) -> None:
    try:
        found = parse_cursor(text)
    except ValueError as exc:
        message = str(exc)
        assert "PARTITION:OFFSET" in message or "twice" in message or "range" in message
    else:
        assert format_cursor(found) == ",".join(
            f"{p}:{o}" for p, o in sorted((int(a), int(b)) for a, b in
                                          (part.split(":") for part in text.split(",")))
        )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "PARTITION:OFFSET"),
        ("0:1,0:2", "twice"),
        (f"{MAX_PARTITION + 1}:0", "range"),
        (f"0:{MAX_OFFSET + 1}", "range"),
        ("0:-1", "PARTITION:OFFSET"),
        ("٣:1", "PARTITION:OFFSET"),
    ],
)
def test_a_malformed_cursor_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_cursor(text)


def test_a_stop_names_each_partition_and_its_offset() -> None:
    said = describe_stop({1: 0, 0: 17}, 100)
    assert said.startswith("reading stopped after 100 dead letter(s) still to handle")
    assert "partition 0 from offset 17, partition 1 from offset 0" in said
