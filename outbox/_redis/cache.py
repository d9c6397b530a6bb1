# generated from outbox/_redis/cache_async.py by tools/async_to_sync.py; do not edit
"""Redis fast path: remembers outcomes (COMPLETED results, FAILED errors) of committed keys.

Redis is a cache, never the truth. Entries are written only after the PostgreSQL commit,
read and written with single-key commands (safe on Redis Cluster), with bounded timeouts. Any
Redis failure, a slow answer or a malformed entry makes the cache step aside: the caller goes
to PostgreSQL, which decides. After a failure the cache stays out of the way for a short while
(``cache_retry_after``) so that a Redis outage does not add a timeout to every call.

This asyncio module is the source; ``cache.py`` (the sync flavour) is generated from it by
``tools/async_to_sync.py``.
"""

from __future__ import annotations

import logging
import threading
import time

from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from outbox._core.claim import StoredOutcome
from outbox._redis.entry import decode_entry, encode_entry
from outbox.config import OutboxConfig, redact_url
from outbox.errors import ConfigurationError

log = logging.getLogger("outbox.cache")


# An outcome as the cache holds it: the same record the claim decides on.
CachedOutcome = StoredOutcome


def make_client(url: str, config: OutboxConfig) -> Redis:
    """A redis-py client with bounded timeouts and no retries (a miss is cheaper than a wait)."""
    try:
        return Redis.from_url(
            url,
            socket_timeout=config.cache_socket_timeout,
            socket_connect_timeout=config.cache_connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
    except ValueError as exc:
        raise ConfigurationError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc


class OutcomeCache:
    """Reads and writes outcomes of ``(scope, key)`` in Redis, never raising to the caller."""

    def __init__(self, client: Redis, config: OutboxConfig) -> None:
        self._client = client
        self._prefix = config.cache_prefix
        self._ttl_ms = max(1, int(config.cache_ttl * 1000))
        self._retry_after = config.cache_retry_after
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def client(self) -> Redis:
        return self._client

    def redis_key(self, scope: str, key: str) -> str:
        # Length-prefixed so that ("a:b", "c") and ("a", "b:c") never share an entry. The whole
        # entry is one Redis key, so every command is single-key and Cluster-safe.
        return f"{self._prefix}:{len(scope)}:{scope}:{key}"

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            first = self.available()
            self._down_until = time.monotonic() + self._retry_after
        if first:
            log.warning(
                "redis %s failed (%s: %s); fast path skipped for %.1fs",
                op,
                type(exc).__name__,
                exc,
                self._retry_after,
            )

    def get(self, scope: str, key: str) -> CachedOutcome | None:
        """The cached outcome, or ``None`` on a miss, a Redis failure or a malformed entry."""
        if not self.available():
            return None
        try:
            raw = self._client.get(self.redis_key(scope, key))
        except (RedisError, OSError) as exc:
            self._failed("GET", exc)
            return None
        if raw is None:
            return None
        return decode_entry(raw)

    def put(self, scope: str, key: str, outcome: CachedOutcome, ttl: float | None = None) -> None:
        """Remember an outcome for ``ttl`` seconds (default ``cache_ttl``); call only after the
        PostgreSQL commit that made it final."""
        if not self.available():
            return
        try:
            px = self._ttl_ms if ttl is None else max(1, min(self._ttl_ms, int(ttl * 1000)))
            self._client.set(self.redis_key(scope, key), encode_entry(outcome), px=px)
        except (RedisError, OSError) as exc:
            self._failed("SET", exc)

    def get_many(self, scope: str, keys: list[str]) -> list[CachedOutcome | None]:
        """:meth:`get` of many keys in one round trip (a pipeline of single-key reads, which
        Redis Cluster splits by node); every answer is ``None`` when Redis fails."""
        if not keys or not self.available():
            return [None] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self.redis_key(scope, key))
            raws = pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("GET", exc)
            return [None] * len(keys)
        return [None if raw is None else decode_entry(raw) for raw in raws]

    def put_many(self, scope: str, outcomes: list[tuple[str, CachedOutcome, float | None]]) -> None:
        """:meth:`put` of many ``(key, outcome, ttl)`` in one round trip; call only after the
        PostgreSQL commit that made them final."""
        if not outcomes or not self.available():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, outcome, ttl in outcomes:
                px = self._ttl_ms if ttl is None else max(1, min(self._ttl_ms, int(ttl * 1000)))
                pipe.set(self.redis_key(scope, key), encode_entry(outcome), px=px)
            pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("SET", exc)

    def close(self) -> None:
        self._client.close()
