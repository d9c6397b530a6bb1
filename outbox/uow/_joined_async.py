"""Units of work inside the caller's transaction (``session=`` / ``connection=``).

A joined unit of work claims its key in a savepoint of the caller's transaction and writes its
key and outbox rows there; it never commits or rolls back the caller's transaction. Its Redis
write and the relays' wake-up run only after the caller commits (:mod:`outbox._pg.after_commit`).
The claim's Redis read and replay are shared with owned units of work, so they live here too.

What the caller does with its transaction cannot be known for sure from SQLAlchemy's events: a
savepoint of its own rolled back around the unit of work, a session closed without a commit and
used again, a COMMIT that failed, a session whose "commit" only released a savepoint of an outer
transaction that is rolled back later. So the after-commit hook never writes what the unit of
work produced: it reads the key's row back on a connection of its own, in a new snapshot, and
caches the row only if PostgreSQL shows it committed. A commit that did not contain the row
writes nothing (and a miss only costs the next attempt one claim in PostgreSQL).

:class:`AsyncJoinedUnits` is a base of :class:`outbox.uow.AsyncOutbox`, which provides the
attributes it declares. Written for asyncio; ``outbox/uow/_joined.py`` is generated from it by
``tools/async_to_sync.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from outbox._core import claim, results
from outbox._core.claim import StoredOutcome
from outbox._core.failures import is_permanent
from outbox._pg.after_commit import defer, holds, release, spawn, take
from outbox._pg.errors import split_error, split_refused, unique_violation_of
from outbox._pg.identity import identity_of
from outbox._pg.statements import JoinedStatements, idempotency_key_complete_joined
from outbox._pg.transaction_async import cancel_key, check_caller, stop_abandoned
from outbox._redis.cache_async import AsyncOutcomeCache
from outbox.config import OutboxConfig
from outbox.errors import ConfigurationError, KeyInProgress
from outbox.uow._unit_async import AsyncUnitOfWork, Joined, completion, end_joined

log = logging.getLogger("outbox.uow")


class AsyncJoinedUnits:
    """The claim's cache read and replay, and the joined units of work's sequences."""

    config: OutboxConfig
    engine: AsyncEngine
    cache: AsyncOutcomeCache | None
    _reader: AsyncEngine
    _identity: tuple[str, Any]
    _joined_sql: JoinedStatements
    _notify: Callable[[], None]
    _pooled: bool

    async def _cached(self, cache: AsyncOutcomeCache, scope: str, key: str) -> StoredOutcome | None:
        """The outcome Redis holds for the key, if the cache can vouch for it."""
        if not cache.trusted and cache.available():
            # Once per process: the key of this database's entries (outbox._pg.identity).
            statement, params = self._identity
            try:
                async with self.engine.connect() as conn:
                    generation = cache.generation
                    result = await conn.exec_driver_sql(statement, params)
                    identity = identity_of(result.first())
            except Exception as exc:  # the database decides without the cache
                cache.untrusted(exc)
                return None
            cache.trust(generation, *identity)
        return await cache.get(scope, key)

    def _replay(
        self, scope: str, key: str, fingerprint: str | None, stored: StoredOutcome
    ) -> AsyncUnitOfWork:
        claim.verdict(scope, key, fingerprint, stored, acquired=False)  # raises unless REPLAY
        result = json.loads(stored.result_json) if stored.result_json is not None else None
        return AsyncUnitOfWork(self, scope, key, fingerprint, None, replayed=True, result=result)

    async def _replay_claimed(
        self,
        scope: str,
        key: str,
        fingerprint: str | None,
        acquired: bool,
        status: str | None,
        stored_fp: str | None,
        result_json: str | None,
        error: str | None,
        age: float | None,
    ) -> AsyncUnitOfWork:
        """The claim found the key decided or held elsewhere: raise what the verdict says, or
        replay the stored outcome (and warm the cache with it: an earlier transaction committed
        it)."""
        exact = results.from_database(result_json)
        stored = None if status is None else StoredOutcome(status, stored_fp, exact, error)
        claim.verdict(scope, key, fingerprint, stored, acquired)  # raises KeyInProgress
        assert stored is not None
        cache = self.cache
        if cache is not None:
            ttl = claim.warm_ttl(self.config.cache_ttl, self.config.retention, age)
            if ttl is not None:
                await cache.put(scope, key, stored, ttl)
        return self._replay(scope, key, fingerprint, stored)

    async def _begin_joined(
        self,
        key: str,
        scope: str,
        fingerprint: str | None,
        session: AsyncSession | None,
        connection: AsyncConnection | None,
    ) -> AsyncUnitOfWork:
        cache = self.cache
        if cache is not None:
            cached = await self._cached(cache, scope, key)
            if cached is not None:
                return self._replay(scope, key, fingerprint, cached)
        # The claim runs in the savepoint: its advisory lock is released if the savepoint is
        # rolled back (the body failed) and passes to the caller's transaction when it is
        # released (the body succeeded), to be held until the caller commits or rolls back.
        lock_id = claim.lock_id(scope, key)
        if self._pooled:
            await check_caller(session, connection)
        unit = secrets.token_hex(8)
        if session is not None:
            savepoint: Any = await session.begin_nested()
            conn = await session.connection()
        else:
            assert connection is not None
            savepoint = await connection.begin_nested()
            conn = connection
        try:
            # The key's lock is re-entrant within one server session: a unit of work for the
            # same key already open in this transaction would be let in and run the body twice.
            if holds(_sync(conn), lock_id):
                held = await conn.execute(
                    self._joined_sql.idempotency_key_held, {"lock_id": lock_id}
                )
                if held.scalar():
                    raise KeyInProgress(scope, key)
            result = await conn.execute(
                self._joined_sql.idempotency_key_claim,
                {"lock_id": lock_id, "scope": scope, "key": key, "unit": unit},
            )
            acquired, status, stored_fp, result_json, error, age = result.one()
        except BaseException:
            await savepoint.rollback()
            raise
        if status is None and acquired:
            take(_sync(conn), lock_id)
            joined = Joined(conn, savepoint, session, server=cancel_key(_sync(conn)), unit=unit)
            return AsyncUnitOfWork(
                self, scope, key, fingerprint, None, replayed=False, joined=joined
            )
        await savepoint.rollback()  # nothing was written
        row = (status, stored_fp, result_json, error, age)
        return await self._replay_claimed(scope, key, fingerprint, acquired, *row)

    def _after_commit(self, scope: str, key: str, wake: bool) -> Callable[[], None]:
        cache = self.cache

        def run() -> None:
            if cache is not None:
                spawn(self._learn_committed(cache, scope, key))
            if wake:
                self._notify()

        return run

    async def _learn_committed(self, cache: AsyncOutcomeCache, scope: str, key: str) -> None:
        """Cache the key's outcome if -- and only as -- PostgreSQL committed it.

        Runs after a commit of the caller, on a connection of the toolkit's own: a statement
        there sees only committed rows, so a row found was committed (by the caller's commit,
        or by another attempt since: either way it is the key's outcome), and a row not found
        means the commit did not contain it. Nothing is written then.
        """
        try:
            async with self._reader.connect() as conn:
                result = await conn.execute(
                    self._joined_sql.idempotency_key_read, {"scope": scope, "key": key}
                )
                row = result.first()
        except Exception:  # the cache is only a cache: the next attempt asks PostgreSQL
            log.warning("event=joined_cache_write_skipped scope=%r key=%r", scope, key)
            return
        if row is None:
            return
        status, stored_fp, result_json, error, age = row
        ttl = claim.warm_ttl(self.config.cache_ttl, self.config.retention, age)
        if ttl is not None:
            exact = results.from_database(result_json)  # the result's exact JSON text
            await cache.put(scope, key, StoredOutcome(status, stored_fp, exact, error), ttl)

    def _defer(self, joined: Joined, callback: Callable[[], None]) -> None:
        if joined.session is not None:
            defer(joined.session.sync_session, callback)
        else:
            sync_connection = joined.connection.sync_connection
            assert sync_connection is not None
            defer(sync_connection, callback)

    async def _commit_joined(self, uow: AsyncUnitOfWork, joined: Joined) -> None:
        events = uow._events
        try:
            if joined.session is not None:
                await joined.session.flush()
            _result_json, params, _size, locks = await completion(uow, self.config.schema)
            params["unit"] = joined.unit
            statement = idempotency_key_complete_joined(self.config.schema, len(events), locks)
            await joined.connection.execute(statement, params)
            await joined.savepoint.commit()
        except BaseException as exc:
            if joined.server is not None and not isinstance(exc, Exception):
                # Interrupted, maybe while the final statement waited on an order lock: the
                # server must not go on holding the key for a client that gave up.
                stop_abandoned(*joined.server, again=True)
            if split_refused(exc):
                # The savepoint went with the lost transaction: rolling back to it fails too.
                with contextlib.suppress(Exception):
                    await end_joined(uow, joined, rollback=True)
                raise split_error() from exc
            await end_joined(uow, joined, rollback=True)
            if unique_violation_of(exc, "idempotency_keys_pkey"):
                raise KeyInProgress(uow.scope, uow.key) from exc
            raise
        await end_joined(uow, joined, rollback=False)
        self._defer(joined, self._after_commit(uow.scope, uow.key, bool(events)))

    async def _abort_joined(self, uow: AsyncUnitOfWork, joined: Joined, exc: BaseException) -> None:
        # Roll back to the savepoint: the body's writes go, the caller's other writes stay,
        # and so does the key's lock.
        await end_joined(uow, joined, rollback=True)
        lock_id = claim.lock_id(uow.scope, uow.key)
        release(_sync(joined.connection), lock_id)
        permanent = is_permanent(exc, self.config.permanent_errors)
        if not permanent:
            return
        error = claim.failure_text(exc)
        # The savepoint's rollback released the key's lock: take it again in the caller's
        # transaction, never waiting. Another attempt that took it in between decides the
        # outcome instead (as in an owned unit of work).
        result = await joined.connection.execute(
            self._joined_sql.idempotency_key_relock, {"lock_id": lock_id}
        )
        if not result.scalar():
            log.warning(
                "key %r in scope %r failed permanently but another attempt holds it now; "
                "that attempt decides its outcome",
                uow.key,
                uow.scope,
            )
            return
        take(_sync(joined.connection), lock_id)
        recorded = await joined.connection.execute(
            self._joined_sql.idempotency_key_fail,
            {"scope": uow.scope, "key": uow.key, "fingerprint": uow.fingerprint, "error": error},
        )
        if recorded.rowcount == 1:
            self._defer(joined, self._after_commit(uow.scope, uow.key, False))


def _sync(connection: AsyncConnection) -> Any:
    """The SQLAlchemy connection whose ``info`` follows the caller's transaction."""
    return connection.sync_connection


def check_joinable(session: object, connection: object, *, required: bool = False) -> None:
    if session is not None and connection is not None:
        raise ConfigurationError("pass either session= or connection=, not both")
    if session is not None and not isinstance(session, AsyncSession):
        raise ConfigurationError(
            f"session= must be a SQLAlchemy {AsyncSession.__name__} for this outbox's flavour, "
            f"got {type(session).__name__}"
        )
    if connection is not None and not isinstance(connection, AsyncConnection):
        raise ConfigurationError(
            f"connection= must be a SQLAlchemy {AsyncConnection.__name__} for this outbox's "
            f"flavour, got {type(connection).__name__}"
        )
    if required and session is None and connection is None:
        raise ConfigurationError(
            f"publish() needs the caller's {AsyncSession.__name__} or {AsyncConnection.__name__}"
        )
