"""Typed results in the pure core (outbox._core.typed_results): generated declared types, each
with values of its own and values that differ somewhere inside; whatever is accepted replays
equal and of the same types through the JSON text it is stored as, whatever is not is refused
before anything is stored, and a type that cannot come back exactly is refused when declared."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import typing
import uuid
import zoneinfo
from decimal import Decimal
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox._core.typed_results import TypedResult
from outbox._core.validate import dumps_json
from outbox.errors import ConfigurationError, SerializationError
from tests.fixtures.typed_results import NEAR_MISSES, TYPES, UNIONS, Line, Size, around, types_of


def _replay(typed: TypedResult, value: Any) -> Any:
    """What a duplicate gets: the value encoded, stored as JSON text, read and decoded."""
    return typed.decode(json.loads(dumps_json(typed.encode(value), "the result")))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_value_of_the_declared_type_replays_equal_with_the_same_types(
    data: st.DataObject,
) -> None:
    declared, values = data.draw(TYPES | st.sampled_from(UNIONS))
    typed = TypedResult(declared)
    value = data.draw(values)
    again = _replay(typed, value)
    assert again == value
    assert types_of(again) == types_of(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_value_is_refused_before_it_is_stored_or_replays_exactly(data: st.DataObject) -> None:
    declared, _ = data.draw(TYPES | st.sampled_from(UNIONS))
    _, other = data.draw(TYPES)
    value = data.draw(other)
    typed = TypedResult(declared)
    try:
        stored = typed.encode(value)
    except SerializationError:
        return
    again = typed.decode(json.loads(dumps_json(stored, "the result")))
    assert again == value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_value_that_differs_anywhere_inside_is_refused(data: st.DataObject) -> None:
    leaf, wrong = data.draw(st.sampled_from(NEAR_MISSES))
    declared, values = data.draw(around(leaf, wrong))
    value = data.draw(values)
    with pytest.raises(SerializationError, match="the result"):
        TypedResult(declared).encode(value)


@pytest.mark.parametrize(
    ("declared", "value", "message"),
    [
        (
            dt.date,
            dt.datetime(2026, 1, 2),
            "the result is a datetime, but its declared type is date",
        ),
        (list[Decimal], [0.1], r"the result\[0\] is a float, but its declared type is Decimal"),
        (int, True, "the result is a bool, but its declared type is int"),
        (dict[str, list[int | None]], {"a": [1, "2"]}, r"the result\['a'\]\[1\] is a str"),
        (tuple[int, str], (1,), "has 1 items where its declared type has 2"),
    ],
)
def test_the_refusal_names_the_place_and_both_types(
    declared: Any, value: Any, message: str
) -> None:
    with pytest.raises(SerializationError, match=message):
        TypedResult(declared).encode(value)


def test_a_dataclass_field_is_checked_by_its_declared_type() -> None:
    @dataclasses.dataclass
    class Receipt:
        day: dt.date
        lines: list[Line]

    typed = TypedResult(Receipt)
    line = Line(sku="a", price=Decimal("1.50"), at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert _replay(typed, Receipt(dt.date(2026, 1, 1), [line])) == Receipt(
        dt.date(2026, 1, 1), [line]
    )
    with pytest.raises(SerializationError, match=r"the result\.day is a datetime"):
        typed.encode(Receipt(dt.datetime(2026, 1, 1), [line]))
    with pytest.raises(SerializationError, match=r"the result\.lines\[0\] is a dict"):
        typed.encode(Receipt(dt.date(2026, 1, 1), [line.model_dump()]))  # type: ignore[list-item]


def test_a_value_whose_replay_would_differ_is_refused() -> None:
    @dataclasses.dataclass
    class Rounded:
        n: int

        def __post_init__(self) -> None:
            self.n += 1  # a replay constructs it again: one more

    with pytest.raises(SerializationError, match="would replay as"):
        TypedResult(Rounded).encode(Rounded(1))
    # A local time in the hour a clock change repeats: its ISO text names one offset, and
    # Python's rules make it unequal to the same instant in any other zone.
    folded = dt.datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("Europe/Berlin"))
    with pytest.raises(SerializationError, match="would replay as"):
        TypedResult(dt.datetime).encode(folded)
    plain = folded.replace(fold=0, month=7)
    assert _replay(TypedResult(dt.datetime), plain) == plain
    # pydantic writes a zone's offset to the minute: a second-level offset would be lost.
    odd = dt.timezone(dt.timedelta(seconds=30))
    with pytest.raises(SerializationError, match="would replay as"):
        TypedResult(Line).encode(
            Line(sku="a", price=Decimal(1), at=dt.datetime(2026, 1, 1, tzinfo=odd))
        )
    # An int declared float replays as the equal float; one that no float equals is refused.
    assert _replay(TypedResult(list[float]), [2**53]) == [float(2**53)]
    with pytest.raises(SerializationError, match="declared type is float"):
        TypedResult(float).encode(2**53 + 1)


class _Opaque:
    pass


@dataclasses.dataclass
class _Computed:
    a: int
    b: int = dataclasses.field(init=False, default=0)


@pytest.mark.parametrize(
    "declared",
    [
        set[int], frozenset, complex, object, bytes, _Opaque, dict[str, complex],
        int | float,  # both JSON numbers: 1 and 1.0 could not be told apart
        str | Decimal, dt.date | dt.datetime, uuid.UUID | Literal["x"],
        Line | dict[str, int], list[int] | tuple[int, ...],
        Any | int, dict[dt.date, int], dict[float, int], dict[bool, int], dict[Size, int],
        _Computed, list[set[int]], typing.Sequence[int], typing.Callable[[], int],
        Literal[1.5],
    ],
)  # fmt: skip
def test_a_type_that_cannot_come_back_exactly_is_refused_when_declared(declared: Any) -> None:
    with pytest.raises(ConfigurationError, match="not supported"):
        TypedResult(declared)


Sku = typing.NewType("Sku", str)


@pytest.mark.parametrize(
    ("declared", "value"),
    [
        (dict[Sku, int], {Sku("a"): 1}),
        (typing.Tuple, (1, "a", None)),  # noqa: UP006 (the bare alias, as older code writes it)
        (typing.List, [1, [2.5]]),  # noqa: UP006
        (typing.Dict, {"a": {"b": True}}),  # noqa: UP006
        (typing.Annotated[Decimal, "money"], Decimal("0.10")),
        (typing.Optional[Any], {"a": 1}),  # noqa: UP045
    ],
)
def test_aliases_and_new_types_stand_for_the_types_they_name(declared: Any, value: Any) -> None:
    again = _replay(TypedResult(declared), value)
    assert again == value and types_of(again) == types_of(value)
