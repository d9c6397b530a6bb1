"""The unit of work a caller holds: the handle its body writes through, which also ends itself.

Invariant: a replayed unit of work writes nothing, and a unit of work ends by closing what it
opened -- its own session, the savepoint it runs in, its own transaction -- never the caller's
session or transaction, nor a batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from outbox._core import results, validate as _validate
from outbox._core.typed_results import TypedResult
from outbox._pg.transaction_async import AsyncTransaction
from outbox.uow._unit_base import (
    Completion,
    ReplaySource,
    UnitBase,
    _Owner,
    _refuse_session_commit,
)


@dataclass(slots=True)
class Joined:
    """A unit of work inside the caller's transaction: its connection, the savepoint the unit
    of work runs in, and the caller's session (if it handed one over)."""

    connection: AsyncConnection
    savepoint: Any
    session: AsyncSession | None
    server: tuple[Any, Any] | None = None  # psycopg's connection and its cancel key
    unit: str = ""  # the claim's token (outbox._pg.statements.UNIT_SETTING)


class AsyncUnitOfWork(UnitBase):
    """One attempt at the work for an idempotency key.

    ``replayed`` is true for a duplicate of a completed key: ``result`` holds the stored result
    and every write (``session``, ``connection``, ``publish``, assigning ``result``) raises
    :class:`~outbox.errors.ReplayedWriteError`. ``replayed_from`` says where the stored outcome
    came from: ``"redis"`` or ``"postgres"`` (``None`` unless replayed).
    """

    def __init__(
        self,
        outbox: _Owner,
        scope: str,
        key: str,
        fingerprint: str | None,
        tx: AsyncTransaction | None,
        replayed: bool,
        result: Any = None,
        joined: Joined | None = None,
        typed: TypedResult | None = None,
        *,
        shared: bool = False,
        replayed_from: ReplaySource | None = None,
    ) -> None:
        super().__init__(outbox, scope, key, fingerprint, replayed, result, typed, replayed_from)
        self._joined = joined
        self._shared = shared  # ``tx`` is a batch's: closing the unit of work leaves it open
        self._tx = tx
        self._session: AsyncSession | None = None

    @property
    def connection(self) -> AsyncConnection:
        """SQLAlchemy Core connection inside the unit of work's transaction."""
        if self.replayed:
            raise self._refuse("database access")
        if self._joined is not None:
            return self._joined.connection
        if self._tx is None:
            raise self._ended("uow.connection")
        return self._tx.connection

    @property
    def session(self) -> AsyncSession:
        """SQLAlchemy ORM session in the same transaction: the caller's own when it handed one
        over (``session=``), else one bound to the unit of work's connection (created on first
        use)."""
        if self.replayed:
            raise self._refuse("database access")
        joined = self._joined
        if joined is not None and joined.session is not None:
            return joined.session
        if self._session is None:
            if joined is not None:
                self._session = AsyncSession(bind=joined.connection, autoflush=True)
            elif self._tx is not None:
                self._session = AsyncSession(bind=self._tx.connection, autoflush=True)
            else:
                raise self._ended("uow.session")
            # The session's commit() would only flush (its connection's transaction is the
            # unit of work's): refused like the connection's, so no one believes it committed.
            event.listen(self._session.sync_session, "before_commit", _refuse_session_commit)
        return self._session

    # -- the end of the unit of work: called by the with-block's end, not by the body -------

    async def complete(self) -> Completion:
        """Flush the body's session and take what the key's final row stores: the result's
        exact JSON text and the buffered events. Raises
        :class:`~outbox.errors.SerializationError` for a result that cannot be stored."""
        result_json = _validate.dumps_json(self._stored, "uow.result")
        joined = self._joined
        if joined is not None and joined.session is not None:
            await joined.session.flush()
        if self._session is not None:
            await self._session.flush()
        stored = results.for_database(result_json, self._result)
        return Completion(self.scope, self.key, self.fingerprint, result_json, stored, self._events)

    async def close_session(self) -> None:
        """Close the unit of work's own session (never the caller's)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def close(self) -> None:
        """End the unit of work: roll back to its savepoint if that is still open, close its own
        session, and close its own transaction (rolling back what is not committed) -- a batch's
        stays open."""
        joined = self._joined
        try:
            if joined is not None and joined.savepoint.is_active:
                await joined.savepoint.rollback()
        finally:
            await self.close_session()
        if self._tx is not None and not self._shared:
            tx, self._tx = self._tx, None
            await tx.close()
