"""Engines for both flavours: which one a caller handed over, and the ones the toolkit builds.

Not generated: the sync and asyncio units of work both call these to tell an ``Engine`` from an
``AsyncEngine`` and to refuse the wrong one with a clear error.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import psycopg.conninfo
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox._core.redact import redact
from outbox._core.settings import check_int, check_seconds
from outbox._pg.on_asyncpg import AsyncpgTransaction
from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError

# A unit of work holds one connection; room for this many at once before anyone waits.
TransactionT = TypeVar("TransactionT")

DEFAULT_POOL = {"pool_size": 20, "max_overflow": 20}


def engine_for(
    database: object, want_async: bool, options: dict[str, Any] | None, *, pooled: bool = False
) -> Any:
    """``(engine, owned)`` for ``database``: a URL (an engine is built) or an engine of the
    wanted flavour; anything else raises :class:`ConfigurationError`. With ``pooled`` (a
    transaction pooler in between) a built engine's connections never prepare statements."""
    owner = "AsyncOutbox" if want_async else "Outbox"
    wanted = AsyncEngine if want_async else sa.Engine
    other = sa.Engine if want_async else AsyncEngine
    if isinstance(database, wanted):
        engine: Any = database
        owned = False
    elif isinstance(database, other):
        raise ConfigurationError(
            f"{owner} needs {'an AsyncEngine' if want_async else 'a sync Engine'}, got "
            f"{'a sync Engine' if want_async else 'an AsyncEngine'}: use "
            f"{'Outbox' if want_async else 'AsyncOutbox'} for it, or pass a URL"
        )
    elif isinstance(database, str):
        if want_async and database.startswith("postgresql+asyncpg://"):
            # The URL checks and engine_options know libpq's options, not asyncpg's.
            raise ConfigurationError(
                "AsyncOutbox takes asyncpg as an engine, not as a URL: pass "
                'create_async_engine("postgresql+asyncpg://...") (or a postgresql+psycopg:// '
                "URL)"
            )
        if options is not None and not (
            isinstance(options, dict) and all(isinstance(k, str) for k in options)
        ):
            raise ConfigurationError("engine_options must be a dict of create_engine() keywords")
        for name in ("pool_size", "max_overflow"):
            if name in (options or {}):
                check_int(f"engine_options[{name!r}]", (options or {})[name], -1, 100_000)
        for name in ("pool_timeout", "pool_recycle"):
            if name in (options or {}):
                check_seconds(f"engine_options[{name!r}]", (options or {})[name], zero=True)
        merged = {**DEFAULT_POOL, **(options or {})}
        if pooled:
            connect_args = merged.get("connect_args") or {}
            if not isinstance(connect_args, dict):
                raise ConfigurationError("engine_options['connect_args'] must be a dict")
            merged["connect_args"] = {**connect_args, "prepare_threshold": None}
        url = normalize_database_url(database)
        try:
            engine = (
                create_async_engine(url, **merged)
                if want_async
                else sa.create_engine(url, **merged)
            )
            # libpq parses the connection options without connecting: an unknown one is
            # refused now rather than at the first unit of work.
            options_in_url = {
                name: value if isinstance(value, str) else ",".join(value)
                for name, value in engine.url.query.items()
            }
            psycopg.conninfo.make_conninfo("", **options_in_url)
        except (TypeError, ValueError, sa.exc.ArgumentError, psycopg.Error) as exc:
            raise ConfigurationError(
                "cannot build an engine from the database URL and engine_options: "
                + redact(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, urls=[url])
            ) from None
        owned = True
    else:
        raise ConfigurationError(
            f"database must be a URL or a SQLAlchemy {wanted.__name__}, "
            f"got {type(database).__name__}"
        )
    if engine.dialect.name != "postgresql":
        raise ConfigurationError(f"outbox-kit needs PostgreSQL, got a {engine.dialect.name} engine")
    if want_async and engine.dialect.driver == "asyncpg":
        if pooled:
            raise ConfigurationError(
                "pooler='transaction' is not supported on an asyncpg engine: asyncpg prepares "
                "every statement under a name of its own per connection, which a transaction "
                "pooler may hand to another client; use a postgresql+psycopg:// engine behind "
                "a transaction pooler, or connect directly or through session pooling"
            )
        return engine, owned
    if engine.dialect.driver != "psycopg":
        # The unit of work talks to psycopg 3 below SQLAlchemy (prepared statements, escaping):
        # another driver would fail at the first unit of work with a bare TypeError.
        raise ConfigurationError(
            f"{owner} runs on the psycopg 3 driver"
            f"{' or asyncpg' if want_async else ''}, got a postgresql+{engine.dialect.driver} "
            f"engine: build it from a postgresql+psycopg:// URL "
            f"({'create_async_engine' if want_async else 'create_engine'}"
            '("postgresql+psycopg://...")) or pass the URL itself'
        )
    return engine, owned


