# generated from outbox/uow/_outcomes_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/uow/_outcomes_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine

from outbox._core import claim, results
from outbox._core.claim import StoredOutcome
from outbox._core.typed_results import TypedResult
from outbox._pg.identity import for_paramstyle, identity_of
from outbox._redis.cache import OutcomeCache
from outbox.config import OutboxConfig
from outbox.uow._unit import UnitOfWork
from outbox.uow._unit_base import ReplaySource


class Outcomes:
    """The claim's cache read and replay, shared by owned and joined units of work."""

    def __init__(
        self,
        config: OutboxConfig,
        engine: Engine,
        cache: OutcomeCache | None,
        identity: tuple[str, Any],
    ) -> None:
        self.config = config
        self._engine = engine
        self._cache = cache
        self._identity = identity

    def cached(self, scope: str, key: str) -> StoredOutcome | None:
        """The outcome Redis holds for the key, if there is a cache and it can vouch for it."""
        cache = self._cache
        if cache is None or not cache.read_ahead.wanted():
            # No duplicate lately: the claim answers one, and caches it (replay_claimed).
            return None
        if not cache.trusted and cache.available():
            # Once per process: the key of this database's entries (outbox._pg.identity).
            statement, params = self._identity
            try:
                with self._engine.connect() as conn:
                    generation = cache.generation
                    result = conn.exec_driver_sql(
                        *for_paramstyle(statement, params, conn.dialect.paramstyle)
                    )
                    identity = identity_of(result.first())
            except Exception as exc:  # the database decides without the cache
                cache.untrusted(exc)
                return None
            cache.trust(generation, *identity)
        outcome = cache.get(scope, key)
        if outcome is None:
            cache.read_ahead.missed()
        else:
            cache.read_ahead.seen()
        return outcome

    def replay(
        self,
        scope: str,
        key: str,
        fingerprint: str | None,
        typed: TypedResult | None,
        stored: StoredOutcome,
        source: ReplaySource,
    ) -> UnitOfWork:
        """The replayed unit of work of a stored outcome (read from ``source``); raises what
        the verdict says unless it is a completion."""
        claim.verdict(scope, key, fingerprint, stored, acquired=False)  # raises unless REPLAY
        result = json.loads(stored.result_json) if stored.result_json is not None else None
        return UnitOfWork(
            self, scope, key, fingerprint, None, replayed=True, result=result, typed=typed,
            replayed_from=source,
        )  # fmt: skip

    def replay_claimed(
        self,
        scope: str,
        key: str,
        fingerprint: str | None,
        typed: TypedResult | None,
        acquired: bool,
        status: str | None,
        stored_fp: str | None,
        result_json: str | None,
        error: str | None,
        age: float | None,
    ) -> UnitOfWork:
        """The claim found the key decided or held elsewhere: raise what the verdict says, or
        replay the stored outcome (and warm the cache with it: an earlier transaction committed
        it)."""
        cache = self._cache
        if cache is not None:
            cache.read_ahead.seen()  # a duplicate (or a race for the key): read Redis again
        exact = results.from_database(result_json)
        stored = None if status is None else StoredOutcome(status, stored_fp, exact, error)
        claim.verdict(scope, key, fingerprint, stored, acquired)  # raises KeyInProgress
        assert stored is not None
        if cache is not None:
            ttl = claim.warm_ttl(self.config.cache_ttl, self.config.retention, age)
            if ttl is not None:
                cache.put(scope, key, stored, ttl)
        return self.replay(scope, key, fingerprint, typed, stored, "postgres")
