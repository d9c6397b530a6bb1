"""Which flavour of Redis client a caller handed over (not generated: both flavours use it)."""

from __future__ import annotations

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

from outbox.errors import ConfigurationError


def check_redis_flavour(client: object, want_async: bool) -> None:
    """Refuse a Redis client of the other flavour (a sync client in ``AsyncOutbox`` would block
    the event loop; an asyncio client in ``Outbox`` would hand back coroutines)."""
    sync_types = (redis.Redis, redis.cluster.RedisCluster)
    async_types = (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)
    wrong = sync_types if want_async else async_types
    if isinstance(client, wrong):
        raise ConfigurationError(
            f"{'AsyncOutbox' if want_async else 'Outbox'} needs "
            f"{'a redis.asyncio client' if want_async else 'a sync redis client'}, got "
            f"{type(client).__module__}.{type(client).__name__}"
        )
