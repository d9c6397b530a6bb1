"""The toolkit's own refusals inside a body are never recorded as the key's failure.

A body that calls the toolkit wrongly (a topic Kafka would refuse, a result that is not JSON, a
nested unit of work of a busy key...) gets an ``OutboxError``; ``ValidationError`` and
``ConfigurationError`` are ``ValueError`` subclasses, so ``permanent_errors=(ValueError,)``
(or ``(Exception,)``) would catch them. Whatever that setting holds, such a refusal rolls back
and leaves the key free: the retry after the fix runs the body and commits. Checked for every
unit of work (sync and async, owned and joined, batched) and the Redis guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox import OutboxConfig
from outbox.errors import (
    ConfigurationError,
    InvalidTopicError,
    OutboxError,
    PayloadTooLargeError,
    PermanentError,
    PreviouslyFailed,
    SerializationError,
)
from outbox.guard import AsyncRedisGuard, RedisGuard
from outbox.uow import Batch
from tests.fixtures.uow import INSERT_ORDER, count, create_orders, rows

BROAD = [(ValueError,), (Exception,)]


def _bad_topic(uow: Any) -> None:
    uow.publish("orders accepted!", {"id": 1})


def _not_json(uow: Any) -> None:
    uow.result = {"at": datetime.datetime.now(datetime.UTC)}


def _too_large(uow: Any) -> None:
    uow.publish("orders.accepted", "x" * 2000)


def _bad_config(uow: Any) -> None:
    OutboxConfig(cache_ttl=-1.0).validate()


MISTAKES: dict[str, tuple[Callable[[Any], None], type[OutboxError]]] = {
    "bad-topic": (_bad_topic, InvalidTopicError),
    "not-json": (_not_json, SerializationError),
    "too-large": (_too_large, PayloadTooLargeError),
    "bad-config": (_bad_config, ConfigurationError),
}


@pytest.fixture
def orders(engine: sa.Engine) -> sa.Engine:
    create_orders(engine)
    return engine


def _config(permanent: tuple[type[BaseException], ...]) -> OutboxConfig:
    return OutboxConfig(permanent_errors=permanent, max_payload_bytes=1000)


def _statuses(engine: sa.Engine) -> dict[str, str]:
    return dict(rows(engine, "SELECT key, status FROM idempotency_keys"))


@pytest.mark.parametrize("permanent", BROAD, ids=["ValueError", "Exception"])
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
@pytest.mark.parametrize("mode", ["owned", "connection", "session", "batch"])
def test_a_refusal_in_the_body_rolls_back_and_leaves_the_key_free(
    orders: sa.Engine, permanent: tuple[type[BaseException], ...], mistake: str, mode: str
) -> None:
    wrong, refusal = MISTAKES[mistake]
    key = f"k-{uuid.uuid4().hex[:8]}"

    def body(uow: Any, fixed: bool) -> None:
        uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
        if not fixed:
            wrong(uow)
        uow.result = {"ok": key}

    def attempt(ob: outbox.Outbox, fixed: bool) -> None:
        if mode == "owned":
            with ob.unit_of_work(key) as uow:
                body(uow, fixed)
        elif mode == "connection":
            with ob.engine.connect() as conn:
                try:
                    with ob.unit_of_work(key, connection=conn) as uow:
                        body(uow, fixed)
                finally:
                    conn.commit()  # a recorded failure would commit with the caller
        elif mode == "session":
            with Session(ob.engine) as session:
                try:
                    with ob.unit_of_work(key, session=session) as uow:
                        body(uow, fixed)
                finally:
                    session.commit()
        else:
            batch = Batch.open(ob, "default", [key])
            refused: OutboxError | None = None
            try:
                try:
                    with batch.unit_of_work(key, "default") as uow:
                        body(uow, fixed)
                except OutboxError as exc:
                    refused = exc
                batch.commit()  # a failure the batch staged would commit here
            finally:
                batch.close()
            if refused is not None:
                raise refused

    with outbox.Outbox(orders, config=_config(permanent)) as ob:
        with pytest.raises(refusal):
            attempt(ob, fixed=False)
        assert count(orders, "orders") == 0
        assert _statuses(orders) == {}  # not recorded as failed: the key is free
        attempt(ob, fixed=True)  # the handler fixed, the retry runs
        assert _statuses(orders) == {key: "completed"}
        with ob.unit_of_work(key) as uow:
            assert uow.replayed and uow.result == {"ok": key}


@pytest.mark.parametrize("permanent", BROAD, ids=["ValueError", "Exception"])
def test_a_refusal_in_an_async_body_leaves_the_key_free(
    orders: sa.Engine, database_url: str, permanent: tuple[type[BaseException], ...]
) -> None:
    async def scenario() -> list[Any]:
        async with outbox.AsyncOutbox(database_url, config=_config(permanent)) as aob:
            with pytest.raises(InvalidTopicError):
                async with aob.unit_of_work("a-1") as uow:
                    await uow.connection.execute(INSERT_ORDER, {"k": "a-1", "a": 1})
                    uow.publish("bad topic!", {"id": 1})

            @aob.idempotent(key="k")
            async def handler(uow: outbox.AsyncUnitOfWork, k: str) -> str:
                await uow.connection.execute(INSERT_ORDER, {"k": k, "a": 1})
                return k

            return [await handler("a-1"), await handler("a-1")]

    assert asyncio.run(scenario()) == ["a-1", "a-1"]
    assert _statuses(orders) == {"a-1": "completed"}
    assert count(orders, "orders") == 1


def test_a_permanent_error_and_a_configured_type_are_still_recorded(orders: sa.Engine) -> None:
    """The rule takes nothing away from the body's own verdicts."""
    with outbox.Outbox(orders, config=_config((ValueError,))) as ob:
        with pytest.raises(ValueError), ob.unit_of_work("v"):
            raise ValueError("the business refuses")
        with pytest.raises(PermanentError), ob.unit_of_work("p"):
            raise PermanentError("card declined")
        for key in ("v", "p"):
            with pytest.raises(PreviouslyFailed), ob.unit_of_work(key):
                pass
    assert _statuses(orders) == {"v": "failed", "p": "failed"}


@pytest.fixture
def guard_prefix() -> str:
    return f"refusal-{uuid.uuid4().hex[:8]}"


def test_a_refusal_under_the_guard_releases_the_key(redis_url: str, guard_prefix: str) -> None:
    with RedisGuard(redis_url, prefix=guard_prefix, permanent_errors=(ValueError,)) as guard:
        with pytest.raises(SerializationError), guard.claim("g") as claim:
            claim.result = {"when": object()}
        with pytest.raises(ConfigurationError), guard.claim("g"):
            raise ConfigurationError("a setting the toolkit refused")
        with guard.claim("g") as claim:  # released each time: the retry runs
            assert not claim.replayed
            claim.result = "done"
        with pytest.raises(ValueError), guard.claim("v"):
            raise ValueError("the business refuses")
        with pytest.raises(PreviouslyFailed), guard.claim("v"):
            pass

    async def scenario() -> bool:
        async with AsyncRedisGuard(
            redis_url, prefix=guard_prefix + "a", permanent_errors=(Exception,)
        ) as aguard:
            with contextlib.suppress(SerializationError):
                async with aguard.claim("g") as aclaim:
                    aclaim.result = {"when": object()}
            async with aguard.claim("g") as aclaim:
                return aclaim.replayed

    assert asyncio.run(scenario()) is False
