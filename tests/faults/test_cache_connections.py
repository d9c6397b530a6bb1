"""The cache keeps connections of the client's pool aside for its GET and SET: one that Redis
closed meanwhile (a restart, its idle ``timeout``, ``CLIENT KILL``) is replaced at once, so the
next duplicate is still answered from Redis and the fast path is not switched off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis
import redis.asyncio

import outbox
from outbox import OutboxConfig
from tests.fixtures.redis import PrivateRedis
from tests.fixtures.uow import place, watch


def _kill_clients(url: str) -> None:
    with redis.Redis.from_url(url) as admin:
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")


def test_a_connection_redis_closed_is_replaced_without_a_miss(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    server = private_redis()
    ob = make_outbox(server.url)
    assert place(ob, "c-1") == (False, {"order": "c-1"})
    assert place(ob, "c-1") == (True, {"order": "c-1"})  # the first duplicate caches it
    _kill_clients(server.url)
    with watch(ob.engine) as activity:
        assert place(ob, "c-1") == (True, {"order": "c-1"})
    assert activity.total == 0, activity  # answered by Redis
    assert ob.cache is not None and ob.cache.available()


def test_async_a_connection_redis_closed_is_replaced_without_a_miss(
    database_url: str, private_redis: Callable[..., PrivateRedis]
) -> None:
    server = private_redis()

    async def run() -> tuple[str | None, bool]:
        aob = outbox.AsyncOutbox(database_url, redis_url=server.url, config=OutboxConfig())
        try:
            async with aob.unit_of_work("c-1") as uow:
                uow.result = {"order": "c-1"}
            async with aob.unit_of_work("c-1") as uow:  # the first duplicate caches it
                assert uow.replayed_from == "postgres"
            _kill_clients(server.url)
            async with aob.unit_of_work("c-1") as uow:
                source = uow.replayed_from
            assert aob.cache is not None
            return source, aob.cache.available()
        finally:
            await aob.close()

    assert asyncio.run(run()) == ("redis", True)
