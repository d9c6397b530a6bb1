"""Typed results: with a declared result type, a replay -- from Redis or from PostgreSQL --
returns a value equal to the first answer and of the same types, all the way down."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pydantic
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox import AsyncOutbox, Outbox, OutboxConfig
from outbox.errors import ConfigurationError, SerializationError
from tests.fixtures.typed_results import NEAR_MISSES, TYPES, UNIONS, around, types_of

UTC_MOMENT = dt.datetime(2026, 11, 27, 23, 45, 1, 500, tzinfo=dt.UTC)
LOCAL_MOMENT = dt.datetime(2026, 11, 27, 9, 0, tzinfo=dt.timezone(dt.timedelta(hours=-5)))


class Line(pydantic.BaseModel):
    sku: str
    price: Decimal


class Order(pydantic.BaseModel):
    id: uuid.UUID
    total: Decimal
    placed_at: dt.datetime
    lines: list[Line]


@dataclasses.dataclass(frozen=True)
class Receipt:
    id: uuid.UUID
    total: Decimal
    day: dt.date
    paid_at: dt.datetime
    ratio: float
    tags: tuple[str, ...]
    counts: dict[str, int]
    note: str | None = None


ORDER = Order(
    id=uuid.UUID(int=7), total=Decimal("19.90"), placed_at=UTC_MOMENT,
    lines=[Line(sku="a", price=Decimal("9.95")), Line(sku="b", price=Decimal("9.95"))],
)  # fmt: skip
RECEIPT = Receipt(
    uuid.UUID(int=9), Decimal("0.10"), dt.date(2026, 2, 28), LOCAL_MOMENT, 2.0, ("x", "y"),
    {"n": 1},
)  # fmt: skip

CASES: dict[str, tuple[Any, Any]] = {
    "pydantic": (Order, ORDER),
    "dataclass": (Receipt, RECEIPT),
    "decimal": (Decimal, Decimal("1.10")),
    "uuid": (uuid.UUID, uuid.UUID(int=12345)),
    "datetime": (dt.datetime, LOCAL_MOMENT),
    "date": (dt.date, dt.date(2024, 2, 29)),
    "float": (float, 3.0),  # an integral float stays a float
    "list": (list[Receipt], [RECEIPT, dataclasses.replace(RECEIPT, note="second")]),
    "optional": (Receipt | None, None),
}


def _types(value: Any) -> Any:
    """The type of ``value`` and of everything inside it, to compare beyond ``==``."""
    if isinstance(value, pydantic.BaseModel):
        return (type(value), {k: _types(getattr(value, k)) for k in type(value).model_fields})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), {f.name: _types(getattr(value, f.name)) for f in fields})
    if isinstance(value, list | tuple):
        return (type(value), [_types(v) for v in value])
    if isinstance(value, dict):
        return (type(value), {k: _types(v) for k, v in value.items()})
    return type(value)


@pytest.fixture(params=["redis", "postgresql"])
def replay_from(
    request: pytest.FixtureRequest, database_url: str, redis_url: str, redis_prefix: str,
    engine: sa.Engine,
) -> Iterator[tuple[Outbox, Callable[[], None]]]:  # fmt: skip
    """An outbox whose replays come from Redis or from PostgreSQL (no Redis). For Redis the
    cache is filled the way it is in service: a first duplicate is answered by PostgreSQL and
    fills it; then the database forgets the key, so only the cache can answer the next one."""
    if request.param == "redis":
        ob = Outbox(
            database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix)
        )

        def forget() -> None:
            with engine.begin() as conn:
                assert conn.execute(sa.text("DELETE FROM idempotency_keys")).rowcount == 1

    else:
        ob = Outbox(database_url)

        def forget() -> None:
            pass

    try:
        yield ob, forget
    finally:
        ob.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_replay_returns_an_equal_value_of_the_same_types(
    case: str, replay_from: tuple[Outbox, Callable[[], None]]
) -> None:
    ob, forget = replay_from
    result_type, value = CASES[case]
    calls: list[int] = []

    @ob.idempotent(key="request_id", result_type=result_type)
    def handle(uow: Any, request_id: str) -> Any:
        calls.append(1)
        return value

    first = handle("req-1")
    from_database = handle("req-1")  # a replay from PostgreSQL; with Redis, it fills the cache
    forget()
    again = handle("req-1")
    assert calls == [1]  # the later answers are replays
    assert again == from_database == value == first
    assert _types(again) == _types(from_database) == _types(value)


def test_the_unit_of_work_decodes_on_replay(database_url: str) -> None:
    ob = Outbox(database_url)
    try:
        with ob.unit_of_work("k", result_type=Order) as uow:
            uow.result = ORDER
        with ob.unit_of_work("k", result_type=Order) as uow:
            assert uow.replayed and uow.result == ORDER and isinstance(uow.result, Order)
        with ob.unit_of_work("k") as uow:  # undeclared: the stored JSON data
            assert uow.result == ORDER.model_dump(mode="json")
    finally:
        ob.close()


def test_the_asyncio_flavour_replays_typed_results(database_url: str) -> None:
    async def run() -> list[Any]:
        async with AsyncOutbox(database_url) as ob:

            @ob.idempotent(key="request_id", result_type=Receipt)
            async def handle(uow: Any, request_id: str) -> Receipt:
                return RECEIPT

            return [await handle("r"), await handle("r")]

    first, again = asyncio.run(run())
    assert again == first == RECEIPT and _types(again) == _types(RECEIPT)


class _Money:
    """A type the rules do not know, with its own codec."""

    def __init__(self, cents: int) -> None:
        self.cents = cents

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Money) and other.cents == self.cents

    __hash__ = None  # type: ignore[assignment]


class _MoneyCodec:
    def encode(self, value: _Money) -> dict[str, int]:
        return {"cents": value.cents}

    def decode(self, data: dict[str, int]) -> _Money:
        return _Money(data["cents"])


def test_a_result_codec_serves_other_types(database_url: str) -> None:
    ob = Outbox(database_url)
    try:

        @ob.idempotent(key="request_id", result_codec=_MoneyCodec())
        def charge(uow: Any, request_id: str) -> _Money:
            return _Money(250)

        assert charge("c") == _Money(250)
        again = charge("c")
        assert isinstance(again, _Money) and again == _Money(250)
    finally:
        ob.close()


def test_a_result_of_another_type_is_refused_before_commit(
    database_url: str, engine: sa.Engine
) -> None:
    ob = Outbox(database_url)
    try:
        with pytest.raises(SerializationError, match="declared type is Order"):  # noqa: SIM117
            with ob.unit_of_work("wrong", result_type=Order) as uow:
                uow.result = ORDER.model_dump(mode="json")  # a dict: a replay would be an Order
    finally:
        ob.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one() == 0


@pytest.mark.parametrize("declared", [set[int], complex, object, dict[str, complex]])
def test_unsupported_result_types_are_refused_at_declaration(
    declared: Any, database_url: str
) -> None:
    ob = Outbox(database_url)
    try:
        with pytest.raises(ConfigurationError, match="not supported"):
            ob.idempotent(key="request_id", result_type=declared)
        with pytest.raises(ConfigurationError, match="not supported"):
            ob.unit_of_work("k", result_type=declared)
    finally:
        ob.close()


_EXAMPLES = settings(
    max_examples=30, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
_keys = iter(range(10**9))


@_EXAMPLES
@given(data=st.data())
def test_generated_results_replay_equal_from_either_store(
    data: st.DataObject, replay_from: tuple[Outbox, Callable[[], None]]
) -> None:
    ob, forget = replay_from
    declared, values = data.draw(TYPES | st.sampled_from(UNIONS))
    value = data.draw(values)
    key = f"gen-{next(_keys)}"
    with ob.unit_of_work(key, result_type=declared) as uow:
        uow.result = value
    with ob.unit_of_work(key, result_type=declared) as from_database:  # with Redis: fills it
        assert from_database.replayed
    forget()
    with ob.unit_of_work(key, result_type=declared) as again:
        assert again.replayed
        assert again.result == value and types_of(again.result) == types_of(value)


@_EXAMPLES
@given(data=st.data())
def test_a_result_that_differs_inside_from_its_type_writes_nothing(
    data: st.DataObject, database_url: str, engine: sa.Engine
) -> None:
    leaf, wrong = data.draw(st.sampled_from(NEAR_MISSES))
    declared, values = data.draw(around(leaf, wrong))
    value = data.draw(values)
    key = f"wrong-{next(_keys)}"
    ob = Outbox(database_url)
    try:
        with pytest.raises(SerializationError, match="the result"):  # noqa: SIM117
            with ob.unit_of_work(key, result_type=declared) as uow:
                uow.connection.execute(sa.text("CREATE TABLE refused_business_row ()"))
                uow.publish("typed.events", {"n": 1})
                uow.result = value
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
            assert conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one() == 0
            assert (
                conn.execute(sa.text("SELECT to_regclass('refused_business_row')")).scalar() is None
            )
        with ob.unit_of_work(key) as retry:  # the key is free: a retry runs
            assert not retry.replayed
            retry.result = None
    finally:
        ob.close()
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys"))
