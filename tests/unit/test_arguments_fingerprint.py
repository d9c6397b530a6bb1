"""The default fingerprint of ``@idempotent``: the caller's arguments, bound to the signature."""

from __future__ import annotations

import copy
import dataclasses
import decimal
import uuid
from typing import Any

import pytest
from hypothesis import given, strategies as st

from outbox._core.decorating import arguments_fingerprint
from outbox.errors import ConfigurationError


def charge(uow: Any, request_id: str, amount: Any, currency: str = "EUR") -> None: ...


FP = arguments_fingerprint(charge)


@dataclasses.dataclass
class Line:
    sku: str
    qty: int


def test_the_same_call_spelled_differently_has_one_fingerprint() -> None:
    first = FP("r-1", 500)
    assert first == FP("r-1", amount=500) == FP(request_id="r-1", amount=500, currency="EUR")
    assert first.startswith("args:sha256:") and len(first) <= 255


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (500, 501),
        ("500", 500),
        (True, 1),
        ({"a": 1}, {"a": 2}),
        ([1, 2], [2, 1]),
        (b"\x00", b"\x01"),
        (decimal.Decimal("1.0"), decimal.Decimal("1.00")),
        (Line("pen", 1), Line("pen", 2)),
        (uuid.UUID(int=1), uuid.UUID(int=2)),
    ],
)
def test_other_arguments_have_another_fingerprint(one: Any, other: Any) -> None:
    assert FP("r-1", one) != FP("r-1", other)


def test_dicts_and_sets_do_not_depend_on_their_order() -> None:
    assert FP("r-1", {"a": 1, "b": 2}) == FP("r-1", {"b": 2, "a": 1})
    assert FP("r-1", {3, 1, 2}) == FP("r-1", {2, 3, 1})


def test_an_argument_that_is_not_data_is_refused_with_the_way_out() -> None:
    with pytest.raises(ConfigurationError, match=r"'amount' is a object.*fingerprint=False"):
        FP("r-1", object())


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text() | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(JSONISH, JSONISH)
def test_one_value_one_fingerprint(one: Any, other: Any) -> None:
    if FP("r", one) == FP("r", other):
        assert one == other
    assert FP("r", one) == FP("r", copy.deepcopy(one))
