"""Is there a real session behind a database URL? Detecting a transaction pooler.

A pooler in transaction mode (PgBouncer, pgcat, Supavisor...) hands a client's next transaction
to whichever server connection is free: what a session holds -- session advisory locks, LISTEN,
session settings, prepared statements -- stays behind on a server connection that other clients
get, and is missing from the next one. The relay keeps its lanes in session advisory locks and
waits for wake-ups with LISTEN, so it must not run there (it would report lanes it does not
hold).

The test is made for real, with two client connections: ``a`` leaves a session setting with a
random value; ``b`` then opens a transaction and reads that setting. Behind a transaction pooler
``b`` is usually handed the server connection ``a`` just left (PgBouncer reuses the most recently
used one) and sees the value; otherwise, while ``b`` holds a server connection, ``a`` reads its
own setting back and the backend pid it runs on: a session that changed server or lost the
setting is not a session. A direct connection or a pooler in session mode keeps both. Several
rounds make a busy pooler that hands out other connections in between unlikely to go unnoticed.
Neither a direct connection nor session pooling can ever look pooled.

Units of work use it once per outbox to refuse a transaction pooler their configuration does not
declare (:func:`refuse_undeclared`); the relay, to refuse any transaction pooler.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from outbox._pg.engines import psycopg_url
from outbox.errors import ConfigurationError

_SETTING = "outbox.session_probe"
_ROUNDS = 3


def sessions_are_pooled(connect: Callable[[], Any]) -> bool:
    """True when two transactions of one client connection made with ``connect`` (a callable
    returning a new psycopg connection) do not share one server session."""
    a = connect()
    try:
        b = connect()
        try:
            a.autocommit = True
            b.autocommit = True
            return any(_round(a, b) for _ in range(_ROUNDS))
        finally:
            with contextlib.suppress(Exception):
                b.close()
    finally:
        with contextlib.suppress(Exception):
            a.close()


def _round(a: Any, b: Any) -> bool:
    token = secrets.token_hex(8)
    row = a.execute(
        "SELECT pg_backend_pid(), set_config(%s, %s, false)", (_SETTING, token), prepare=False
    ).fetchone()
    pid = row[0]
    b.execute("BEGIN", prepare=False)
    try:
        seen = b.execute("SELECT current_setting(%s, true)", (_SETTING,), prepare=False).fetchone()[
            0
        ]
        if seen == token:
            return True  # another client connection sees a's session
        again = a.execute(
            "SELECT pg_backend_pid(), current_setting(%s, true)", (_SETTING,), prepare=False
        ).fetchone()
        return bool(again[0] != pid or again[1] != token)
    finally:
        b.execute("ROLLBACK", prepare=False)


def connector(engine: Any) -> Callable[[], Any]:
    """Opens plain psycopg connections to the database of ``engine`` (sync or async), as its
    URL says, for :func:`sessions_are_pooled`: never prepared, a bounded connect."""
    url = psycopg_url(getattr(engine, "sync_engine", engine).url)
    dialect = url.get_dialect()()

    def connect() -> Any:
        cargs, cparams = dialect.create_connect_args(url)
        params = {"connect_timeout": 5, **cparams, "prepare_threshold": None}
        return psycopg.connect(*cargs, **params)

    return connect


# How long a unit of work waits for the check at most. Its two connections may have to wait
# for server connections (a pooler in session mode whose pool the process's own connections
# hold, up to PgBouncer's query_wait_timeout of two minutes): then the check is given up.
CHECK_TIMEOUT = 5.0


def refuse_undeclared(engine: Any, timeout: float = CHECK_TIMEOUT) -> None:
    """Raise :class:`~outbox.errors.ConfigurationError` when ``engine`` reaches PostgreSQL
    through a transaction pooler that the outbox's configuration does not declare. Any other
    failure (the database is down, the check took longer than ``timeout`` seconds: its thread
    finishes on its own) is the caller's to ignore: the check is best effort."""
    answer: list[bool | BaseException] = []

    def check() -> None:
        try:
            answer.append(sessions_are_pooled(connector(engine)))
        except BaseException as exc:  # handed to the caller below
            answer.append(exc)

    thread = threading.Thread(target=check, name="outbox-pooler-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if not answer:
        raise TimeoutError(f"the pooler check did not finish within {timeout:g}s")
    if isinstance(answer[0], BaseException):
        raise answer[0]
    if answer[0]:
        raise ConfigurationError(
            "the database goes through a connection pooler in transaction mode, where a unit "
            "of work must not rely on its session: declare it with "
            "OutboxConfig(pooler='transaction') (outbox consume --pooler transaction, "
            "OUTBOX_POOLER=transaction), or connect directly or through session pooling"
        )


async def refuse_undeclared_async(engine: Any) -> None:
    """:func:`refuse_undeclared` in a worker thread (its connections are blocking ones)."""
    await asyncio.to_thread(refuse_undeclared, engine)
