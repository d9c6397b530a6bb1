"""Keys, values and headers stored exactly, whatever the database sets
``standard_conforming_strings`` and ``client_encoding`` to (per database, as legacy databases
carry them): through a single unit of work (the first of a connection, then prepared), a large
one, a joined one, micro-batches of units of work (the first of a connection, later ones, a large
one), both flavours, and through a transaction pooler. Every row is read back over a UTF-8
session of the test's own; one test reads what the relay sent from Kafka.

Generated with Hypothesis: binary message keys and values, text and binary headers, idempotency
keys of any text. A joined unit of work's text the driver cannot write in the client encoding is
refused (tests/integration/test_joined_refusals.py; docs/unit-of-work.md).
``HYPOTHESIS_PROFILE=long`` runs ten times as many examples.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, strategies as st
from sqlalchemy.ext.asyncio import create_async_engine

import outbox
from outbox import OutboxConfig
from outbox._core.codec import IDEMPOTENCY_HEADER, decode_headers
from outbox.relay import Relay, RelayConfig
from outbox.uow import AsyncBatch, Batch
from tests.fixtures.hostile import scaled
from tests.fixtures.kafka import create_topic
from tests.fixtures.pgbouncer import through
from tests.fixtures.relay import wait_for_records

# The client encodings under test; the server encoding is UTF8. (Under SQL_ASCII psycopg returns
# text as bytes, and SQLAlchemy's dialect cannot even read the server's version: no engine
# connects.) SJIS and BIG5 are client-only encodings in which a character's second byte may be a
# backslash.
ENCODINGS = ("UTF8", "LATIN1", "WIN1252", "EUC_JP", "SJIS", "BIG5")
SETTINGS = [("off", encoding) for encoding in ENCODINGS] + [
    ("on", encoding) for encoding in ("UTF8", "LATIN1", "SJIS")
]
TOPIC = "bytes.exact"
# Above the inline limit of the single unit of work and of the batch: such a value goes as a
# parameter bound by the driver rather than as a literal.
LARGE = bytes(range(256)) * 300

Event = tuple[bytes | None, bytes, dict[str, str | bytes]]
Published = dict[uuid.UUID, Event]


def set_database(pg_admin_url: str, database_url: str, scs: str, encoding: str) -> None:
    """Give the database the settings a legacy database carries: its new sessions take them."""
    name = sa.make_url(database_url).database
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET standard_conforming_strings = {scs}')
            conn.exec_driver_sql(f"ALTER DATABASE \"{name}\" SET client_encoding = '{encoding}'")
    finally:
        admin.dispose()


def reader(database_url: str) -> sa.Engine:
    """The test's own view of a database: UTF-8 and standard strings, whatever it defaults to."""
    return sa.create_engine(
        database_url,
        connect_args={"client_encoding": "utf8", "options": "-c standard_conforming_strings=on"},
    )


def session_settings(engine: sa.Engine) -> tuple[str, str]:
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT current_setting('standard_conforming_strings'), "
                    "current_setting('client_encoding')")
        ).one()  # fmt: skip
    return row[0], row[1]


