"""Behind a connection pooler one unit of work stays one transaction: it works, or it refuses
clearly, never splits (docs/concepts.md I13).

Through real PgBouncer instances (tests/fixtures/pgbouncer.py: transaction and session mode,
three server connections for more clients), and directly, with a transaction lost under the
unit of work's feet as a pooler or a reconnect could lose it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox import OutboxConfig
from outbox._pg.pooler import sessions_are_pooled
from outbox.errors import ConfigurationError, PermanentError, TransactionEndedError
from outbox.http import current_unit_of_work
from outbox.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from outbox.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from outbox.uow import Batch
from tests.fixtures.pgbouncer import PgBouncer, through
from tests.integration.test_http_middleware import call, respond, wsgi_call

BIZ_DDL = "CREATE TABLE biz (k text PRIMARY KEY)"
INSERT_BIZ = sa.text("INSERT INTO biz (k) VALUES (:k)")
POOLED = OutboxConfig(pooler="transaction")


def _counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table: int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
            for table in ("biz", "idempotency_keys", "outbox")
        }


def _split_keys(engine: sa.Engine) -> list[str]:
    """Keys completed without their business row, or business rows without their key."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT k.key FROM idempotency_keys k LEFT JOIN biz ON biz.k = k.key "
                    "WHERE k.status = 'completed' AND biz.k IS NULL "
                    "UNION ALL SELECT biz.k FROM biz LEFT JOIN idempotency_keys k "
                    "ON k.key = biz.k WHERE k.key IS NULL"
                )
            ).scalars()
        )


@pytest.fixture
def biz(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        conn.execute(sa.text(BIZ_DDL))
    return engine


# -- the final statement proves it runs in the claiming transaction -----------------------------


def test_final_statement_outside_the_claiming_transaction_is_refused(
    biz: sa.Engine, database_url: str
) -> None:
    """The body's transaction is lost and a new one begun under the unit of work (what a
    pooler handing out another server connection, or a reconnect, does): the final statement
    must not commit the key and the event without the business row."""
    refused = pytest.raises(TransactionEndedError, match="did not run in the transaction")
    with outbox.Outbox(database_url) as ob:
        with refused, ob.unit_of_work("lost") as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "lost"})
            uow.publish("t", {"k": "lost"})
            uow.result = "done"
            uow.connection.exec_driver_sql("ROLLBACK; BEGIN")
        # The key stayed free: the retry runs the body and commits it whole.
        with ob.unit_of_work("lost") as uow:
            assert not uow.replayed
            uow.connection.execute(INSERT_BIZ, {"k": "lost"})
            uow.publish("t", {"k": "lost"})
    assert _counts(biz) == {"biz": 1, "idempotency_keys": 1, "outbox": 1}


def test_final_statement_of_a_large_unit_of_work_outside_its_transaction_is_refused(
    biz: sa.Engine, database_url: str
) -> None:
    """Events too large to travel with the COMMIT go as a statement of their own; run in
    autocommit after the transaction was lost, it must refuse as well."""
    refused = pytest.raises(TransactionEndedError, match="did not run in the transaction")
    with outbox.Outbox(database_url) as ob, refused, ob.unit_of_work("large") as uow:
        uow.connection.execute(INSERT_BIZ, {"k": "large"})
        uow.publish("t", b"x" * 100_000)
        uow.connection.exec_driver_sql("ROLLBACK; BEGIN")
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 0, "outbox": 0}


def test_async_final_statement_outside_the_claiming_transaction_is_refused(
    biz: sa.Engine, database_url: str
) -> None:
    async def main() -> None:
        async with outbox.AsyncOutbox(database_url) as ob:
            with pytest.raises(TransactionEndedError, match="did not run in the transaction"):
                async with ob.unit_of_work("lost") as uow:
                    await uow.connection.execute(INSERT_BIZ, {"k": "lost"})
                    uow.publish("t", {"k": "lost"})
                    await uow.connection.exec_driver_sql("ROLLBACK; BEGIN")

    asyncio.run(main())
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 0, "outbox": 0}


