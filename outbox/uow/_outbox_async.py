"""The unit of work: business rows, the idempotency key and outbox rows in one transaction.

How a key is claimed: the first statement tries a transaction-scoped advisory lock derived from
``(scope, key)`` (``pg_try_advisory_xact_lock``, which never waits) and reads any committed outcome
in the same round trip. Holding that lock is the claim: a concurrent attempt fails at once with
:class:`~outbox.errors.KeyInProgress`, also when both attempts see the key for the first time,
and a crashed attempt's lock vanishes with its connection. The key row itself is inserted in
its final state at the end, in the same statement as the outbox rows, so PostgreSQL never
holds a row in a "started" state that another writer would have to wait for.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar, Literal

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from outbox._core import claim, validate as _validate
from outbox._core.claim import StoredOutcome
from outbox._core.events import event_params
from outbox._core.failures import is_permanent
from outbox._core.typed_results import ResultCodec, TypedResult, typed_result
from outbox._core.urls import check_redis_url
from outbox._pg.after_commit import defer, take
from outbox._pg.engines import engine_for, notifier_engine, reader_engine, transaction_type
from outbox._pg.errors import (
    split_error,
    split_refused,
    undefined_table,
    unique_violation_of,
    unmigrated,
)
from outbox._pg.identity import cache_identity, read_identity
from outbox._pg.pooler import refuse_undeclared_async
from outbox._pg.statements import (
    Statements,
    idempotency_key_complete,
    outbox_insert,
    statements,
)
from outbox._pg.transaction_async import AsyncTransaction, check_caller
from outbox._pg.transaction_base import install_guard
from outbox._pg.wakeup import make_notifier, noop
from outbox._redis.cache_async import AsyncOutcomeCache, make_async_cache_client
from outbox._redis.clients import check_redis_flavour
from outbox.config import DEFAULT_SCOPE, OutboxConfig
from outbox.errors import ConfigurationError, KeyInProgress
from outbox.payloads import CloudEvent, Serializer, encode_publish
from outbox.uow._decorators import make_idempotent
from outbox.uow._joined_async import AsyncJoinedUnits, check_joinable
from outbox.uow._outcomes_async import AsyncOutcomes
from outbox.uow._unit_async import AsyncUnitOfWork, Joined

__all__ = ["AsyncOutbox", "AsyncUnitOfWork"]

log = logging.getLogger("outbox.uow")

_ASYNC = True

# Up to this many bytes of event values, the final statement and COMMIT share one round trip.
_INLINE_LIMIT = 64 * 1024
_INLINE_EVENTS = 16  # one prepared statement per event count, so keep their number bounded


class _AsyncAttempt:
    """Context manager returned by :meth:`AsyncOutbox.unit_of_work`."""

    __slots__ = (
        "_connection", "_fingerprint", "_joined", "_key", "_outbox", "_scope", "_session",
        "_tx", "_typed", "_uow",
    )  # fmt: skip

    def __init__(
        self,
        outbox: AsyncOutbox,
        key: str,
        scope: str,
        fingerprint: str | None,
        session: AsyncSession | None = None,
        connection: AsyncConnection | None = None,
        typed: TypedResult | None = None,
    ) -> None:
        self._outbox = outbox
        self._typed = typed
        self._key = key
        self._scope = scope
        self._fingerprint = fingerprint
        self._session = session
        self._connection = connection
        self._uow: AsyncUnitOfWork | None = None
        # Where the unit of work runs: its own transaction, or a savepoint of the caller's.
        self._tx: AsyncTransaction | None = None
        self._joined: Joined | None = None

    async def __aenter__(self) -> AsyncUnitOfWork:
        outbox, key, scope, fingerprint = self._outbox, self._key, self._scope, self._fingerprint
        if self._session is not None or self._connection is not None:
            await outbox._check_sessions()
            self._uow, self._joined = await outbox._joined.begin(
                key, scope, fingerprint, self._typed, self._session, self._connection
            )
        else:
            self._uow, self._tx = await outbox._begin(key, scope, fingerprint, self._typed)
        return self._uow

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        uow = self._uow
        if uow is None or uow.replayed:
            return False
        if self._joined is not None:
            if exc is None:
                await self._outbox._joined.commit(uow, self._joined)
            else:
                await self._outbox._joined.abort(uow, self._joined, exc)
        elif self._tx is not None:
            if exc is None:
                await self._outbox._commit(uow, self._tx)
            else:
                await self._outbox._abort(uow, self._tx, exc)
        return False


class AsyncOutbox:
    """Entry point: owns the engine, the optional Redis fast path and the configuration.

    ``AsyncOutbox("postgresql+psycopg://...", redis_url="redis://...")`` builds its own engine and
    Redis client; ``AsyncOutbox(engine, redis=client)`` uses yours (and leaves closing them to
    you).
    """

    is_async: ClassVar[bool] = _ASYNC

    def __init__(
        self,
        database: str | AsyncEngine,
        *,
        redis_url: str | None = None,
        redis: Any = None,
        schema: str | None = None,
        config: OutboxConfig | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if config is None:
            config = OutboxConfig(schema=schema)
        elif not isinstance(config, OutboxConfig):
            raise ConfigurationError(f"config must be an OutboxConfig, got {type(config).__name__}")
        elif schema is not None and schema != config.schema:
            raise ConfigurationError(
                f"schema={schema!r} disagrees with config.schema={config.schema!r}; pass one"
            )
        self.config = config.validate()
        if redis_url is not None and redis is not None:
            raise ConfigurationError("pass either redis_url or redis, not both")
        if redis_url is not None:
            check_redis_url(redis_url)
        if redis is not None:
            check_redis_flavour(redis, want_async=_ASYNC)
        # Behind a transaction pooler nothing may rely on the session (see AsyncTransaction).
        self._pooled = self.config.pooler == "transaction"
        engine, self._owns_engine = engine_for(
            database, _ASYNC, engine_options, pooled=self._pooled
        )
        # Undeclared, a transaction pooler is refused: checked once, at the first unit of
        # work that reaches the database (outbox._pg.pooler). Declared either way, not at all.
        self._sessions_checked = self.config.pooler is not None
        self._sessions_refused: ConfigurationError | None = None
        self.engine: AsyncEngine = engine
        # psycopg's transaction, or asyncpg's (outbox._pg.on_asyncpg).
        self._transactions = transaction_type(engine, AsyncTransaction)
        self._owns_redis = redis_url is not None
        client = make_async_cache_client(redis_url, self.config) if redis_url is not None else redis
        self.cache: AsyncOutcomeCache | None = (
            AsyncOutcomeCache(client, self.config) if client is not None else None
        )
        self._identity = cache_identity(self.config.schema)
        self._reader: AsyncEngine = (
            reader_engine(self.engine) if self.cache is not None else self.engine
        )
        if self.cache is not None:
            # A new connection may lead to a recreated or restored database: read its key again.
            event.listen(self.engine.sync_engine.pool, "connect", self._on_connect)
        self._sql: Statements = statements(self.config.schema)
        install_guard(self.engine.sync_engine)
        self._wakes = self.config.wake_relays
        self._notify = (
            make_notifier(notifier_engine(self.engine), client, self.config.schema)
            if self._wakes
            else noop
        )
        self._outcomes = AsyncOutcomes(self.config, self.engine, self.cache, self._identity)
        self._joined = AsyncJoinedUnits(
            self.config, self._outcomes, self._reader, self.cache, self._notify,
            pooled=self._pooled,
        )  # fmt: skip

    # -- public API -------------------------------------------------------------------------

    def unit_of_work(
        self,
        key: str,
        scope: str = DEFAULT_SCOPE,
        fingerprint: str | None = None,
        *,
        session: AsyncSession | None = None,
        connection: AsyncConnection | None = None,
        result_type: Any = None,
        result_codec: ResultCodec | None = None,
    ) -> _AsyncAttempt:
        """Run a block of work at most once for ``(scope, key)``; see :class:`AsyncUnitOfWork`.

        Raises :class:`KeyInProgress` when another attempt holds the key right now,
        :class:`PreviouslyFailed` when the key failed permanently, :class:`KeyReuseError` when
        ``fingerprint`` differs from the one stored with the key. Invalid arguments raise a
        :class:`~outbox.errors.ValidationError` before any I/O.

        With ``session=`` or ``connection=`` the unit of work joins the caller's open
        transaction: it runs in a savepoint and never commits or rolls back the caller's
        transaction. The key, the outbox rows and the business rows become visible when -- and
        only if -- the caller commits; Redis is written and relays are woken only after that
        commit. An exception in the body rolls back to the savepoint and is re-raised;
        :class:`~outbox.errors.PermanentError` records the failure, to commit with the caller.

        ``result_type`` declares the type of ``uow.result`` beyond plain JSON (a pydantic model,
        a dataclass, an enum, ``Literal``, ``Decimal``, ``UUID``, ``datetime``, ``date``, lists,
        tuples, dicts and unions of them): the result is checked to the depth its type
        declares before commit, stored as JSON data, and a replay -- from Redis or PostgreSQL --
        returns an equal value of that type; a type that cannot come back exactly is refused
        here (``ConfigurationError``). ``result_codec`` (``encode(value)`` / ``decode(data)``)
        does the same for other types. See ``docs/payload-formats.md``.
        """
        _validate.check_key(key)
        _validate.check_scope(scope)
        _validate.check_fingerprint(fingerprint)
        check_joinable(session, connection)
        typed = typed_result(result_type, result_codec)
        return _AsyncAttempt(self, key, scope, fingerprint, session, connection, typed)

    async def publish(
        self,
        transaction: AsyncSession | AsyncConnection,
        topic: str,
        value: Any,
        key: str | bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
        *,
        serializer: Serializer | None = None,
        key_serializer: Serializer | None = None,
        cloudevent: CloudEvent | None = None,
    ) -> uuid.UUID:
        """Write one event to the outbox in the caller's transaction, without an idempotency key.

        ``transaction`` is the caller's session or connection; the row becomes visible when --
        and only if -- the caller commits, and ``outbox-relay`` then carries it to Kafka with
        ``X-Idempotency-Key`` set to the returned event id. Same value, key, header, serializer
        and CloudEvent rules as
        :meth:`AsyncUnitOfWork.publish`; invalid input raises before anything is written.
        """
        if isinstance(transaction, AsyncSession):
            session, connection = transaction, None
        else:
            session, connection = None, transaction
        check_joinable(session, connection, required=True)
        event = encode_publish(
            self.config, topic, value, key, headers, serializer, key_serializer, cloudevent
        )
        params: dict[str, Any] = {}
        _size, locks = event_params([event], params, self.config.schema)
        insert = outbox_insert(self.config.schema, locks)
        if self._pooled:
            await check_caller(session, connection)
        await self._check_sessions()
        if session is not None:
            await session.execute(insert, params)
            target: Any = session.sync_session
        else:
            assert connection is not None
            await connection.execute(insert, params)
            target = connection.sync_connection
            assert target is not None
        if self.config.wake_relays:
            defer(target, self._notify)
        return event.event_id

    def idempotent(
        self,
        key: str | Callable[..., str],
        *,
        scope: str = DEFAULT_SCOPE,
        fingerprint: Callable[..., str | None] | Literal[False] | None = None,
        result_type: Any = None,
        result_codec: ResultCodec | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of :meth:`unit_of_work`; see :func:`outbox.idempotent`."""
        return make_idempotent(
            lambda: self, key, scope, fingerprint, is_async=_ASYNC,
            result_type=result_type, result_codec=result_codec,
        )  # fmt: skip

    async def close(self) -> None:
        """Finish the cache writes that joined units of work started after their callers'
        commits, then dispose of the engine and Redis client if this object created them."""
        await self._joined.close()
        if event.contains(self.engine.sync_engine.pool, "connect", self._on_connect):
            event.remove(self.engine.sync_engine.pool, "connect", self._on_connect)
        if self._reader is not self.engine:
            await self._reader.dispose()
        if self._owns_engine:
            await self.engine.dispose()
        if self.cache is not None:
            if self._owns_redis:
                await self.cache.close()
            else:
                await self.cache.release()  # your client stays open

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals --------------------------------------------------------------------------

    async def _check_sessions(self) -> None:
        """Refuse a transaction pooler the configuration does not declare (once per outbox;
        best effort: a database that cannot be reached now is not checked again)."""
        if self._sessions_refused is not None:
            raise self._sessions_refused
        if self._sessions_checked:
            return
        self._sessions_checked = True
        try:
            await refuse_undeclared_async(self.engine)
        except ConfigurationError as exc:
            self._sessions_refused = exc
            raise
        except Exception as exc:
            log.debug("event=pooler_check_skipped error=%r", type(exc).__name__)

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        """The pool opened a connection: read the database's identity on it (the database
        may have been recreated or restored since the cache's key was read)."""
        assert self.cache is not None
        try:
            identity = read_identity(
                dbapi_connection, *self._identity, self.engine.dialect.paramstyle
            )
        except Exception:  # trust nothing; the next unit of work reads the key again
            self.cache.forget()
            return
        self.cache.reidentify(*identity)

    async def _begin(
        self, key: str, scope: str, fingerprint: str | None, typed: TypedResult | None
    ) -> tuple[AsyncUnitOfWork, AsyncTransaction | None]:
        """The unit of work of ``key`` in a transaction of its own, and that transaction
        (``None`` for a replay)."""
        cached = await self._outcomes.cached(scope, key)
        if cached is not None:
            return self._outcomes.replay(scope, key, fingerprint, typed, cached, "redis"), None
        await self._check_sessions()
        tx = await self._transactions.open(self.engine, pooled=self._pooled)
        lock_id = claim.lock_id(scope, key)
        try:
            acquired, status, stored_fp, result_json, error, age = await tx.begin_with(
                self._sql.idempotency_key_claim_prepared,
                {"lock_id": lock_id, "scope": scope, "key": key},
            )
            if status is None and acquired:
                # A unit of work joined to this one's connection for the same key is refused.
                take(tx.connection.sync_connection, lock_id, owned=True)
                uow = AsyncUnitOfWork(
                    self, scope, key, fingerprint, tx, replayed=False, typed=typed
                )
                return uow, tx
        except BaseException as exc:
            await tx.close()
            if undefined_table(exc):
                raise unmigrated(self.config.schema) from exc
            raise
        await tx.finish()  # nothing was written
        row = (status, stored_fp, result_json, error, age)
        replay = await self._outcomes.replay_claimed(scope, key, fingerprint, typed, acquired, *row)
        return replay, None

    async def _commit(self, uow: AsyncUnitOfWork, tx: AsyncTransaction) -> None:
        relay_idle = None
        try:
            done = await uow.complete()
            params, size, locks = done.bind(self.config.schema)
            events = done.events
            statement = idempotency_key_complete(self.config.schema, len(events), locks)
            if size <= _INLINE_LIMIT and len(events) <= _INLINE_EVENTS:
                probe = self._sql.relay_idle_probe if events and self._wakes else None
                relay_idle = await tx.commit_with(statement, params, probe)
            else:
                # Large values go as binary parameters rather than quoted literals.
                await tx.commit_bound(statement, params)
        except BaseException as exc:
            await uow.close()
            if unique_violation_of(exc, "idempotency_keys_pkey"):
                # Another attempt committed the key between our read and our lock: a race
                # of microseconds. Its effects stand; ours were rolled back.
                raise KeyInProgress(uow.scope, uow.key) from exc
            if split_refused(exc):
                raise split_error() from exc
            raise
        await uow.close()
        # No cache write here: Redis learns a completed key lazily, from the first duplicate
        # that PostgreSQL answers (AsyncOutcomes.replay_claimed), so a first attempt -- nearly
        # all of a service's traffic -- pays Redis one read and nothing after its commit.
        if events and relay_idle is not False:  # a relay waits, or no probe was made
            self._notify()

    async def _abort(self, uow: AsyncUnitOfWork, tx: AsyncTransaction, exc: BaseException) -> None:
        permanent = is_permanent(exc, self.config.permanent_errors)
        if not permanent:
            await uow.close()  # rolls back the business writes and the outbox rows
            return
        error = claim.failure_text(exc)
        key_lock = claim.lock_id(uow.scope, uow.key)
        try:
            # Keep the key held from the body's failure to its record: a concurrent attempt
            # must see either the running attempt (KeyInProgress) or the failure, never a gap
            # in which it would run the body again.
            held = await tx.hold(key_lock)
            await uow.close_session()
            locked, recorded = await tx.roll_back_and_record(
                held,
                key_lock,
                self._sql.idempotency_key_fail,
                {
                    "scope": uow.scope,
                    "key": uow.key,
                    "fingerprint": uow.fingerprint,
                    "error": error,
                },
            )
        finally:
            await uow.close()
        if not locked:
            log.warning(
                "key %r in scope %r failed permanently but another attempt holds it now; "
                "that attempt decides its outcome",
                uow.key,
                uow.scope,
            )
        if recorded and self.cache is not None:
            await self.cache.put(
                uow.scope,
                uow.key,
                StoredOutcome(claim.STATUS_FAILED, uow.fingerprint, None, error),
            )