# Any text without control characters (keys refuse them): the toolkit's own statements carry
# every character whatever the client encoding.
texts = st.text(st.characters(exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12)


def events() -> st.SearchStrategy[list[Event]]:
    # The toolkit's own headers aside (a value in bytes gets a content-type header).
    names = texts.filter(lambda n: n.lower() not in ("x-idempotency-key", "content-type"))
    headers = st.dictionaries(names, st.one_of(st.binary(max_size=16), texts), max_size=3)
    event = st.tuples(st.one_of(st.none(), st.binary(max_size=24)), st.binary(max_size=48), headers)
    return st.lists(event, min_size=1, max_size=3)


def publish(uow: Any, events: list[Event], topic: str = TOPIC) -> Published:
    return {uow.publish(topic, v, key=k, headers=h): (k, v, h) for k, v, h in events}


def check_stored(view: sa.Engine, published: Published, keys: dict[str, str]) -> None:
    """Every published event's row holds its message key, value and headers exactly, and
    every idempotency key its row under its scope."""
    with view.connect() as conn:
        stored = {
            row.event_id: row
            for row in conn.execute(
                sa.text(
                    "SELECT event_id, key, value, headers::text AS headers FROM outbox "
                    "WHERE event_id = ANY(:ids)"
                ),
                {"ids": list(published)},
            )
        }
        found = {
            (row.key, row.scope)
            for row in conn.execute(
                sa.text("SELECT key, scope FROM idempotency_keys WHERE key = ANY(:keys)"),
                {"keys": list(keys)},
            )
        }
    assert set(stored) == set(published)
    for event_id, (key, value, headers) in published.items():
        row = stored[event_id]
        assert (row.key, row.value) == (key, value)
        got = dict(decode_headers(json.loads(row.headers)))
        assert got.pop("content-type") == b"application/octet-stream"
        assert got == {n: v.encode() if isinstance(v, str) else v for n, v in headers.items()}
    assert found == set(keys.items())


def driver_bound(events: list[Event], utf8: bool) -> list[Event]:
    """``events`` as a joined unit of work can take them: its statements are bound by the driver
    (as the caller's own are), which under another client encoding than UTF-8 writes text with
    Python's codec, so text beyond ASCII is left out there (docs/unit-of-work.md)."""
    if utf8:
        return events
    return [
        (
            k,
            v,
            {n: h for n, h in hs.items() if n.isascii() and (isinstance(h, bytes) or h.isascii())},
        )
        for k, v, hs in events
    ]


def fresh(base: str) -> str:
    return f"{base}-{uuid.uuid4().hex[:8]}"


def claim(keys: dict[str, str], base: str, scope: str) -> str:
    """A new idempotency key made from ``base``, noted in ``keys`` with its scope."""
    key = fresh(base)
    keys[key] = scope
    return key


def sync_paths(
    ob: outbox.Outbox, engine: sa.Engine, draw: tuple[Any, ...]
) -> tuple[Published, dict[str, str]]:
    """Single units of work (the first on a new connection: its final statement is not
    PREPAREd yet), a large one, a joined one, and three micro-batches (the first on the
    connection, a second, a large one)."""
    first, second, key, scope = draw
    utf8 = session_settings(engine)[1] == "UTF8"
    engine.dispose()  # a new connection: nothing PREPAREd on it
    published: Published = {}
    keys: dict[str, str] = {}
    for events in (first, second, [*first, (b"large", LARGE, {})]):
        k = claim(keys, key, scope)
        with ob.unit_of_work(k, scope) as uow:
            published |= publish(uow, events)
    with engine.begin() as conn:
        k = claim(keys, key if utf8 else "joined", scope)
        with ob.unit_of_work(k, scope, connection=conn) as uow:
            published |= publish(uow, driver_bound(second, utf8))
    engine.dispose()
    for groups in ([first, second], [second, first], [first, [(b"l", LARGE, {})]]):
        batch_keys = [fresh(key) for _ in groups]
        batch = Batch.open(ob, scope, batch_keys)
        try:
            for k, events in zip(batch_keys, groups, strict=True):
                with batch.unit_of_work(k, scope) as uow:
                    published |= publish(uow, events)
            batch.commit()
        finally:
            batch.close()
        keys |= dict.fromkeys(batch_keys, scope)
    return published, keys


async def async_paths(
    url: str, draw: tuple[Any, ...], utf8: bool
) -> tuple[Published, dict[str, str]]:
    """The asyncio flavour, each on a new engine: single, large, joined and batched."""
    first, second, key, scope = draw
    engine = create_async_engine(url)
    aob = outbox.AsyncOutbox(engine)
    published: Published = {}
    keys: dict[str, str] = {}
    try:
        for events in (first, [*second, (None, LARGE, {})]):
            k = claim(keys, key, scope)
            async with aob.unit_of_work(k, scope) as uow:
                published |= publish(uow, events)
        async with engine.begin() as conn:
            k = claim(keys, key if utf8 else "joined", scope)
            async with aob.unit_of_work(k, scope, connection=conn) as uow:
                published |= publish(uow, driver_bound(first, utf8))
        for groups in ([first, second], [second, [(b"l", LARGE, {})]]):
            batch_keys = [fresh(key) for _ in groups]
            batch = await AsyncBatch.open(aob, scope, batch_keys)
            try:
                for k, events in zip(batch_keys, groups, strict=True):
                    async with batch.unit_of_work(k, scope) as uow:
                        published |= publish(uow, events)
                await batch.commit()
            finally:
                await batch.close()
            keys |= dict.fromkeys(batch_keys, scope)
    finally:
        await aob.close()
        await engine.dispose()
    return published, keys


# What a scope may hold (outbox._core.validate).
scopes = st.text(st.sampled_from("abcXYZ019._:/-"), min_size=1, max_size=12)


draws = st.tuples(events(), events(), texts, scopes)


@pytest.fixture
def view(database_url: str) -> Iterator[sa.Engine]:
    engine = reader(database_url)
    try:
        yield engine
    finally:
        engine.dispose()


def every_path(view: sa.Engine, url: str, utf8: bool) -> None:
    """Generated events through every path of both flavours on the database at ``url``."""
    engine = sa.create_engine(url)
    ob = outbox.Outbox(engine)

    # Each example runs a dozen units of work in both flavours under each of nine settings.
    @scaled(2)
    @given(draws)
    def run(draw: tuple[Any, ...]) -> None:
        check_stored(view, *sync_paths(ob, engine, draw))
        check_stored(view, *asyncio.run(async_paths(url, draw, utf8)))

    try:
        run()
    finally:
        ob.close()
        engine.dispose()


def test_every_path_stores_bytes_exactly_under_every_setting(
    pg_admin_url: str, database_url: str, view: sa.Engine
) -> None:
    for scs, encoding in SETTINGS:
        set_database(pg_admin_url, database_url, scs, encoding)
        assert session_settings(view.engine) == ("on", "UTF8")
        probe = sa.create_engine(database_url)
        try:
            assert session_settings(probe) == (scs, encoding)
        finally:
            probe.dispose()
        try:
            every_path(view, database_url, encoding == "UTF8")
        except BaseException as exc:
            exc.add_note(f"standard_conforming_strings={scs} client_encoding={encoding}")
            raise


@pytest.mark.parametrize("scs, encoding", [("off", "UTF8"), ("off", "SJIS"), ("on", "LATIN1")])
def test_bytes_exact_through_a_transaction_pooler(
    scs: str,
    encoding: str,
    pg_admin_url: str,
    database_url: str,
    view: sa.Engine,
    pgbouncers: Any,
) -> None:
    """Behind PgBouncer in transaction mode every literal goes inline, never PREPAREd."""
    set_database(pg_admin_url, database_url, scs, encoding)
    url = through(pgbouncers, "transaction", database_url)
    engine = sa.create_engine(url, connect_args={"prepare_threshold": None})
    assert session_settings(engine) == (scs, encoding)
    ob = outbox.Outbox(engine, config=OutboxConfig(pooler="transaction"))

    @scaled(6)
    @given(draws)
    def run(draw: tuple[Any, ...]) -> None:
        check_stored(view, *sync_paths(ob, engine, draw))

    try:
        run()
    finally:
        ob.close()
        engine.dispose()


def test_the_relay_sends_the_bytes_stored_under_legacy_settings(
    pg_admin_url: str, database_url: str, kafka_bootstrap: str
) -> None:
    """What a micro-batch and a single unit of work stored under
    ``standard_conforming_strings = off`` reaches Kafka byte for byte."""
    set_database(pg_admin_url, database_url, "off", "LATIN1")
    topic = f"bytes-exact-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic)
    events: list[Event] = [
        (b"\x00\\x00'\"\xff", b"\x00\\\\\x01'", {"b": b"\\x00\x00", "t": "caf\xe9 \\x"}),
        (b"\\", b"", {}),
        (None, bytes(range(256)), {"\\": b"\\\\"}),
    ]
    engine = sa.create_engine(database_url)
    ob = outbox.Outbox(engine)
    try:
        batch = Batch.open(ob, "s", ["b1", "b2"])
        try:
            published: Published = {}
            for k in ("b1", "b2"):
                with batch.unit_of_work(k, "s") as uow:
                    published |= publish(uow, events, topic)
            batch.commit()
        finally:
            batch.close()
        with ob.unit_of_work("single", "s") as uow:
            published |= publish(uow, events, topic)
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    finally:
        ob.close()
        engine.dispose()
    records = wait_for_records(kafka_bootstrap, topic, published)
    got = {uuid.UUID(r.event_id): r for r in records}
    for event_id, (key, value, headers) in published.items():
        r = got[event_id]
        assert (r.key, r.value) == (key, value)
        sent = {n: v for n, v in r.headers.items() if n not in (IDEMPOTENCY_HEADER, "content-type")}
        assert sent == {n: v.encode() if isinstance(v, str) else v for n, v in headers.items()}
