"""Units of work inside the caller's transaction (``session=`` / ``connection=``).

Invariant: a joined unit of work claims its key in a savepoint of the caller's transaction and
writes its key and outbox rows there; it never commits or rolls back the caller's transaction.
Its Redis write and the relays' wake-up run only after the caller commits
(:mod:`outbox._pg.after_commit`), and the Redis write caches only what PostgreSQL shows committed.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from outbox._core import claim, results
from outbox._core.claim import StoredOutcome
from outbox._core.failures import is_permanent
from outbox._core.typed_results import TypedResult
from outbox._pg.after_commit import defer, holds, release, settle, spawn, take
from outbox._pg.errors import (
    split_error,
    split_refused,
    undefined_table,
    unique_violation_of,
    unmigrated,
)
from outbox._pg.literals import untranslatable
from outbox._pg.readback_async import AsyncKeyReader
from outbox._pg.savepoint_async import (
    INLINE_EVENTS,
    INLINE_LIMIT,
    AsyncDriverSavepoint,
    driver_of,
)
from outbox._pg.statements import (
    JoinedStatements,
    idempotency_key_complete,
    idempotency_key_complete_joined,
    joined_statements,
)
from outbox._pg.transaction_async import check_caller, check_transaction
from outbox._pg.transaction_base import cancel_key, stop_abandoned
from outbox._redis.cache_async import AsyncOutcomeCache
from outbox.config import OutboxConfig
from outbox.errors import ConfigurationError, KeyInProgress
from outbox.uow._outcomes_async import AsyncOutcomes
from outbox.uow._unit_async import AsyncUnitOfWork, Joined

log = logging.getLogger("outbox.uow")


class AsyncJoinedUnits:
    """The joined units of work's sequences: begin, commit, abort, and the after-commit hook.

    What the caller does with its transaction cannot be known for sure from SQLAlchemy's events:
    a savepoint of its own rolled back around the unit of work, a session closed without a
    commit and used again, a COMMIT that failed, a session whose "commit" only released a
    savepoint of an outer transaction that is rolled back later. So the after-commit hook never
    writes what the unit of work produced: it reads the key's row back on a connection of its
    own, in a new snapshot, and caches the row only if PostgreSQL shows it committed. A commit
    that did not contain the row writes nothing (and a miss only costs the next attempt one
    claim in PostgreSQL).
    """

    def __init__(
        self,
        config: OutboxConfig,
        outcomes: AsyncOutcomes,
        reader: AsyncEngine,
        cache: AsyncOutcomeCache | None,
        notify: Callable[[], None],
        *,
        pooled: bool,
    ) -> None:
        self.config = config
        self._outcomes = outcomes
        self._cache = cache
        self._notify = notify
        self._pooled = pooled
        self._sql: JoinedStatements = joined_statements(config.schema)
        self._reader = AsyncKeyReader(
            reader, self._sql.idempotency_key_read, self._sql.idempotency_key_read_waking
        )
        # After close, a caller's commit writes no cache entry (the client is closed).
        self._closed = False
        self._writes: set[Any] = set()  # asyncio only

    async def begin(
        self,
        key: str,
        scope: str,
        fingerprint: str | None,
        typed: TypedResult | None,
        session: AsyncSession | None,
        connection: AsyncConnection | None,
    ) -> tuple[AsyncUnitOfWork, Joined | None]:
        """The unit of work of ``key`` in the caller's transaction, and where it runs (``None``
        for a replay)."""
        # Refused whatever the key's state, a duplicate too: the caller's code is wrong either way.
        await check_transaction(session, connection)
        cached = await self._outcomes.cached(scope, key)
        if cached is not None:
            return self._outcomes.replay(scope, key, fingerprint, typed, cached, "redis"), None
        # The claim runs in the savepoint: its advisory lock is released if the savepoint is
        # rolled back (the body failed) and passes to the caller's transaction when it is
        # released (the body succeeded), to be held until the caller commits or rolls back.
        lock_id = claim.lock_id(scope, key)
        if self._pooled:
            await check_caller(session, connection)
        unit = secrets.token_hex(8)
        params = {"lock_id": lock_id, "scope": scope, "key": key, "unit": unit}
        # A caller's connection on psycopg: the savepoint is set by the driver, in one message
        # with the claim (outbox._pg.savepoint_async). A session's is its own begin_nested(),
        # which its objects follow.
        driver = await driver_of(connection) if connection is not None else None
        savepoint: Any
        if driver is not None:
            assert connection is not None
            conn = connection
            if not conn.in_transaction():
                # What SQLAlchemy's autobegin does at a statement: its commit() then commits.
                await conn.begin()
            savepoint = AsyncDriverSavepoint(conn, driver, unit)
        elif session is not None:
            savepoint = await session.begin_nested()
            conn = await session.connection()
        else:
            assert connection is not None
            savepoint = await connection.begin_nested()
            conn = connection
        try:
            # The key's lock is re-entrant within one server session: a unit of work for the
            # same key already open in this transaction would be let in and run the body twice.
            if holds(_sync(conn), lock_id):
                held = await conn.execute(self._sql.idempotency_key_held, {"lock_id": lock_id})
                if held.scalar():
                    raise KeyInProgress(scope, key)
            if isinstance(savepoint, AsyncDriverSavepoint):
                row = await savepoint.open_with(self._sql.idempotency_key_claim_inline, params)
            else:
                result = await conn.execute(self._sql.idempotency_key_claim, params)
                row = result.one()
            acquired, status, stored_fp, result_json, error, age = row
        except BaseException as exc:
            await savepoint.rollback()
            if undefined_table(exc):
                raise unmigrated(self.config.schema) from exc
            if isinstance(exc, UnicodeEncodeError):
                raise untranslatable(exc) from exc
            raise
        if status is None and acquired:
            take(_sync(conn), lock_id)
            joined = Joined(conn, savepoint, session, server=cancel_key(_sync(conn)), unit=unit)
            uow = AsyncUnitOfWork(
                self, scope, key, fingerprint, None, replayed=False, joined=joined, typed=typed
            )
            return uow, joined
        await savepoint.rollback()  # nothing was written
        row = (status, stored_fp, result_json, error, age)
        replay = await self._outcomes.replay_claimed(scope, key, fingerprint, typed, acquired, *row)
        return replay, None

    def _after_commit(self, scope: str, key: str, wake: bool) -> Callable[[], None]:
        cache = self._cache
        wake = wake and self.config.wake_relays

        def run() -> None:
            if cache is not None and not self._closed:
                spawn(self._learn_committed(cache, scope, key, wake), into=self._writes)
            elif wake:
                self._notify()

        return run

    async def _learn_committed(
        self, cache: AsyncOutcomeCache, scope: str, key: str, wake: bool
    ) -> None:
        """Cache the key's outcome if -- and only as -- PostgreSQL committed it; with
        ``wake``, wake the relays if one waits for work.

        Runs after a commit of the caller, on a connection of the toolkit's own: a statement
        there sees only committed rows, so a row found was committed (by the caller's commit,
        or by another attempt since: either way it is the key's outcome), and a row not found
        means the commit did not contain it. Nothing is written then. The relays' idle probe
        travels in the same statement, after the commit as the wake-up needs it
        (:mod:`outbox._pg.wakeup`): the notifier is called only when a relay waits.
        """
        try:
            row, relay_idle = await self._reader.read(scope, key, waking=wake)
        except Exception:  # the cache is only a cache: the next attempt asks PostgreSQL
            log.warning("event=joined_cache_write_skipped scope=%r key=%r", scope, key)
            if wake:
                self._notify()  # its thread probes for itself
            return
        if relay_idle:
            self._notify()
        if row is None:
            return
        status, stored_fp, result_json, error, age = row
        ttl = claim.warm_ttl(self.config.cache_ttl, self.config.retention, age)
        if ttl is not None:
            exact = results.from_database(result_json)  # the result's exact JSON text
            await cache.put(scope, key, StoredOutcome(status, stored_fp, exact, error), ttl)

    async def close(self) -> None:
        """Finish the cache writes that callers' commits started, and start no more: the outbox
        closes its engine and Redis client next, which a write still under way would reopen."""
        self._closed = True
        await settle(self._writes)  # asyncio only
        await self._reader.close()  # the connections the read-backs keep aside

    def _defer(self, joined: Joined, callback: Callable[[], None]) -> None:
        if joined.session is not None:
            defer(joined.session.sync_session, callback)
        else:
            sync_connection = joined.connection.sync_connection
            assert sync_connection is not None
            defer(sync_connection, callback)

    async def commit(self, uow: AsyncUnitOfWork, joined: Joined) -> None:
        """Write the key's final row and the outbox rows in the savepoint and release it; the
        cache and the relays hear of it after the caller commits."""
        try:
            done = await uow.complete()
            params, size, locks = done.bind(self.config.schema)
            params["unit"] = joined.unit
            savepoint = joined.savepoint
            if (
                isinstance(savepoint, AsyncDriverSavepoint)
                and size <= INLINE_LIMIT
                and len(done.events) <= INLINE_EVENTS
            ):
                # The final statement and the savepoint's release in one message.
                final = idempotency_key_complete(self.config.schema, len(done.events), locks)
                await savepoint.release_with(final, params)
            else:
                # Large values go as binary parameters rather than quoted literals.
                statement = idempotency_key_complete_joined(
                    self.config.schema, len(done.events), locks
                )
                await joined.connection.execute(statement, params)
                await savepoint.commit()
        except BaseException as exc:
            if joined.server is not None and not isinstance(exc, Exception):
                # Interrupted, maybe while the final statement waited on an order lock: the
                # server must not go on holding the key for a client that gave up.
                stop_abandoned(*joined.server, again=True)
            if split_refused(exc):
                # The savepoint went with the lost transaction: rolling back to it fails too.
                with contextlib.suppress(Exception):
                    await uow.close()
                raise split_error() from exc
            await uow.close()
            if unique_violation_of(exc, "idempotency_keys_pkey"):
                raise KeyInProgress(uow.scope, uow.key) from exc
            if isinstance(exc, UnicodeEncodeError):
                raise untranslatable(exc) from exc
            raise
        await uow.close()  # the savepoint is released: only the unit's own session closes
        self._defer(joined, self._after_commit(uow.scope, uow.key, bool(done.events)))

    async def abort(self, uow: AsyncUnitOfWork, joined: Joined, exc: BaseException) -> None:
        """Roll back to the savepoint; record a permanent failure in the caller's transaction."""
        # Roll back to the savepoint: the body's writes go, the caller's other writes stay,
        # and so does the key's lock.
        await uow.close()
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
            self._sql.idempotency_key_relock, {"lock_id": lock_id}
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
            self._sql.idempotency_key_fail,
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