def notifier_engine(engine: sa.Engine | AsyncEngine) -> sa.Engine:
    """A sync engine for the relays' wake-up thread: the engine itself, or for an
    ``AsyncEngine`` a one-connection sync engine on the same database (its connection never
    prepares statements: see outbox._pg.wakeup)."""
    if isinstance(engine, sa.Engine):
        return engine
    return sa.create_engine(
        psycopg_url(engine.url).render_as_string(hide_password=False),
        pool_size=1,
        max_overflow=0,
        connect_args={"prepare_threshold": None},
    )


def psycopg_url(url: sa.URL) -> sa.URL:
    """``url`` on the psycopg 3 driver: the toolkit's own blocking connections (the wake-up
    thread, the pooler check) beside an asyncpg engine."""
    if url.get_backend_name() == "postgresql" and url.get_driver_name() == "asyncpg":
        return url.set(drivername="postgresql+psycopg")
    return url


def transaction_type(engine: Any, default: type[TransactionT]) -> type[TransactionT]:
    """The class of a unit of work's transaction on ``engine``: ``default`` (psycopg), or the
    asyncpg one for an asyncpg engine (asyncio only: a sync asyncpg engine does not exist)."""
    if getattr(engine, "dialect", None) is not None and engine.dialect.driver == "asyncpg":
        return cast("type[TransactionT]", AsyncpgTransaction)
    return default


EngineT = TypeVar("EngineT", sa.Engine, AsyncEngine)

# libpq's connect_timeout (whole seconds, at least 2) of a readiness check's connection.
READINESS_CONNECT_TIMEOUT = 2


def readiness_engine(engine: EngineT) -> EngineT:
    """A one-connection engine of ``engine``'s flavour on the same URL, for readiness checks:
    they neither wait for the pool that units of work use nor take a connection from it.
    (Settings given to ``engine`` outside its URL, such as ``connect_args``, are not carried
    over.) A connection attempt gives up after ``READINESS_CONNECT_TIMEOUT`` seconds."""
    # asyncpg names libpq's connect_timeout `timeout`.
    timeout = "timeout" if engine.dialect.driver == "asyncpg" else "connect_timeout"
    options: dict[str, Any] = {
        "pool_size": 1,
        "max_overflow": 0,
        "connect_args": {timeout: READINESS_CONNECT_TIMEOUT},
    }
    if isinstance(engine, AsyncEngine):
        return create_async_engine(engine.url, **options)
    return sa.create_engine(engine.url, **options)


# What a readiness check of the database may meet: the server down or refusing, a lost
# connection, a pool that is exhausted.
_UNREACHABLE = (sa.exc.SQLAlchemyError, OSError)


def database_answers(engine: sa.Engine) -> bool:
    """True when ``engine`` gets a connection and ``SELECT 1`` answers (readiness checks)."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except _UNREACHABLE:
        return False
    return True


async def database_answers_async(engine: AsyncEngine) -> bool:
    """:func:`database_answers` for an ``AsyncEngine``."""
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))
    except _UNREACHABLE:
        return False
    return True


def reader_engine(engine: Any) -> Any:
    """The engine on which a joined unit of work reads its key back after the caller's commit.

    An ``AsyncEngine`` serves itself: the read runs in a task of its own, which waits for a
    pooled connection without holding anyone up. A sync engine's read runs inside the caller's
    commit, while the caller's connection is still checked out: on a full pool it would wait
    for that very connection. So the sync flavour reads on a pool of its own, a twin of the
    engine's (same connection factory and settings), that opens connections only when used.
    """
    if isinstance(engine, AsyncEngine):
        return engine
    return sa.create_engine(engine.url, pool=engine.pool.recreate())
