"""After the caller's commit, a joined unit of work reads its key back on a connection of its
own: one kept aside for read-backs, not one checked out of a pool for every commit (whose
check-out and check-in ``ROLLBACK`` cost more than the read itself, and which in the asyncio
flavour came out of the pool the units of work share)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox import OutboxConfig
from outbox._pg import after_commit
from tests.fixtures.uow import watch

COMMITS = 5


@pytest.fixture
def ob(engine: sa.Engine, redis_url: str, redis_prefix: str) -> Iterator[outbox.Outbox]:
    client = redis.Redis.from_url(redis_url)
    with outbox.Outbox(engine, redis=client, config=OutboxConfig(cache_prefix=redis_prefix)) as o:
        yield o
    client.close()


def _joined(ob: outbox.Outbox, key: str, conn: sa.Connection) -> None:
    with ob.unit_of_work(key, connection=conn) as uow:
        uow.publish("joined.events", {"key": key})
        uow.result = {"key": key}


def test_sync_read_backs_check_out_no_connection_after_the_first(
    ob: outbox.Outbox, engine: sa.Engine
) -> None:
    assert ob.cache is not None
    with engine.begin() as conn:
        _joined(ob, "warm", conn)
    with watch(ob._reader) as activity:
        for i in range(COMMITS):
            with engine.begin() as conn:
                _joined(ob, f"k-{i}", conn)
    assert activity.checkouts == 0, activity
    for i in range(COMMITS):  # and each commit was read back and cached
        assert ob.cache.client.exists(ob.cache.redis_key("default", f"k-{i}")) == 1


def test_async_read_backs_take_nothing_from_the_outbox_pool(
    database_url: str, redis_url: str, redis_prefix: str
) -> None:
    async def run() -> tuple[int, list[int]]:
        client = redis.asyncio.Redis.from_url(redis_url)
        callers = create_async_engine(database_url)
        aob = outbox.AsyncOutbox(
            database_url, redis=client, config=OutboxConfig(cache_prefix=redis_prefix)
        )

        async def commit(key: str) -> None:
            async with callers.begin() as conn, aob.unit_of_work(key, connection=conn) as uow:
                uow.publish("joined.events", {"key": key})
                uow.result = {"key": key}
            # The read-back runs in a task of its own: wait for it.
            await after_commit.settle(aob._joined._writes)

        try:
            await commit("warm")
            with watch(aob.engine.sync_engine) as activity:
                for i in range(COMMITS):
                    await commit(f"k-{i}")
            assert aob.cache is not None
            cached = [
                await client.exists(aob.cache.redis_key("default", f"k-{i}"))
                for i in range(COMMITS)
            ]
            return activity.checkouts, cached
        finally:
            await aob.close()
            await callers.dispose()
            await client.aclose()

    checkouts, cached = asyncio.run(run())
    assert checkouts == 0
    assert cached == [1] * COMMITS
