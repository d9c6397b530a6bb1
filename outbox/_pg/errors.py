"""What a database error means, decided in one place from SQLSTATEs and connection state.

Invariant: services ask these questions of any exception (a SQLAlchemy wrapper, psycopg's or
asyncpg's own)
and never import the driver themselves; the relay and the consumer runner retry an unreachable
or dropped database (:func:`database_unavailable`) without counting an attempt.
"""

from __future__ import annotations

import psycopg
import sqlalchemy as sa

from outbox._pg.statements import UNIT_MISMATCH
from outbox.errors import ConfigurationError, TransactionEndedError


def _origin(exc: BaseException) -> BaseException:
    """The driver's error behind ``exc`` (SQLAlchemy wraps it)."""
    if isinstance(exc, sa.exc.DBAPIError) and isinstance(exc.orig, BaseException):
        return exc.orig
    return exc


def _sqlstate(origin: BaseException) -> str | None:
    """The SQLSTATE of a driver error: psycopg's, asyncpg's, or SQLAlchemy's asyncpg adapter's
    (which keeps asyncpg's as its cause); ``None`` for anything else."""
    state = getattr(origin, "sqlstate", None)
    return state if isinstance(state, str) else None


def _constraint(origin: BaseException) -> str | None:
    if isinstance(origin, psycopg.Error):
        return origin.diag.constraint_name
    for candidate in (origin, origin.__cause__):
        name = getattr(candidate, "constraint_name", None)
        if isinstance(name, str):
            return name
    return None


# SQLSTATEs of a server going away or refusing connections for now (class 08, connection
# exception; admin or crash shutdown; "the database system is starting up").
_UNAVAILABLE_SQLSTATES = ("57P01", "57P02", "57P03")


def database_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` says PostgreSQL could not be reached or dropped the connection, as
    opposed to a statement that failed.

    * An error the server sent decides by its SQLSTATE: connection exceptions (class 08) and
      shutdowns are outages; anything else (deadlock, constraint, a statement or
      idle-in-transaction timeout that also ends the session) is about the work, not the
      database.
    * Without a SQLSTATE it is an outage when SQLAlchemy saw the connection die in use, or when
      opening a connection failed; other client-side errors are not.
    """
    if isinstance(exc, sa.exc.TimeoutError):  # no pooled connection came free in time
        return True
    invalidated = False
    if isinstance(exc, sa.exc.DBAPIError):
        invalidated = bool(exc.connection_invalidated)
        exc = exc.orig if isinstance(exc.orig, BaseException) else exc
    sqlstate = _sqlstate(exc)
    if not isinstance(exc, psycopg.Error):
        if sqlstate is not None:  # asyncpg
            return sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES
        return invalidated
    if sqlstate is not None:
        return sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES
    if invalidated:
        return True
    # psycopg attaches the connection object only to a failed connection attempt.
    return isinstance(exc, psycopg.OperationalError) and exc.pgconn is not None


def unique_violation_of(exc: BaseException, constraint: str) -> bool:
    """True when ``exc`` is a unique violation of ``constraint``."""
    origin = _origin(exc)
    return _sqlstate(origin) == "23505" and _constraint(origin) == constraint


# serialization_failure, deadlock_detected
_CONFLICT_SQLSTATES = ("40001", "40P01")


def transaction_conflict(exc: BaseException) -> bool:
    """True when PostgreSQL rolled the transaction back because of a concurrent one: a
    serialization failure (REPEATABLE READ, SERIALIZABLE) or a deadlock. Nothing was committed,
    and running the same work again may succeed."""
    return _sqlstate(_origin(exc)) in _CONFLICT_SQLSTATES


def split_refused(exc: BaseException) -> bool:
    """True when ``exc`` is the refusal of a final statement that did not run in the
    transaction whose claim set its token (see outbox._pg.statements.UNIT_SETTING)."""
    origin = _origin(exc)
    return _sqlstate(origin) == "22P02" and UNIT_MISMATCH in str(origin)


def split_error() -> TransactionEndedError:
    return TransactionEndedError(
        "the unit of work's final statement did not run in the transaction that claimed its "
        "key, and refused to: the key was not completed and no event was written. Something "
        "between the application and PostgreSQL lost the transaction (a connection pooler in "
        "transaction mode needs OutboxConfig(pooler='transaction')); retry the unit of work"
    )


def undefined_table(exc: BaseException) -> bool:
    """True when ``exc`` says a table does not exist (SQLSTATE 42P01)."""
    return _sqlstate(_origin(exc)) == "42P01"


def unmigrated(schema: str | None) -> ConfigurationError:
    """The error for a database without the toolkit's tables where they are looked for."""
    where = f"schema {schema!r}" if schema else "the search path (schema=None)"
    return ConfigurationError(
        f"the outbox tables are not in {where}: run `outbox migrate` on this database"
        + (f" with --schema {schema}" if schema else "")
        + ", or pass the schema= they were migrated into (Outbox(..., schema=...))"
    )


def is_database_error(exc: BaseException) -> bool:
    """True for any error raised by the database layer (driver or SQLAlchemy)."""
    return isinstance(exc, sa.exc.SQLAlchemyError | psycopg.Error)
