"""What both flavours of the outcome cache (:mod:`outbox._redis.cache_async` and its sync
twin) share: the settings, the entries' Redis keys, the outage window and the key of the
database's entries. Nothing here waits on Redis, so it is written once, not generated."""

from __future__ import annotations

import logging
import threading
import time

from outbox._core.claim import StoredOutcome
from outbox._core.readahead import ReadAhead
from outbox._core.redact import one_line
from outbox._redis.entry import Signer, derive_key, encode_entry
from outbox.config import OutboxConfig

log = logging.getLogger("outbox.cache")


class CacheBase:
    """The state and the decisions of an outcome cache that are not about its client."""

    def __init__(self, config: OutboxConfig) -> None:
        self._prefix = config.cache_prefix
        self._ttl_ms = max(1, int(config.cache_ttl * 1000))
        self._retry_after = config.cache_retry_after
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._signer: Signer | None = None
        self._generation = 0
        self._untrusted_warned = False
        # Whether a unit of work asks Redis before its claim (outbox._core.readahead).
        self.read_ahead = ReadAhead()
        # How the client encodes a str argument (redis-py's encoder): the SETs :meth:`_pack_sets`
        # packs itself name the same keys as the commands the client packs.
        self._encoding = ("utf-8", "strict")

    def redis_key(self, scope: str, key: str) -> str:
        # Length-prefixed so that ("a:b", "c") and ("a", "b:c") never share an entry. The whole
        # entry is one Redis key, so every command is single-key and Cluster-safe.
        return f"{self._prefix}:{len(scope)}:{scope}:{key}"

    def _pack_sets(
        self,
        scope: str,
        outcomes: list[tuple[str, StoredOutcome, float | None]],
        signer: Signer,
        now_ms: int,
    ) -> tuple[bytes, int]:
        """``SET <entry key> <signed entry> PX <ttl>`` of each ``(key, outcome, ttl)`` (``ttl``
        None: ``cache_ttl``), in Redis's wire format, ready to be written at once; and how many
        commands it holds (an entry too large to cache has none). The same bytes as redis-py
        packs for ``client.set(redis_key, entry, px=px)``, minus the cost of its encoder, which
        is most of a pipeline's time."""
        encoding, errors = self._encoding
        parts: list[bytes] = []
        for key, outcome, ttl in outcomes:
            px = self._ttl_ms if ttl is None else max(1, min(self._ttl_ms, int(ttl * 1000)))
            redis_key = self.redis_key(scope, key)
            entry = encode_entry(outcome, signer, redis_key, now_ms + px)
            if entry is None:
                continue
            name = redis_key.encode(encoding, errors)
            ms = b"%d" % px
            parts.append(
                b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nPX\r\n$%d\r\n%b\r\n"
                % (len(name), name, len(entry), entry, len(ms), ms)
            )
        return b"".join(parts), len(parts)

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    # -- the database's key ------------------------------------------------------------------

    @property
    def trusted(self) -> bool:
        """True once the key of the database's entries is known (see :meth:`trust`)."""
        return self._signer is not None

    @property
    def generation(self) -> int:
        """Changes whenever :meth:`forget` is called; read it before reading the identity."""
        return self._generation

    def trust(
        self,
        generation: int,
        secret: bytes,
        database_oid: int,
        keys_oid: int | None,
        system_identifier: int,
        timeline: int,
    ) -> None:
        """Sign and accept entries with the key of this identity (read by
        :mod:`outbox._pg.identity`) -- unless the identity changed since ``generation`` was
        read, in which case this one may be a previous database's."""
        signer = Signer(derive_key(secret, database_oid, keys_oid, system_identifier, timeline))
        with self._lock:
            if generation == self._generation:
                self._signer = signer

    def reidentify(
        self,
        secret: bytes,
        database_oid: int,
        keys_oid: int | None,
        system_identifier: int,
        timeline: int,
    ) -> None:
        """The identity read on a connection just opened: from now on, the only one trusted."""
        signer = Signer(derive_key(secret, database_oid, keys_oid, system_identifier, timeline))
        with self._lock:
            self._generation += 1
            self._signer = signer

    def forget(self) -> None:
        """Trust nothing until the identity is read again."""
        with self._lock:
            self._generation += 1
            self._signer = None

    def untrusted(self, exc: Exception) -> None:
        """The identity could not be read: step aside for ``cache_retry_after`` seconds."""
        with self._lock:
            self._down_until = time.monotonic() + self._retry_after
            warned, self._untrusted_warned = self._untrusted_warned, True
        (log.debug if warned else log.warning)(
            "the cache's key could not be read from PostgreSQL (%s); fast path skipped for "
            "%.1fs -- is the database migrated (outbox migrate)?",
            one_line(exc),
            self._retry_after,
        )

    def _failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            first = self.available()
            self._down_until = time.monotonic() + self._retry_after
        if first:
            log.warning(
                "redis %s failed (%s); fast path skipped for %.1fs",
                op,
                one_line(exc),
                self._retry_after,
            )
