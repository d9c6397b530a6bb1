# generated from outbox/uow/_unit_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/uow/_unit_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session

from outbox._core import results, validate as _validate
from outbox._core.typed_results import TypedResult
from outbox._pg.transaction import Transaction
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

    connection: Connection
    savepoint: Any
    session: Session | None
    server: tuple[Any, Any] | None = None  # psycopg's connection and its cancel key
    unit: str = ""  # the claim's token (outbox._pg.statements.UNIT_SETTING)


class UnitOfWork(UnitBase):
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
        tx: Transaction | None,
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
        self._session: Session | None = None

    @property
    def connection(self) -> Connection:
        """SQLAlchemy Core connection inside the unit of work's transaction."""
        if self.replayed:
            raise self._refuse("database access")
        if self._joined is not None:
            return self._joined.connection
        if self._tx is None:
            raise self._ended("uow.connection")
        return self._tx.connection

    @property
    def session(self) -> Session:
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
                self._session = Session(bind=joined.connection, autoflush=True)
            elif self._tx is not None:
                self._session = Session(bind=self._tx.connection, autoflush=True)
            else:
                raise self._ended("uow.session")
            # The session's commit() would only flush (its connection's transaction is the
            # unit of work's): refused like the connection's, so no one believes it committed.
            event.listen(self._session, "before_commit", _refuse_session_commit)
        return self._session

    # -- the end of the unit of work: called by the with-block's end, not by the body -------

    def complete(self) -> Completion:
        """Flush the body's session and take what the key's final row stores: the result's
        exact JSON text and the buffered events. Raises
        :class:`~outbox.errors.SerializationError` for a result that cannot be stored."""
        result_json = _validate.dumps_json(self._stored, "uow.result")
        joined = self._joined
        if joined is not None and joined.session is not None:
            joined.session.flush()
        if self._session is not None:
            self._session.flush()
        stored = results.for_database(result_json, self._result)
        return Completion(self.scope, self.key, self.fingerprint, result_json, stored, self._events)

    def close_session(self) -> None:
        """Close the unit of work's own session (never the caller's)."""
        session, self._session = self._session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        """End the unit of work: roll back to its savepoint if that is still open, close its own
        session, and close its own transaction (rolling back what is not committed) -- a batch's
        stays open."""
        joined = self._joined
        try:
            if joined is not None and joined.savepoint.is_active:
                joined.savepoint.rollback()
        finally:
            self.close_session()
        if self._tx is not None and not self._shared:
            tx, self._tx = self._tx, None
            tx.close()
