"""Work that must wait for the caller's COMMIT: the cache write and the relays' wake-up.

A unit of work joined to the caller's transaction (or a keyless publish) does not commit; the
caller does, later or never. What must follow the commit -- writing the outcome to Redis
(docs/concepts.md I5: only after the commit) and waking idle relays -- is deferred here and runs
only after the caller's transaction committed. On a rollback it is dropped.

* A ``Session`` (or the sync side of an ``AsyncSession``): its ``after_commit`` and
  ``after_rollback`` events, which fire after the real COMMIT or ROLLBACK.
* A ``Connection``: SQLAlchemy has no after-commit event for connections, only one before it.
  Deferred work moves from "pending" to "committing" when the COMMIT is issued, is dropped if
  the COMMIT fails (``handle_error``) or the transaction rolls back, and runs once the COMMIT
  has returned: when the connection starts its next transaction or goes back to the pool,
  whichever comes first (``with engine.begin() as conn:`` returns it right after the COMMIT).

Callbacks must not raise; one that does is logged and the others still run. These events say
when the caller *said* commit, not what PostgreSQL committed (a caller's savepoint rolled back
around the work, an outer transaction the session was joined to): a callback that must act only
on committed data checks what committed itself (``outbox.uow._joined_async`` reads the key back).

The same events keep a registry of the keys a connection's current transaction holds (:func:`take`,
:func:`holds`), so that a unit of work nested in another one for the same key is refused instead of
re-entering the key's lock.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

log = logging.getLogger("outbox.uow")

_PENDING = "outbox.after_commit.pending"
_COMMITTING = "outbox.after_commit.committing"
_SESSION_HOOKED = "outbox.after_commit.hooked"
_HELD = "outbox.after_commit.held"

Callback = Callable[[], None]

# Engines whose events are hooked (checked on every take(): cheaper than sa.event.contains).
_hooked: weakref.WeakSet[sa.Engine] = weakref.WeakSet()


def spawn(coroutine: Coroutine[Any, Any, Any], into: set[asyncio.Task[Any]]) -> None:
    """Run ``coroutine`` on the running event loop without waiting for it (asyncio only); its
    task stays in ``into`` until it finishes, for its owner to :func:`settle` when it closes."""
    task = asyncio.get_running_loop().create_task(coroutine)
    into.add(task)
    task.add_done_callback(into.discard)


async def settle(tasks: set[asyncio.Task[Any]]) -> None:
    """Wait until the tasks of ``tasks`` that run on this event loop have finished (a task of
    another loop cannot be awaited here)."""
    loop = asyncio.get_running_loop()
    mine = [task for task in tasks if task.get_loop() is loop]
    if mine:
        await asyncio.gather(*mine, return_exceptions=True)


def defer(target: Session | sa.Connection, callback: Callback) -> None:
    """Run ``callback`` after ``target``'s current transaction commits; drop it on rollback."""
    if isinstance(target, Session):
        if not target.info.get(_SESSION_HOOKED):
            sa.event.listen(target, "after_commit", _session_committed)
            sa.event.listen(target, "after_rollback", _session_rolled_back)
            sa.event.listen(target, "after_transaction_end", _session_transaction_ended)
            target.info[_SESSION_HOOKED] = True
        target.info.setdefault(_PENDING, []).append(callback)
        return
    _hook_engine(target.engine)
    target.info.setdefault(_PENDING, []).append(callback)


def _run(callbacks: list[Callback]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # a cache write or a wake-up must never break the caller
            log.exception("event=after_commit_failed")


def _session_committed(session: Session) -> None:
    _run(session.info.pop(_PENDING, []))


def _session_rolled_back(session: Session) -> None:
    session.info.pop(_PENDING, None)


def _session_transaction_ended(session: Session, transaction: Any) -> None:
    # The session's outermost transaction ended without after_commit having taken the work
    # (closed, or its COMMIT failed): drop it, so that a later commit does not run it.
    if transaction.parent is None:
        session.info.pop(_PENDING, None)


# -- keys held by a connection's transaction ----------------------------------------------------


def take(conn: sa.Connection | None, lock_id: int, *, owned: bool = False) -> None:
    r"""Note that ``conn``'s current transaction holds the key lock ``lock_id``.

    ``owned``: the transaction is a unit of work's own, whose end :func:`forget`\ s the keys;
    the engine's events that forget them for a caller's transaction are not needed (an engine
    with listeners costs every statement of its connections a dispatch)."""
    if conn is None:
        return
    if not owned:
        _hook_engine(conn.engine)
    conn.info.setdefault(_HELD, set()).add(lock_id)


def forget(conn: sa.Connection | None) -> None:
    """Forget the keys ``conn``'s transaction held (it ended)."""
    if conn is not None and not conn.invalidated:
        conn.info.pop(_HELD, None)


def release(conn: sa.Connection, lock_id: int) -> None:
    """Forget ``lock_id`` (its savepoint was rolled back, which released it)."""
    if not conn.invalidated:
        conn.info.get(_HELD, set()).discard(lock_id)


def holds(conn: sa.Connection, lock_id: int) -> bool:
    """True when ``conn``'s transaction may hold ``lock_id`` already (taken by a unit of work
    in it and not known to be released). A savepoint of the caller rolled back may have
    released it without an event saying so: ask the server before refusing."""
    return not conn.invalidated and lock_id in conn.info.get(_HELD, ())


# -- connections -------------------------------------------------------------------------------


def _hook_engine(engine: sa.Engine) -> None:
    if engine in _hooked:
        return
    _hooked.add(engine)
    if sa.event.contains(engine, "commit", _committing):
        return
    sa.event.listen(engine, "commit", _committing)
    sa.event.listen(engine, "rollback", _rolled_back)
    sa.event.listen(engine, "handle_error", _failed)
    sa.event.listen(engine, "begin", _next_transaction)
    sa.event.listen(engine.pool, "checkin", _checked_in)


def _committing(conn: sa.Connection) -> None:
    info = conn.info
    info.pop(_HELD, None)
    pending = info.pop(_PENDING, None)
    if pending:
        info.setdefault(_COMMITTING, []).extend(pending)


def _rolled_back(conn: sa.Connection) -> None:
    if conn.invalidated:
        return
    conn.info.pop(_PENDING, None)
    conn.info.pop(_COMMITTING, None)
    conn.info.pop(_HELD, None)


def _failed(context: sa.engine.ExceptionContext) -> None:
    conn = context.connection
    if conn is not None and not conn.invalidated:
        # A COMMIT that raised did not commit; a failed statement is followed by a rollback.
        conn.info.pop(_COMMITTING, None)


def _next_transaction(conn: sa.Connection) -> None:
    if conn.invalidated:
        return
    committed = conn.info.pop(_COMMITTING, None)
    if committed:
        _run(committed)


def _checked_in(_dbapi_connection: Any, record: Any) -> None:
    info = getattr(record, "info", None)
    if info is None:
        return
    info.pop(_PENDING, None)  # returned without a commit: the pool rolls it back
    info.pop(_HELD, None)
    committed = info.pop(_COMMITTING, None)
    if committed:
        _run(committed)
