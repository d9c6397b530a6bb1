"""Redis fast path: remembers outcomes (COMPLETED results, FAILED errors) of committed keys.

Redis is a cache, never the truth. Entries are written only after the PostgreSQL commit, read and
written with single-key commands (safe on Redis Cluster; a micro-batch's reads are one ``MGET`` on a
single Redis), with bounded timeouts. Any Redis failure, a slow answer or a malformed entry makes
the cache step aside: the caller goes to PostgreSQL, which decides. After a failure the cache stays
out of the way for a short while (``cache_retry_after``) so that a Redis outage does not add a
timeout to every call.

The cache trusts only entries signed with its database's key (:mod:`outbox._redis.entry`),
which the unit of work reads from PostgreSQL once (:meth:`AsyncOutcomeCache.trust`) and again on
every new connection of its engine (:meth:`AsyncOutcomeCache.reidentify`): until it has the
key, the cache answers nothing and writes nothing.

This asyncio module is the source; ``cache.py`` (the sync flavour) is generated from it by
``tools/async_to_sync.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as ClosedConnection, RedisError, ResponseError

from outbox._core.claim import StoredOutcome
from outbox._core.redact import redact, redact_url
from outbox._core.urls import check_redis_url
from outbox._redis.cache_base import CacheBase
from outbox._redis.entry import decode_entry, encode_entry
from outbox.config import OutboxConfig
from outbox.errors import ConfigurationError

log = logging.getLogger("outbox.cache")


# An outcome as the cache holds it: the same record the claim decides on.
CachedOutcome = StoredOutcome


def make_async_cache_client(url: str, config: OutboxConfig) -> Redis:
    """A redis-py client with bounded timeouts and no retries (a miss is cheaper than a wait).

    The URL is checked first (:func:`outbox._core.urls.check_redis_url`); no connection is
    opened here.
    """
    check_redis_url(url)
    try:
        return Redis.from_url(
            url,
            socket_timeout=config.cache_socket_timeout,
            socket_connect_timeout=config.cache_connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
    except (ValueError, TypeError, RedisError) as exc:
        # redis-py's message may quote parts of the URL: hide its secrets, drop the cause.
        raise ConfigurationError(
            f"invalid Redis URL {redact_url(url)!r}: {redact(str(exc), urls=[url])}"
        ) from None


class AsyncOutcomeCache(CacheBase):
    """Reads and writes outcomes of ``(scope, key)`` in Redis, never raising to the caller."""

    def __init__(self, client: Redis, config: OutboxConfig) -> None:
        super().__init__(config)
        self._client = client
        # Connections of the client's pool kept checked out for the cache's own GET and SET
        # (see _call), with the process they belong to.
        self._pool = _plain_pool(client)
        if self._pool is not None:
            kwargs = self._pool.connection_kwargs
            self._encoding = (
                kwargs.get("encoding", "utf-8"),
                kwargs.get("encoding_errors", "strict"),
            )
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._released = False

    @property
    def client(self) -> Redis:
        return self._client

    # -- entries -----------------------------------------------------------------------------

    async def _call(self, *args: Any) -> Any:
        """One command and its reply, on a connection of the client's pool kept aside for the
        cache: redis-py's pool check-out and reply handling cost about twice the round trip
        itself, on every first attempt of a key (its GET, then its SET). Each caller -- a
        thread or a task -- takes a connection of its own off the idle list, so a reply is
        always read by the one who sent the command; a connection that failed (redis-py
        disconnects it then) goes back to the pool, which connects it anew when it is used
        again. A client whose pool is not redis-py's plain one (Redis Cluster, a blocking pool
        of a set size, a single-connection client) is called as usual."""
        if self._pool is None:
            client: Any = self._client
            return await client.execute_command(*args)
        return (await self._exchange(lambda connection: connection.pack_command(*args), 1))[0]

    async def _exchange(self, pack: Callable[[Any], list[bytes]], replies: int) -> list[Any]:
        """Send what ``pack(connection)`` packs -- ``replies`` commands, pipelined -- on a kept
        connection (see :meth:`_call`; the client's pool is redis-py's plain one) and read
        their replies."""
        pool: Any = self._pool  # redis-py types neither of the calls below
        if self._pid != os.getpid():
            # A forked child: the parent's sockets are not its own to use.
            self._idle, self._pid = [], os.getpid()
        idle = self._idle
        while idle:
            # A kept connection that Redis closed meanwhile (a restart, its idle timeout) fails
            # before its command ran: try the next one, then a new one, as redis-py's pool does
            # when it hands out a connection. GET and SET are safe to send again.
            connection = idle.pop()
            try:
                return await self._send(pool, connection, pack(connection), replies)
            except ClosedConnection:
                continue
        connection = await pool.get_connection()
        return await self._send(pool, connection, pack(connection), replies)

    async def _send(
        self, pool: Any, connection: Any, packed: list[bytes], replies: int
    ) -> list[Any]:
        answers: list[Any] = []
        refused: ResponseError | None = None
        try:
            await connection.send_packed_command(packed, check_health=False)
            for _ in range(replies):
                try:
                    answers.append(await connection.read_response())
                except ResponseError as exc:  # an error reply, read whole: the next ones follow
                    refused = refused or exc
                    answers.append(exc)
        except BaseException:
            if replies > 1:  # replies may be left unread: never use the connection as it is
                await connection.disconnect()
            await pool.release(connection)  # redis-py disconnected it: connected anew on use
            raise
        if self._released:  # after release(): the pool has it back at once
            await pool.release(connection)
        else:
            self._idle.append(connection)
        if refused is not None:
            raise refused
        return answers

    async def get(self, scope: str, key: str) -> CachedOutcome | None:
        """The cached outcome, or ``None`` on a miss, a Redis failure or an entry that is
        malformed, forged, of another database or expired."""
        signer = self._signer
        if signer is None or time.monotonic() < self._down_until:
            return None
        redis_key = self.redis_key(scope, key)
        try:
            raw = await self._call("GET", redis_key)
        except (RedisError, OSError) as exc:
            self._failed("GET", exc)
            return None
        except Exception as exc:  # a client's own failure (a bad setting, undecodable bytes...)
            self._failed("GET", exc)
            return None
        if raw is None:
            return None
        return decode_entry(raw, signer, redis_key, int(time.time() * 1000))

    async def put(
        self, scope: str, key: str, outcome: CachedOutcome, ttl: float | None = None
    ) -> None:
        """Remember an outcome for ``ttl`` seconds (default ``cache_ttl``); call only after the
        PostgreSQL commit that made it final."""
        signer = self._signer
        if signer is None or not self.available():
            return
        px = self._ttl_ms if ttl is None else max(1, min(self._ttl_ms, int(ttl * 1000)))
        redis_key = self.redis_key(scope, key)
        entry = encode_entry(outcome, signer, redis_key, int(time.time() * 1000) + px)
        if entry is None:
            return
        try:
            await self._call("SET", redis_key, entry, "PX", px)
        except Exception as exc:  # after the commit: the outcome stands, whatever Redis does
            self._failed("SET", exc)

    async def get_many(self, scope: str, keys: list[str]) -> list[CachedOutcome | None]:
        """:meth:`get` of many keys in one round trip: one ``MGET`` on a single Redis (one
        reply for redis-py to parse, not one per key), a pipeline of single-key reads on Redis
        Cluster (which splits it by node); every answer is ``None`` when Redis fails."""
        signer = self._signer
        if not keys or signer is None or not self.available():
            return [None] * len(keys)
        redis_keys = [self.redis_key(scope, key) for key in keys]
        try:
            if self._pool is not None:  # a single Redis: the keys may share one command
                raws = await self._call("MGET", *redis_keys)
            else:
                pipe = self._client.pipeline(transaction=False)
                for redis_key in redis_keys:
                    pipe.get(redis_key)
                raws = await pipe.execute()
        except Exception as exc:  # a Redis failure is a miss, never an error
            self._failed("GET", exc)
            return [None] * len(keys)
        now_ms = int(time.time() * 1000)
        return [
            None if raw is None else decode_entry(raw, signer, redis_key, now_ms)
            for raw, redis_key in zip(raws, redis_keys, strict=True)
        ]

    async def put_many(
        self, scope: str, outcomes: list[tuple[str, CachedOutcome, float | None]]
    ) -> None:
        """:meth:`put` of many ``(key, outcome, ttl)`` in one round trip; call only after the
        PostgreSQL commit that made them final."""
        signer = self._signer
        if not outcomes or signer is None or not self.available():
            return
        now_ms = int(time.time() * 1000)
        try:
            if self._pool is not None:  # a single Redis: the SETs packed here, in one write
                packed, count = self._pack_sets(scope, outcomes, signer, now_ms)
                if count:
                    await self._exchange(lambda connection: [packed], count)
                return
            pipe = self._client.pipeline(transaction=False)
            for key, outcome, ttl in outcomes:
                px = self._ttl_ms if ttl is None else max(1, min(self._ttl_ms, int(ttl * 1000)))
                redis_key = self.redis_key(scope, key)
                entry = encode_entry(outcome, signer, redis_key, now_ms + px)
                if entry is not None:
                    pipe.set(redis_key, entry, px=px)
            await pipe.execute()
        except Exception as exc:  # after the commit: the outcomes stand, whatever Redis does
            self._failed("SET", exc)

    async def release(self) -> None:
        """Give the connections kept aside back to the client's pool (the client stays open),
        and from now on each one after its command."""
        self._released = True
        idle, self._idle = self._idle, []
        if self._pool is not None and self._pid == os.getpid():
            for connection in idle:
                await self._pool.release(connection)

    async def close(self) -> None:
        await self.release()
        await self._client.aclose()


def _plain_pool(client: object) -> ConnectionPool | None:
    """The client's connection pool, if it is redis-py's plain one, which makes a connection
    whenever asked (see AsyncOutcomeCache._call); else ``None``."""
    if type(client) is not Redis or getattr(client, "connection", None) is not None:
        return None
    pool = getattr(client, "connection_pool", None)
    return pool if type(pool) is ConnectionPool else None
