"""Handled dead letters, the pure parts: groups leave out and count handled letters, a selection
by group and ref, and the refusal of group ids and ways of handling that do not parse."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox._core.deadletter import DeadLetterInfo
from outbox._core.deadletter_reading import (
    HANDLED_HOWS,
    Letter,
    check_group_id,
    check_how,
    choose_letters,
    group_letters,
    group_unhandled,
)


def letter(offset: int, error: str, error_type: str = "KeyError", partition: int = 0) -> Letter:
    info = DeadLetterInfo("permanent-error", error, error_type, 1, "orders", 0, offset, "g", None)
    return Letter(partition, offset, 1000 + offset, b"k", b"v", (), info)


LETTERS = [letter(0, "'a-1' missing"), letter(1, "'a-2' missing"), letter(2, "bad", "ValueError")]


def test_handled_letters_are_left_out_and_counted_per_group() -> None:
    groups, handled = group_unhandled(LETTERS, {(0, 0)})
    assert handled == 1
    assert [(g.error_type, g.count, g.handled) for g in groups] == [
        ("KeyError", 1, 1),
        ("ValueError", 1, 0),
    ]
    assert [x.ref for x in groups[0].letters] == ["0:1"]


def test_a_group_whose_letters_are_all_handled_leaves_the_listing() -> None:
    groups, handled = group_unhandled(LETTERS, {(0, 0), (0, 1)})
    assert handled == 2 and [g.error_type for g in groups] == ["ValueError"]


def test_include_handled_keeps_every_letter_and_still_counts() -> None:
    groups, handled = group_unhandled(LETTERS, {(0, 0), (0, 1)}, include_handled=True)
    assert handled == 2
    assert [(g.error_type, g.count, g.handled) for g in groups] == [
        ("KeyError", 2, 2),
        ("ValueError", 1, 0),
    ]


def test_group_ids_stay_the_same_with_and_without_handled_letters() -> None:
    before = {g.error_type: g.id for g in group_letters(LETTERS)}
    after = {g.error_type: g.id for g in group_unhandled(LETTERS, {(0, 0)})[0]}
    assert before == after


def test_a_selection_by_group_and_ref_counts_what_matched_nothing() -> None:
    groups = group_letters([*LETTERS, letter(5, "bad", "ValueError", partition=3)])
    key_group = next(g.id for g in groups if g.error_type == "KeyError")
    chosen, missing = choose_letters(groups, {key_group, "0123456789ab"}, {(3, 5), (9, 9)})
    assert [x.ref for x in chosen] == ["0:0", "0:1", "3:5"]
    assert missing == 2  # the unknown group and the unknown ref
    chosen, missing = choose_letters(groups, {key_group}, {(0, 0)})  # overlap: once each
    assert [x.ref for x in chosen] == ["0:0", "0:1"] and missing == 0


def test_group_ids_are_what_group_id_makes() -> None:
    for group in group_letters(LETTERS):
        assert check_group_id(group.id) == group.id


@given(st.text(max_size=30))
def test_anything_but_twelve_hex_digits_is_refused_as_a_group_id(text: str) -> None:
    is_id = len(text) == 12 and all(c in "0123456789abcdef" for c in text)
    if is_id:
        assert check_group_id(text) == text
    else:
        with pytest.raises(ValueError, match="is not a group id"):
            check_group_id(text)


@given(st.text(max_size=20))
def test_only_discarded_and_redriven_are_ways_to_handle(how: str) -> None:
    if how in HANDLED_HOWS:
        assert check_how(how) == how
    else:
        with pytest.raises(ValueError, match="discarded or redriven"):
            check_how(how)
