"""Units of work on Django's own connection, inside the transaction Django commits.

Invariant: the unit of work claims its key in a savepoint (Django's ``atomic()``) of the
connection's transaction -- or in the transaction itself when none is open -- and writes the
key's row and its outbox rows there; it never commits or rolls back a transaction the caller
opened. Redis learns an outcome only after Django's commit, by reading the key's row back on a
connection of the toolkit's own (``transaction.on_commit``, see :mod:`outbox.uow`'s joined units
of work). The statements and every decision are the SQLAlchemy doors' own.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DatabaseError, connections, transaction

from outbox._core import claim, validate as _validate
from outbox._core.failures import is_permanent
from outbox._pg.errors import (
    split_error,
    split_refused,
    undefined_table,
    unique_violation_of,
    unmigrated,
)
from outbox._pg.statements import idempotency_key_complete_joined, joined_statements
from outbox.config import DEFAULT_SCOPE
from outbox.django._settings import alias_of, outbox_for
from outbox.errors import KeyInProgress
from outbox.uow import UnitOfWork

log = logging.getLogger("outbox.django")

# The keys a connection's current transaction claimed (the key's advisory lock is re-entrant
# within one server session: without this, a unit of work for a key already open in the same
# transaction would be let in and run its body twice).
_TAKEN = "_outbox_taken_keys"


def _pyformat(sql: str) -> str:
    """A text() clause's ``:name`` parameters in psycopg's ``%(name)s`` form."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))


@functools.cache
def _statements(schema: str | None) -> dict[str, str]:
    sql = joined_statements(schema)
    return {
        name: _pyformat(getattr(sql, name).text)
        for name in ("idempotency_key_claim", "idempotency_key_fail", "idempotency_key_held",
                     "idempotency_key_relock")
    }  # fmt: skip


@functools.lru_cache(maxsize=256)
def _complete(schema: str | None, events: int, locks: int) -> str:
    return _pyformat(idempotency_key_complete_joined(schema, events, locks).text)


def _cause(exc: BaseException) -> BaseException:
    """psycopg's error behind Django's wrapper."""
    return exc.__cause__ if isinstance(exc, DatabaseError) and exc.__cause__ else exc


@contextmanager
def unit_of_work(
    key: str,
    scope: str = DEFAULT_SCOPE,
    fingerprint: str | None = None,
    *,
    using: str | None = None,
) -> Iterator[UnitOfWork]:
    """Run a block of work at most once for ``(scope, key)`` on Django's connection.

    Inside ``transaction.atomic()`` (or ``ATOMIC_REQUESTS``) the unit of work runs in a
    savepoint and commits with the caller's transaction; outside one it is a transaction of its
    own that commits when the block ends. Write business rows with the Django ORM on the same
    database alias; ``uow.publish()`` buffers events, ``uow.result`` is stored with the key.
    ``uow.replayed`` is true for a duplicate of a completed key (``uow.result`` holds the
    stored result). Raises :class:`~outbox.errors.KeyInProgress`,
    :class:`~outbox.errors.PreviouslyFailed` and :class:`~outbox.errors.KeyReuseError` as
    :meth:`outbox.Outbox.unit_of_work` does; :class:`~outbox.errors.PermanentError` (and
    ``OutboxConfig.permanent_errors``) records the failure with the transaction.
    """
    _validate.check_key(key)
    _validate.check_scope(scope)
    _validate.check_fingerprint(fingerprint)
    alias = alias_of(using)
    ob = outbox_for(alias)
    outcomes = ob._outcomes
    cached = outcomes.cached(scope, key)
    if cached is not None:
        yield outcomes.replay(scope, key, fingerprint, None, cached, "redis")
        return
    schema = ob.config.schema
    sql = _statements(schema)
    connection = connections[alias]
    if not connection.in_atomic_block:
        setattr(connection, _TAKEN, set())  # a new transaction holds no key yet
    taken: set[int] = getattr(connection, _TAKEN, None) or set()
    setattr(connection, _TAKEN, taken)
    lock_id = claim.lock_id(scope, key)
    unit = secrets.token_hex(8)
    failure: BaseException | None = None
    with transaction.atomic(using=alias):  # the claim's savepoint (or the transaction)
        try:
            with connection.cursor() as cursor:
                if lock_id in taken:
                    cursor.execute(sql["idempotency_key_held"], {"lock_id": lock_id})
                    if cursor.fetchone()[0]:
                        raise KeyInProgress(scope, key)
                cursor.execute(
                    sql["idempotency_key_claim"],
                    {"lock_id": lock_id, "scope": scope, "key": key, "unit": unit},
                )
                acquired, status, stored_fp, result_json, error, age = cursor.fetchone()
        except DatabaseError as exc:
            if undefined_table(_cause(exc)):
                raise unmigrated(schema) from exc
            raise
        if not (status is None and acquired):
            row = (status, stored_fp, result_json, error, age)
            replay = outcomes.replay_claimed(scope, key, fingerprint, None, acquired, *row)
            yield replay
            return
        taken.add(lock_id)
        uow = UnitOfWork(ob, scope, key, fingerprint, None, replayed=False)
        try:
            with transaction.atomic(using=alias):  # the body's savepoint
                yield uow
        except BaseException as exc:
            if not is_permanent(exc, ob.config.permanent_errors):
                taken.discard(lock_id)
                raise  # the claim's savepoint rolls back too: the key stays free
            failure = exc
        if failure is None:
            _finish(connection, uow, schema, unit)
            wake = bool(uow.event_ids)
        else:
            # The body's savepoint is gone; the claim's still holds the key's lock.
            with connection.cursor() as cursor:
                cursor.execute(
                    sql["idempotency_key_fail"],
                    {"scope": scope, "key": key, "fingerprint": fingerprint,
                     "error": claim.failure_text(failure)},
                )  # fmt: skip
            wake = False
        transaction.on_commit(ob._joined._after_commit(scope, key, wake), using=alias)
    if failure is not None:
        raise failure


def _finish(connection: Any, uow: UnitOfWork, schema: str | None, unit: str) -> None:
    """The key's final row and the outbox rows, in the claim's savepoint."""
    done = uow.complete()
    params, _size, locks = done.bind(schema)
    params["unit"] = unit
    try:
        with connection.cursor() as cursor:
            cursor.execute(_complete(schema, len(done.events), locks), params)
    except DatabaseError as exc:
        cause = _cause(exc)
        if unique_violation_of(cause, "idempotency_keys_pkey"):
            raise KeyInProgress(uow.scope, uow.key) from exc
        if split_refused(cause):
            raise split_error() from exc
        raise


def idempotent(
    key: Callable[..., str],
    *,
    scope: str = DEFAULT_SCOPE,
    fingerprint: Callable[..., str | None] | None = None,
    using: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function in :func:`unit_of_work` keyed by ``key(*args, **kwargs)``;
    the function's return value is the stored result, and a duplicate returns it without
    running the function."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            fp = fingerprint(*args, **kwargs) if fingerprint is not None else None
            with unit_of_work(key(*args, **kwargs), scope, fp, using=using) as uow:
                if uow.replayed:
                    return uow.result
                uow.result = fn(*args, **kwargs, uow=uow)
                return uow.result

        return wrapper

    return decorate
