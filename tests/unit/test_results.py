"""How a stored result keeps its exact JSON text through jsonb (outbox._core.results)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given

from outbox._core import results
from outbox._core.validate import dumps_json
from tests.fixtures.results import RESULTS


@pytest.mark.parametrize(
    "value",
    [None, True, 1, 10**300, "x", 12.5, 100.0, 1e-05, 5e-324, 0.0, [1.5, {"a": 1}],
     {"a": 1, "ab": 3, "bb": 2}, {"": 0, "zz": 1, "é": 2}, {"body": "", "status": 201}],
)  # fmt: skip
def test_values_jsonb_prints_back_exactly_are_stored_plain(value: Any) -> None:
    assert results.jsonb_keeps(value)
    text = dumps_json(value, "r")
    assert results.for_database(text, value) == text


@pytest.mark.parametrize(
    "value",
    [1e16, 1e308, -0.0, [0, [-0.0]], {"b": 1, "a": 2}, {"aa": 1, "b": 2}, {"é": 1, "zz": 2},
     {1: "a"}, {results.EXACT_KEY: "1"}, {results.EXACT_KEY: 1, "x": 2}, {"": 2.9e152}],
)  # fmt: skip
def test_other_values_are_wrapped_and_unwrapped_exactly(value: Any) -> None:
    assert not results.jsonb_keeps(value)
    text = dumps_json(value, "r")
    stored = results.for_database(text, value)
    as_jsonb_prints_it = json.dumps(json.loads(stored), ensure_ascii=False)
    assert results.from_database(as_jsonb_prints_it) == text
    assert results.decoded_from_database(json.loads(stored)) == json.loads(text)


def test_rows_of_earlier_versions_read_as_they_always_did() -> None:
    assert results.from_database(None) is None
    assert results.from_database('{"a": 10000000000000000}') == '{"a": 10000000000000000}'
    plain_marker_lookalike = '{"outbox-kit:json": 1}'
    assert results.from_database(plain_marker_lookalike) == plain_marker_lookalike
    assert results.decoded_from_database({"outbox-kit:json": 1}) == {"outbox-kit:json": 1}
    assert results.decoded_from_database([1]) == [1]


@given(value=RESULTS)
def test_every_stored_form_gives_the_exact_text_back(value: Any) -> None:
    text = dumps_json(value, "r")
    stored = results.for_database(text, value)
    back = results.from_database(json.dumps(json.loads(stored), ensure_ascii=False))
    if stored == text:  # plain: jsonb's own spelling, the same value and types
        assert results.jsonb_keeps(value)
    else:
        assert back == text
