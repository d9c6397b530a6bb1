"""The unit of work: business rows, the idempotency key and outbox rows in one transaction.

::

    with ob.unit_of_work("order-42", scope="payments") as uow:
        if uow.replayed:
            return uow.result
        uow.session.add(Order(...))
        uow.publish("orders.created", {"id": 42}, key="42")
        uow.result = {"order_id": 42}

How a key is claimed: the first statement tries a transaction-scoped advisory lock derived from
``(scope, key)`` (``pg_try_advisory_xact_lock``, which never waits) and reads any committed outcome
in the same round trip. Holding that lock is the claim: a concurrent attempt fails at once with
:class:`~outbox.errors.KeyInProgress`, also when both attempts see the key for the first time,
and a crashed attempt's lock vanishes with its connection. The key row itself is inserted in
its final state at the end, in the same statement as the outbox rows, so PostgreSQL never
holds a row in a "started" state that another writer would have to wait for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox._core import codec as _codec
from outbox._core import validate as _validate
from outbox._core.failures import is_permanent
from outbox._pg.errors import unique_violation_of
from outbox._pg.statements import Statements, idempotency_key_complete, statements
from outbox._pg.transaction import Transaction, install_guard
from outbox._redis.cache import CachedOutcome, OutcomeCache, make_client
from outbox.config import (
    DEFAULT_SCOPE,
    ENV_DATABASE_URL,
    ENV_REDIS_URL,
    OutboxConfig,
    env,
    normalize_database_url,
)
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    PreviouslyFailed,
    ReplayedWriteError,
)
from outbox.schema import STATUS_COMPLETED, STATUS_FAILED

log = logging.getLogger("outbox.uow")

_MAX_ERROR_TEXT = 4000
# Up to this many bytes of event values, the final statement and COMMIT share one round trip.
_INLINE_LIMIT = 64 * 1024
_INLINE_EVENTS = 16  # one prepared statement per event count, so keep their number bounded


def lock_id(scope: str, key: str) -> int:
    """The signed 64-bit advisory lock id of ``(scope, key)``.

    The single-``bigint`` advisory lock space is used only for keys; lock ids of other
    components use the two-``int4`` form, a separate lock space in PostgreSQL.
    """
    digest = hashlib.blake2b(f"{len(scope)}:{scope}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True, slots=True)
class _Event:
    """An event published in a unit of work, encoded and waiting for the final statement."""

    event_id: uuid.UUID
    topic: str
    key: bytes | None
    value: bytes
    headers_json: str
    key_hash: int


class UnitOfWork:
    """One attempt at the work for an idempotency key.

    ``replayed`` is true for a duplicate of a completed key: ``result`` holds the stored result
    and every write (``session``, ``connection``, ``publish``, assigning ``result``) raises
    :class:`~outbox.errors.ReplayedWriteError`.
    """

    def __init__(
        self,
        outbox: Outbox,
        scope: str,
        key: str,
        fingerprint: str | None,
        tx: Transaction | None,
        replayed: bool,
        result: Any = None,
    ) -> None:
        self._outbox = outbox
        self.scope = scope
        self.key = key
        self.fingerprint = fingerprint
        self.replayed = replayed
        self._tx = tx
        self._session: Session | None = None
        self._result: Any = result
        self._events: list[_Event] = []

    def _refuse(self, what: str) -> ReplayedWriteError:
        return ReplayedWriteError(
            f"{what} inside a replayed unit of work (key {self.key!r}, scope {self.scope!r}): "
            "the key already completed; return uow.result instead of writing"
        )

    @property
    def connection(self) -> sa.Connection:
        """SQLAlchemy Core connection inside the unit of work's transaction."""
        if self.replayed or self._tx is None:
            raise self._refuse("database access")
        return self._tx.connection

    @property
    def session(self) -> Session:
        """SQLAlchemy ORM session bound to the same transaction (created on first use)."""
        if self.replayed or self._tx is None:
            raise self._refuse("database access")
        if self._session is None:
            self._session = Session(bind=self._tx.connection, autoflush=True)
        return self._session

    @property
    def result(self) -> Any:
        """The result stored with the key and replayed to every duplicate (JSON-serializable)."""
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.replayed:
            raise self._refuse("setting the result")
        _validate.dumps_json(value, "uow.result")  # refuse early, before any I/O
        self._result = value

    @property
    def event_ids(self) -> list[uuid.UUID]:
        """Ids of the events published so far in this unit of work."""
        return [event.event_id for event in self._events]

    def publish(
        self,
        topic: str,
        value: Any,
        key: str | bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
    ) -> uuid.UUID:
        """Append an event to the outbox; it is written when the unit of work commits.

        ``value`` may be ``bytes``, ``str`` (UTF-8) or anything JSON-serializable (encoded as
        JSON with a ``content-type: application/json`` header). ``key`` is the Kafka message key
        (``str``, ``bytes`` or ``None``); events with the same key reach Kafka in commit order.
        Returns the event's UUID, also sent as the ``X-Idempotency-Key`` header unless
        ``headers`` sets one. Invalid input raises before anything is written.
        """
        if self.replayed:
            raise self._refuse("publish()")
        _validate.check_topic(topic)
        key_bytes = _validate.encode_message_key(key)
        checked = _validate.check_headers(headers)
        _validate.check_idempotency_header(checked)
        value_bytes, content_type = _validate.encode_value(value)
        _validate.with_content_type(checked, content_type)
        _validate.check_size(key_bytes, value_bytes, checked, self._outbox.config.max_payload_bytes)
        event_id = uuid.uuid4()
        headers_json = json.dumps(_codec.encode_headers(checked), ensure_ascii=False)
        self._events.append(
            _Event(
                event_id,
                topic,
                key_bytes,
                value_bytes,
                headers_json,
                _codec.key_hash(key_bytes, event_id.bytes),
            )
        )
        return event_id