def test_joined_final_statement_outside_the_claiming_transaction_is_refused(
    biz: sa.Engine, database_url: str
) -> None:
    """Joined to the caller's connection: the claim's savepoint and transaction are lost, the
    caller's connection carries on in a new transaction."""
    refused = pytest.raises(TransactionEndedError, match="did not run in the transaction")
    with outbox.Outbox(database_url) as ob, ob.engine.connect() as conn:
        with refused, ob.unit_of_work("joined", connection=conn) as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "joined"})
            uow.publish("t", {"k": "joined"})
            conn.exec_driver_sql("ROLLBACK; BEGIN")
        conn.rollback()
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 0, "outbox": 0}


# -- through PgBouncer ---------------------------------------------------------------------------


@pytest.fixture
def one_server_pooler(pg_admin_url: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode with ONE server connection: every client's transactions
    run on it, one after another, so what one client leaves in the session meets the next."""
    bouncer = PgBouncer(pg_admin_url, "transaction", pool_size=1).start()
    try:
        yield bouncer
    finally:
        bouncer.close()


def test_another_clients_statement_cannot_run_in_place_of_the_body_s(
    biz: sa.Engine, database_url: str, one_server_pooler: PgBouncer
) -> None:
    """How a unit of work split through a transaction pooler: psycopg names the statements it
    prepares by itself per client connection (``_pg3_0``, ...); on a shared server connection
    the name may stand for another client's statement, which then runs in place of the body's
    INSERT (same number of parameters, no error), and the final statement commits the key and
    the event without the business row. Declared behind a transaction pooler, the outbox's
    connections never prepare, whatever the engine options ask."""
    url = one_server_pooler.url_for(database_url)
    # psycopg's default: a statement executed five times is prepared at its sixth execution.
    options = {"pool_size": 1, "max_overflow": 0, "connect_args": {"prepare_threshold": 5}}
    config = OutboxConfig(pooler="transaction", wake_relays=False)
    with outbox.Outbox(url, config=config, engine_options=options) as ob:
        for i in range(6):
            with ob.unit_of_work(f"k{i}") as uow:
                uow.connection.execute(INSERT_BIZ, {"k": f"k{i}"})
        # Another client, on the same server connection, takes the names psycopg gives the
        # statements it prepares, for a statement of its own with one text parameter.
        conninfo = sa.make_url(url).set(drivername="postgresql")
        with psycopg.connect(
            conninfo.render_as_string(hide_password=False), autocommit=True
        ) as other:
            for n in range(10):
                names = other.execute(
                    "SELECT name FROM pg_prepared_statements WHERE name = %s",
                    (f"_pg3_{n}",),
                    prepare=False,
                )
                if names.fetchone() is not None:
                    other.execute(f"DEALLOCATE _pg3_{n}", prepare=False)
                other.execute(f"PREPARE _pg3_{n} (text) AS SELECT length($1)", prepare=False)
        with ob.unit_of_work("k6") as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "k6"})
            uow.publish("t", {"k": "k6"})
    assert _split_keys(biz) == []
    assert _counts(biz) == {"biz": 7, "idempotency_keys": 7, "outbox": 1}


def _engine_through(pgbouncers: dict[str, PgBouncer], mode: str, database_url: str) -> sa.Engine:
    return sa.create_engine(
        through(pgbouncers, mode, database_url),
        connect_args={"prepare_threshold": None},
        pool_size=8,
        max_overflow=0,
    )


THREADS = 8
KEYS = 150


def _outcome(errors: collections.Counter[str], engine: sa.Engine) -> None:
    assert sum(errors.values()) == 0, errors.most_common(5)
    assert _split_keys(engine) == []
    assert _counts(engine) == {
        "biz": THREADS * KEYS,
        "idempotency_keys": THREADS * KEYS,
        "outbox": THREADS * KEYS,
    }


def test_eight_threads_through_a_transaction_pooler(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """8 threads x 150 keys, each attempted twice, through PgBouncer in transaction mode with
    3 server connections: no error, and exactly one business row, key and event per key."""
    errors: collections.Counter[str] = collections.Counter()
    url = through(pgbouncers, "transaction", database_url)
    with outbox.Outbox(url, config=POOLED, engine_options={"pool_size": THREADS}) as ob:

        def work(t: int) -> None:
            for i in range(KEYS):
                key = f"k{t}-{i}"
                for _ in range(2):
                    try:
                        with ob.unit_of_work(key) as uow:
                            if uow.replayed:
                                continue
                            uow.connection.execute(INSERT_BIZ, {"k": key})
                            uow.publish("t", {"k": key}, key=key)
                            uow.result = {"k": key}
                    except Exception as exc:
                        errors[f"{type(exc).__name__}: {str(exc).splitlines()[0]}"] += 1

        threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    _outcome(errors, biz)


def test_eight_tasks_through_a_transaction_pooler(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """The asyncio flavour of the scenario above: 8 tasks x 150 keys, each attempted twice."""
    errors: collections.Counter[str] = collections.Counter()
    url = through(pgbouncers, "transaction", database_url)

    async def main() -> None:
        async with outbox.AsyncOutbox(
            url, config=POOLED, engine_options={"pool_size": THREADS}
        ) as ob:

            async def work(t: int) -> None:
                for i in range(KEYS):
                    key = f"k{t}-{i}"
                    for _ in range(2):
                        try:
                            async with ob.unit_of_work(key) as uow:
                                if uow.replayed:
                                    continue
                                await uow.connection.execute(INSERT_BIZ, {"k": key})
                                uow.publish("t", {"k": key}, key=key)
                                uow.result = {"k": key}
                        except Exception as exc:
                            errors[f"{type(exc).__name__}: {str(exc).splitlines()[0]}"] += 1

            await asyncio.gather(*(work(t) for t in range(THREADS)))

    asyncio.run(main())
    _outcome(errors, biz)


def test_permanent_failure_is_recorded_through_a_transaction_pooler(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """No session advisory lock behind the pooler: the failure is recorded in the claiming
    transaction, after a rollback to the savepoint set with the claim."""
    url = through(pgbouncers, "transaction", database_url)
    with outbox.Outbox(url, config=POOLED) as ob:
        with pytest.raises(PermanentError), ob.unit_of_work("refused") as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "refused"})
            raise PermanentError("no such customer")
        with pytest.raises(outbox.PreviouslyFailed), ob.unit_of_work("refused"):
            pass
        # A statement of the body failed first (the transaction is aborted, not ended).
        with pytest.raises(PermanentError), ob.unit_of_work("aborted") as uow:
            with contextlib.suppress(sa.exc.IntegrityError):
                uow.connection.execute(INSERT_BIZ, {"k": None})
            raise PermanentError("bad row")
        # The body's ORM session rolled the whole transaction back first.
        with pytest.raises(PermanentError), ob.unit_of_work("ended") as uow:
            uow.session.rollback()
            raise PermanentError("given up")
        for key in ("aborted", "ended"):
            with pytest.raises(outbox.PreviouslyFailed), ob.unit_of_work(key):
                pass
    with biz.connect() as conn:
        held = conn.execute(
            sa.text(
                "SELECT l.pid, l.objid FROM pg_locks l WHERE l.locktype = 'advisory' AND "
                "l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        ).all()
    assert held == []  # no session lock left behind on a pooled server connection
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 3, "outbox": 0}


# What a statement relying on the session looks like: SQL-level prepared statements, session
# advisory locks (the transaction-scoped ones end in _xact_lock), LISTEN, a session SET.
_SESSION_STATE = re.compile(
    r"\b(PREPARE|EXECUTE|DEALLOCATE|LISTEN)\b|pg_(try_)?advisory_(un)?lock(_shared)?\(|"
    r"^\s*SET\s+(?!LOCAL\b)|;\s*SET\s+(?!LOCAL\b)|set_config\([^)]*false\)",
    re.IGNORECASE,
)


def test_nothing_relies_on_the_session_behind_a_transaction_pooler(
    biz: sa.Engine,
    database_url: str,
    pgbouncers: dict[str, PgBouncer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every statement the toolkit's connections send, for a unit of work that commits, one
    that fails permanently, a joined one, a keyless publish and a micro-batch: none holds state
    in the session (and psycopg prepares none: protocol-level prepares are refused with the
    engine, see the next test)."""
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def recording(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(query.decode() if isinstance(query, bytes) else str(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    url = through(pgbouncers, "transaction", database_url)
    with outbox.Outbox(url, config=POOLED) as ob:
        with ob.unit_of_work("ok") as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "ok"})
            uow.publish("t", {"k": "ok"}, key="ok")
        with pytest.raises(PermanentError), ob.unit_of_work("refused") as uow:
            uow.connection.execute(INSERT_BIZ, {"k": "refused"})
            raise PermanentError("no")
        with ob.engine.connect() as conn:
            with ob.unit_of_work("joined", connection=conn) as uow:
                uow.connection.execute(INSERT_BIZ, {"k": "joined"})
            ob.publish(conn, "t", {"keyless": True})
            conn.commit()
        batch = Batch.open(ob, "default", ["b1", "b2"])
        try:
            for key in ("b1", "b2"):
                with batch.unit_of_work(key, "default") as uow:
                    uow.connection.execute(INSERT_BIZ, {"k": key})
                    uow.publish("t", {"k": key})
            batch.commit()
        finally:
            batch.close()
    assert len(sent) > 10
    assert [q for q in sent if _SESSION_STATE.search(q)] == []
    assert _counts(biz) == {"biz": 4, "idempotency_keys": 5, "outbox": 4}


def test_an_undeclared_transaction_pooler_is_refused(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """Without OutboxConfig(pooler=...), the first unit of work that reaches the database
    finds out that the sessions are pooled, and refuses (every later one too): it never runs
    on the path that relies on the session."""
    url = through(pgbouncers, "transaction", database_url)
    with outbox.Outbox(url) as ob:
        for key in ("a", "b"):
            refused = pytest.raises(ConfigurationError, match="pooler='transaction'")
            with refused, ob.unit_of_work(key) as uow:
                uow.connection.execute(INSERT_BIZ, {"k": key})

    async def main() -> None:
        async with outbox.AsyncOutbox(url) as aob:
            with pytest.raises(ConfigurationError, match="pooler='transaction'"):
                async with aob.unit_of_work("c"):
                    pass

    asyncio.run(main())
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 0, "outbox": 0}


def test_engine_that_prepares_is_refused_behind_a_transaction_pooler(
    database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """psycopg's automatic prepares name statements per client connection: behind the pooler
    another client's statement of the same name would run in place of the body's."""
    engine = sa.create_engine(through(pgbouncers, "transaction", database_url))
    try:
        with outbox.Outbox(engine, config=POOLED) as ob:
            with pytest.raises(ConfigurationError, match="prepare_threshold"), ob.unit_of_work("k"):
                pass
            refused = pytest.raises(ConfigurationError, match="prepare_threshold")
            with engine.connect() as conn, refused, ob.unit_of_work("k", connection=conn):
                pass
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_joined_units_of_work_through_a_pooler(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer], mode: str
) -> None:
    """Joined to the caller's session and connection, and the keyless publish, sync and
    asyncio, through the pooler."""
    engine = _engine_through(pgbouncers, mode, database_url)
    # Session mode declared: the process's connections and its wake-up notifier hold all
    # three server connections, none is left for the undeclared pooler check.
    config = OutboxConfig(pooler=mode)
    try:
        with outbox.Outbox(engine, config=config) as ob:
            for i in range(20):
                with engine.connect() as conn:
                    with ob.unit_of_work(f"c{i}", connection=conn) as uow:
                        uow.connection.execute(INSERT_BIZ, {"k": f"c{i}"})
                        uow.publish("t", {"i": i})
                    conn.commit()
                with sa.orm.Session(engine) as session:
                    with ob.unit_of_work(f"s{i}", session=session) as uow:
                        uow.connection.execute(INSERT_BIZ, {"k": f"s{i}"})
                        uow.publish("t", {"i": i})
                    session.commit()
    finally:
        engine.dispose()

    async def main() -> None:
        aengine = create_async_engine(
            through(pgbouncers, mode, database_url), connect_args={"prepare_threshold": None}
        )
        async with outbox.AsyncOutbox(aengine, config=config) as ob:
            for i in range(20):
                async with aengine.connect() as conn:
                    async with ob.unit_of_work(f"a{i}", connection=conn) as uow:
                        await uow.connection.execute(INSERT_BIZ, {"k": f"a{i}"})
                        uow.publish("t", {"i": i})
                    await ob.publish(conn, "t", {"keyless": i})
                    await conn.commit()
        await aengine.dispose()

    asyncio.run(main())
    assert _split_keys(biz) == []
    assert _counts(biz) == {"biz": 60, "idempotency_keys": 60, "outbox": 80}


def test_idempotent_default_outbox_from_the_environment_through_a_transaction_pooler(
    biz: sa.Engine,
    database_url: str,
    pgbouncers: dict[str, PgBouncer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``OUTBOX_POOLER=transaction`` configures the default outbox of ``@outbox.idempotent``."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", through(pgbouncers, "transaction", database_url))
    monkeypatch.setenv("OUTBOX_POOLER", "transaction")
    monkeypatch.delenv("OUTBOX_REDIS_URL", raising=False)
    ob = outbox.configure()
    try:
        assert ob.config.pooler == "transaction"

        @outbox.idempotent(key="order_id")
        def place(uow: outbox.UnitOfWork, order_id: str) -> str:
            uow.connection.execute(INSERT_BIZ, {"k": order_id})
            uow.publish("t", {"k": order_id})
            return order_id

        def work(t: int) -> None:
            for i in range(40):
                assert place(f"o{t}-{i}") == f"o{t}-{i}"
                assert place(f"o{t}-{i}") == f"o{t}-{i}"

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        ob.close()
        outbox.uow._default._default = None
    assert _split_keys(biz) == []
    assert _counts(biz) == {"biz": 160, "idempotency_keys": 160, "outbox": 160}


def test_http_middlewares_through_a_transaction_pooler(
    biz: sa.Engine, database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """The ASGI middleware on an AsyncOutbox and the WSGI one on an Outbox, declared behind
    PgBouncer in transaction mode: stored once, replayed after."""
    url = through(pgbouncers, "transaction", database_url)

    async def asgi() -> None:
        async with outbox.AsyncOutbox(url, config=POOLED) as aob:
            middleware = AsgiMiddleware(respond(), aob)
            first = await call(middleware, key="asgi")
            again = await call(middleware, key="asgi")
            assert first[0] == 201 and again[1]["idempotent-replayed"] == "true"

    asyncio.run(asgi())

    def app(environ: Any, start_response: Any) -> list[bytes]:
        current_unit_of_work().publish("things.created", {"n": 1})
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"made"]

    with outbox.Outbox(url, config=POOLED) as ob:
        middleware = WsgiMiddleware(app, ob)
        first = wsgi_call(middleware, key="wsgi")
        again = wsgi_call(middleware, key="wsgi")
        assert first[0].startswith("201") and again[1]["idempotent-replayed"] == "true"
        assert again[2] == b"made"
    assert _counts(biz) == {"biz": 0, "idempotency_keys": 2, "outbox": 2}


# -- processes that need a session ---------------------------------------------------------------


def _connector(url: str) -> Any:
    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    return lambda: psycopg.connect(conninfo)


def test_a_transaction_pooler_is_detected(
    database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    assert sessions_are_pooled(_connector(through(pgbouncers, "transaction", database_url)))
    assert not sessions_are_pooled(_connector(through(pgbouncers, "session", database_url)))
    assert not sessions_are_pooled(_connector(database_url))


def test_relay_refuses_to_start_behind_a_transaction_pooler(
    database_url: str, pgbouncers: dict[str, PgBouncer]
) -> None:
    """Lanes held by session advisory locks would protect nothing: exit code 2, one line."""
    done = subprocess.run(
        [
            sys.executable, "-m", "outbox.cli.relay", "--once",
            "--database-url", through(pgbouncers, "transaction", database_url),
            "--bootstrap-servers", "127.0.0.1:9",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "transaction mode" in lines[0] and "session mode" in lines[0]
