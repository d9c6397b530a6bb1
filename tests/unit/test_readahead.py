"""When a unit of work asks Redis before its claim (outbox._core.readahead)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox._core.readahead import WINDOW, ReadAhead


def test_reads_until_a_window_of_misses_in_a_row() -> None:
    ahead = ReadAhead()
    for _ in range(WINDOW):
        assert ahead.wanted()
        ahead.missed()
    assert not ahead.wanted()
    ahead.missed()  # more misses change nothing
    assert not ahead.wanted()


def test_a_duplicate_turns_the_reads_on_for_a_whole_window() -> None:
    ahead = ReadAhead(3)
    for _ in range(3):
        ahead.missed()
    assert not ahead.wanted()
    ahead.seen()
    for _ in range(3):
        assert ahead.wanted()
        ahead.missed()
    assert not ahead.wanted()


def test_a_window_of_zero_never_reads() -> None:
    assert not ReadAhead(0).wanted()


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window must be >= 0"):
        ReadAhead(-1)


@given(window=st.integers(0, 50), events=st.lists(st.booleans(), max_size=200))
def test_reads_exactly_while_a_duplicate_came_within_the_window(
    window: int, events: list[bool]
) -> None:
    """``True``: a duplicate arrived; ``False``: a read that missed (made only when wanted)."""
    ahead = ReadAhead(window)
    misses_since = 0  # the process starts as if a duplicate had just arrived
    for duplicate in events:
        assert ahead.wanted() == (misses_since < window)
        if duplicate:
            ahead.seen()
            misses_since = 0
        elif ahead.wanted():
            ahead.missed()
            misses_since += 1