class _Attempt:
    """Context manager returned by :meth:`Outbox.unit_of_work`."""

    __slots__ = ("_fingerprint", "_key", "_outbox", "_scope", "_uow")

    def __init__(self, outbox: Outbox, key: str, scope: str, fingerprint: str | None) -> None:
        self._outbox = outbox
        self._key = key
        self._scope = scope
        self._fingerprint = fingerprint
        self._uow: UnitOfWork | None = None

    def __enter__(self) -> UnitOfWork:
        self._uow = self._outbox._begin(self._key, self._scope, self._fingerprint)
        return self._uow

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        uow = self._uow
        if uow is None or uow.replayed:
            return False
        if exc is None:
            self._outbox._commit(uow)
        else:
            self._outbox._abort(uow, exc)
        return False


class Outbox:
    """Entry point: owns the engine, the optional Redis fast path and the configuration.

    ``Outbox("postgresql+psycopg://...", redis_url="redis://...")`` builds its own engine and Redis
    client; ``Outbox(engine, redis=client)`` uses yours (and leaves closing them to you).
    """

    def __init__(
        self,
        database: str | sa.Engine,
        *,
        redis_url: str | None = None,
        redis: Any = None,
        schema: str | None = None,
        config: OutboxConfig | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if config is None:
            config = OutboxConfig(schema=schema)
        elif schema is not None and schema != config.schema:
            raise ConfigurationError(
                f"schema={schema!r} disagrees with config.schema={config.schema!r}; pass one"
            )
        self.config = config.validate()
        if redis_url is not None and redis is not None:
            raise ConfigurationError("pass either redis_url or redis, not both")
        if isinstance(database, sa.Engine):
            self.engine = database
            self._owns_engine = False
        elif isinstance(database, str):
            options: dict[str, Any] = {"pool_size": 20, "max_overflow": 20}
            options.update(engine_options or {})
            self.engine = sa.create_engine(normalize_database_url(database), **options)
            self._owns_engine = True
        else:
            raise ConfigurationError(
                f"database must be a URL or a SQLAlchemy Engine, got {type(database).__name__}"
            )
        if self.engine.dialect.name != "postgresql":
            raise ConfigurationError(
                f"outbox-kit needs PostgreSQL, got a {self.engine.dialect.name} engine"
            )
        self._owns_redis = redis_url is not None
        client = make_client(redis_url, self.config) if redis_url is not None else redis
        self.cache: OutcomeCache | None = (
            OutcomeCache(client, self.config) if client is not None else None
        )
        self._sql: Statements = statements(self.config.schema)
        install_guard(self.engine)
        from outbox._pg.wakeup import make_notifier, noop

        self._notify = (
            make_notifier(self.engine, client, self.config.schema)
            if self.config.wake_relays
            else noop
        )

    # -- public API -------------------------------------------------------------------------

    def unit_of_work(
        self, key: str, scope: str = DEFAULT_SCOPE, fingerprint: str | None = None
    ) -> _Attempt:
        """Run a block of work at most once for ``(scope, key)``; see :class:`UnitOfWork`.

        Raises :class:`KeyInProgress` when another attempt holds the key right now,
        :class:`PreviouslyFailed` when the key failed permanently, :class:`KeyReuseError` when
        ``fingerprint`` differs from the one stored with the key. Invalid arguments raise a
        :class:`~outbox.errors.ValidationError` before any I/O.
        """
        _validate.check_key(key)
        _validate.check_scope(scope)
        _validate.check_fingerprint(fingerprint)
        return _Attempt(self, key, scope, fingerprint)

    def idempotent(
        self,
        key: str | Callable[..., str],
        *,
        scope: str = DEFAULT_SCOPE,
        fingerprint: Callable[..., str | None] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of :meth:`unit_of_work`; see :func:`outbox.idempotent`."""
        from outbox.decorators import make_idempotent

        return make_idempotent(lambda: self, key, scope, fingerprint)

    def close(self) -> None:
        """Dispose of the engine and Redis client if this object created them."""
        if self._owns_engine:
            self.engine.dispose()
        if self._owns_redis and self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _outcome(
        self,
        scope: str,
        key: str,
        fingerprint: str | None,
        status: str,
        stored_fingerprint: str | None,
        result_json: str | None,
        error: str | None,
    ) -> UnitOfWork:
        if fingerprint is not None and stored_fingerprint not in (None, fingerprint):
            raise KeyReuseError(scope, key)
        if status == STATUS_FAILED:
            raise PreviouslyFailed(scope, key, error or "")
        result = json.loads(result_json) if result_json is not None else None
        return UnitOfWork(self, scope, key, fingerprint, None, replayed=True, result=result)

    def _begin(self, key: str, scope: str, fingerprint: str | None) -> UnitOfWork:
        cache = self.cache
        if cache is not None:
            cached = cache.get(scope, key)
            if cached is not None:
                return self._outcome(
                    scope,
                    key,
                    fingerprint,
                    cached.status,
                    cached.fingerprint,
                    cached.result_json,
                    cached.error,
                )
        tx = Transaction(self.engine)
        try:
            sql = self._sql
            acquired, status, stored_fp, result_json, error, age = tx.begin_with(
                sql.idempotency_key_claim_prepared,
                {"lock_id": lock_id(scope, key), "scope": scope, "key": key},
            )
            if status is None and acquired:
                return UnitOfWork(self, scope, key, fingerprint, tx, replayed=False)
        except BaseException:
            tx.close()
            raise
        tx.finish()  # nothing was written
        if status is None:
            raise KeyInProgress(scope, key)
        if cache is not None:
            # Warm the cache: this outcome was committed by an earlier transaction. Never for
            # longer than PostgreSQL keeps the key (outbox gc deletes it `retention` after its
            # last update): Redis must not answer for a key the database has forgotten.
            ttl = min(self.config.cache_ttl, self.config.retention - float(age or 0.0))
            if ttl >= 1.0:
                cache.put(scope, key, CachedOutcome(status, stored_fp, result_json, error), ttl)
        return self._outcome(scope, key, fingerprint, status, stored_fp, result_json, error)

    def _commit(self, uow: UnitOfWork) -> None:
        tx = uow._tx
        assert tx is not None
        try:
            result_json = _validate.dumps_json(uow._result, "uow.result")
            if uow._session is not None:
                uow._session.flush()
            params: dict[str, Any] = {
                "scope": uow.scope,
                "key": uow.key,
                "fingerprint": uow.fingerprint,
                "result": result_json,
            }
            events = uow._events
            size = 0
            if events:
                for i, e in enumerate(events):
                    params[f"e{i}"] = e.event_id
                    params[f"t{i}"] = e.topic
                    params[f"k{i}"] = e.key
                    params[f"v{i}"] = e.value
                    params[f"h{i}"] = e.headers_json
                    params[f"x{i}"] = e.key_hash
                    size += len(e.value)
            statement = idempotency_key_complete(self.config.schema, len(events))
            if size <= _INLINE_LIMIT and len(events) <= _INLINE_EVENTS:
                tx.commit_with(statement, params)
            else:
                # Large values go as binary parameters rather than quoted literals.
                tx.execute(statement.direct, params)
                tx.commit()
        except BaseException as exc:
            _close(uow)
            if unique_violation_of(exc, "idempotency_keys_pkey"):
                # Another attempt committed the key between our read and our lock: a race
                # of microseconds. Its effects stand; ours were rolled back.
                raise KeyInProgress(uow.scope, uow.key) from exc
            raise
        _close(uow)
        if self.cache is not None:
            self.cache.put(
                uow.scope,
                uow.key,
                CachedOutcome(STATUS_COMPLETED, uow.fingerprint, result_json, None),
            )
        if events:
            self._notify()

    def _abort(self, uow: UnitOfWork, exc: BaseException) -> None:
        permanent = is_permanent(exc, self.config.permanent_errors)
        tx = uow._tx
        if not permanent or tx is None:
            _close(uow)  # rolls back the business writes and the outbox rows
            return
        error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
        key_lock = lock_id(uow.scope, uow.key)
        try:
            # Keep the key held from the body's failure to its record: a concurrent attempt
            # must see either the running attempt (KeyInProgress) or the failure, never a gap
            # in which it would run the body again.
            held = tx.hold(key_lock)
            if uow._session is not None:
                uow._session.close()
                uow._session = None
            locked, recorded = tx.roll_back_and_record(
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
            _close(uow)
        if not locked:
            log.warning(
                "key %r in scope %r failed permanently but another attempt holds it now; "
                "that attempt decides its outcome",
                uow.key,
                uow.scope,
            )
        if recorded and self.cache is not None:
            self.cache.put(
                uow.scope, uow.key, CachedOutcome(STATUS_FAILED, uow.fingerprint, None, error)
            )


def _close(uow: UnitOfWork) -> None:
    if uow._session is not None:
        uow._session.close()
        uow._session = None
    if uow._tx is not None:
        uow._tx.close()
        uow._tx = None


# -- the default Outbox behind module-level functions ------------------------------------------

_default: Outbox | None = None
_default_lock = threading.Lock()


def configure(database: str | sa.Engine | None = None, **options: Any) -> Outbox:
    """Set the default :class:`Outbox` used by :func:`unit_of_work` and :func:`idempotent`.

    Without ``database`` it reads ``OUTBOX_DATABASE_URL`` (and ``OUTBOX_REDIS_URL`` unless
    ``redis_url``/``redis`` is passed). Replaces and closes a previous default.
    """
    global _default
    if database is None:
        database = env(ENV_DATABASE_URL)
        if database is None:
            raise ConfigurationError(
                f"no database configured: call outbox.configure(url) or set {ENV_DATABASE_URL}"
            )
        if "redis_url" not in options and "redis" not in options:
            options["redis_url"] = env(ENV_REDIS_URL)
    new = Outbox(database, **options)
    with _default_lock:
        old, _default = _default, new
    if old is not None:
        old.close()
    return new


def default_outbox() -> Outbox:
    """The default :class:`Outbox`, built from the environment on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                url = env(ENV_DATABASE_URL)
                if url is None:
                    raise ConfigurationError(
                        "no default Outbox: call outbox.configure(url) or set "
                        f"{ENV_DATABASE_URL} (and optionally {ENV_REDIS_URL})"
                    )
                _default = Outbox(url, redis_url=env(ENV_REDIS_URL))
    return _default


def unit_of_work(key: str, scope: str = DEFAULT_SCOPE, fingerprint: str | None = None) -> _Attempt:
    """:meth:`Outbox.unit_of_work` on the default :class:`Outbox`."""
    return default_outbox().unit_of_work(key, scope=scope, fingerprint=fingerprint)
