"""Hostile input against the real services: every public entry point either works (and what
it stored round-trips) or raises a documented ValidationError / ConfigurationError before any
PostgreSQL, Redis or Kafka I/O, leaving nothing written -- counted by rows in
``idempotency_keys``, ``outbox`` and a business table and by keys in Redis.

Generated with Hypothesis (see ``tests/fixtures/hostile.py``); ``HYPOTHESIS_PROFILE=long``
runs ten times as many examples.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import given, strategies as st
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox import OutboxConfig
from outbox._core import validate as _validate
from outbox._core.codec import CONTENT_TYPE_HEADER, IDEMPOTENCY_HEADER
from outbox.errors import (
    ConfigurationError,
    KeyReuseError,
    SerializationError,
    ValidationError,
)
from tests.fixtures.hostile import (
    HOSTILE_STR_OR_NOT,
    HOSTILE_TEXT,
    HOSTILE_VALUE,
    NOT_TEXT,
    attempt,
    json_equal,
    json_form,
    scaled,
)
from tests.fixtures.uow import INSERT_ORDER, create_orders, watch

INPUT = (ValidationError, ConfigurationError)


class World:
    """One test's database, Redis prefix and outboxes, and the counts that must not move."""

    def __init__(self, engine: sa.Engine, redis_url: str, prefix: str) -> None:
        create_orders(engine)
        self.engine = engine
        self.prefix = prefix
        self.client = redis.Redis.from_url(redis_url)
        self.ob = outbox.Outbox(engine, redis=self.client, config=OutboxConfig(cache_prefix=prefix))
        self.used: set[tuple[str, str]] = set()

    def counts(self) -> tuple[int, ...]:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM idempotency_keys), "
                    "(SELECT count(*) FROM outbox), (SELECT count(*) FROM orders)"
                )
            ).one()
        keys = sum(1 for _ in self.client.scan_iter(match=f"{self.prefix}*", count=1000))
        return (*row, keys)

    def fresh(self) -> str:
        return f"k-{uuid.uuid4().hex}"

    def close(self) -> None:
        self.ob.close()
        self.client.close()


@pytest.fixture
def world(engine: sa.Engine, redis_url: str, redis_prefix: str) -> Iterator[World]:
    w = World(engine, redis_url, redis_prefix)
    yield w
    w.close()


def _body(uow: outbox.UnitOfWork, key: str) -> dict[str, str]:
    uow.connection.execute(INSERT_ORDER, {"k": key[:200], "a": 1})
    uow.publish("hostile.events", {"n": 1}, key="k")
    uow.result = {"done": "yes"}
    return uow.result


# --------------------------------------------------------------- keys, scopes, fingerprints


PRINTABLE = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=60)


def hostile_in(*names: str, **good: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Arguments ``good`` where one of ``names`` (or none, or all) is hostile instead."""

    def build(target: str) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries(
            {
                name: HOSTILE_STR_OR_NOT if target in (name, "all") else strategy
                for name, strategy in good.items()
            }
        )

    return st.sampled_from(["none", "all", *names]).flatmap(build)


KEY_ARGUMENTS = hostile_in(
    "key",
    "scope",
    "fingerprint",
    key=st.one_of(st.uuids().map(str), PRINTABLE),
    scope=st.sampled_from(["default", "a.b:c/d-e_f", "x" * 100]),
    fingerprint=st.one_of(st.none(), PRINTABLE),
)


@scaled(80)
@given(arguments=KEY_ARGUMENTS, door=st.sampled_from(["owned", "joined", "decorator"]))
def test_keys_scopes_and_fingerprints(world: World, arguments: dict[str, Any], door: str) -> None:
    ob = world.ob
    key, scope, fingerprint = arguments["key"], arguments["scope"], arguments["fingerprint"]

    def run() -> tuple[bool, Any]:
        if door == "owned":
            with ob.unit_of_work(key, scope=scope, fingerprint=fingerprint) as uow:
                if uow.replayed:
                    return True, uow.result
                return False, _body(uow, str(key))
        if door == "joined":
            with (
                Session(world.engine) as session,
                session.begin(),
                ob.unit_of_work(key, scope=scope, fingerprint=fingerprint, session=session) as uow,
            ):
                if uow.replayed:
                    return True, uow.result
                return False, _body(uow, str(key))
        ran: list[bool] = []

        @ob.idempotent(key=lambda k: k, scope=scope, fingerprint=lambda k: fingerprint)
        def handler(uow: outbox.UnitOfWork, k: Any) -> Any:
            ran.append(True)
            return _body(uow, str(k))

        result = handler(key)
        return not ran, result

    # A key used before (Hypothesis repeats values) may meet another fingerprint.
    seen = _hashable(scope, key) and (scope, key) in world.used
    errors = INPUT + ((KeyReuseError,) if seen else ())
    activities = []

    def watched() -> tuple[bool, Any]:
        with watch(world.engine) as activity:
            activities.append(activity)
            return run()

    outcome = attempt("keys, scopes, fingerprints", watched, errors, world.counts)
    activity = activities[0]
    if isinstance(outcome, KeyReuseError):
        return
    if isinstance(outcome, BaseException):
        # Refused before any I/O: not a connection checked out, not a statement sent.
        assert activity.total == 0, activity
        return
    replayed, result = outcome
    assert replayed == seen
    world.used.add((scope, key))
    assert result == {"done": "yes"}
    # Round trip: the duplicate replays the result, and the key is stored as given.
    with ob.unit_of_work(key, scope=scope, fingerprint=fingerprint) as uow:
        assert uow.replayed and uow.result == {"done": "yes"}
    with world.engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT fingerprint FROM idempotency_keys WHERE scope = :s AND key = :k"),
            {"s": scope, "k": key},
        ).all()
    assert len(stored) == 1


@scaled(30)
@given(arguments=KEY_ARGUMENTS)
def test_keys_and_scopes_in_the_asyncio_flavour(
    database_url: str, redis_url: str, world: World, arguments: dict[str, Any]
) -> None:
    key, scope = arguments["key"], arguments["scope"]

    async def run() -> Any:
        engine = create_async_engine(database_url)
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            async with outbox.AsyncOutbox(
                engine, redis=client, config=OutboxConfig(cache_prefix=world.prefix)
            ) as aob:
                try:
                    fingerprint = arguments["fingerprint"]
                    async with aob.unit_of_work(key, scope=scope, fingerprint=fingerprint) as uow:
                        if not uow.replayed:
                            await uow.connection.execute(INSERT_ORDER, {"k": "async", "a": 1})
                            uow.result = 1
                        return uow.result
                except INPUT as exc:
                    return exc
        finally:
            await client.aclose()
            await engine.dispose()

    def action() -> Any:
        result = asyncio.run(run())
        if isinstance(result, BaseException):
            raise result
        return result

    seen = _hashable(scope, key) and (scope, key) in world.used
    errors = INPUT + ((KeyReuseError,) if seen else ())
    outcome = attempt("keys, scopes (asyncio)", action, errors, world.counts)
    if not isinstance(outcome, BaseException):
        world.used.add((scope, key))
        assert outcome == 1


def _hashable(*values: object) -> bool:
    try:
        hash(values)
    except TypeError:
        return False
    return True


# ------------------------------------------------------------ events: topic, key, headers


HEADER_VALUES = st.one_of(HOSTILE_TEXT, st.binary(max_size=40), NOT_TEXT)
HEADERS = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(HOSTILE_TEXT, st.integers(), st.none(), st.binary(max_size=5)),
        HEADER_VALUES,
        max_size=3,
    ),
    NOT_TEXT,
    st.just({IDEMPOTENCY_HEADER: "\ud800"}),
    st.just({IDEMPOTENCY_HEADER.lower(): b"\xff\xfe"}),
)
TOPICS = st.one_of(st.just("orders.created"), HOSTILE_STR_OR_NOT, st.text("ab._-", max_size=300))
MESSAGE_KEYS = st.one_of(st.none(), HOSTILE_STR_OR_NOT, st.binary(max_size=40))
VALUES = st.one_of(HOSTILE_VALUE, st.binary(max_size=100), HOSTILE_TEXT)


def _stored_event(world: World, event_id: uuid.UUID) -> Any:
    with world.engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT topic, key, value, headers FROM outbox WHERE event_id = :e"),
            {"e": event_id},
        ).one()


def _check_round_trip(row: Any, topic: str, value: Any, key: Any, headers: Any) -> None:
    assert row.topic == topic
    expected_key = key.encode() if isinstance(key, str) else key
    assert (bytes(row.key) if row.key is not None else None) == expected_key
    if value is None:  # a tombstone: a null value, no content type
        assert row.value is None
        assert not any(name.lower() == CONTENT_TYPE_HEADER for name in row.headers)
        return
    stored = bytes(row.value)
    if isinstance(value, bytes):
        assert stored == value
    elif isinstance(value, str):
        assert stored == value.encode()
    else:
        assert json_equal(json.loads(stored), json_form(value))
    for name, given_value in (headers or {}).items():
        held = row.headers[name]
        if isinstance(given_value, bytes):
            assert base64.b64decode(held["base64"]) == given_value
        else:
            assert held == given_value
    assert any(name.lower() == CONTENT_TYPE_HEADER for name in row.headers)


EVENT_ARGUMENTS = st.sampled_from(["none", "topic", "value", "key", "headers", "all"]).flatmap(
    lambda target: st.fixed_dictionaries(
        {
            "topic": TOPICS if target in ("topic", "all") else st.just("orders.created"),
            "value": VALUES if target in ("value", "all") else st.just({"id": 1}),
            "key": MESSAGE_KEYS if target in ("key", "all") else st.sampled_from([None, "k"]),
            "headers": HEADERS if target in ("headers", "all") else st.just({"h": "v"}),
        }
    )
)


@scaled(100)
@given(arguments=EVENT_ARGUMENTS, keyless=st.booleans())
def test_events(world: World, arguments: dict[str, Any], keyless: bool) -> None:
    ob = world.ob
    topic, value = arguments["topic"], arguments["value"]
    key, headers = arguments["key"], arguments["headers"]

    def in_unit_of_work() -> uuid.UUID:
        with ob.unit_of_work(world.fresh(), scope="events") as uow:
            uow.connection.execute(INSERT_ORDER, {"k": "event", "a": 1})
            with watch(world.engine) as activity:
                event_id = uow.publish(topic, value, key=key, headers=headers)
            assert activity.total == 0  # buffered: nothing is sent before the commit
            uow.result = None
            return event_id

    def keyless_publish() -> uuid.UUID:
        refused: BaseException | None = None
        with world.engine.connect() as conn:
            with conn.begin():  # committed even after a refusal: it must hold nothing
                try:
                    return ob.publish(conn, topic, value, key=key, headers=headers)
                except INPUT as exc:
                    refused = exc
            raise refused

    family = "events: Outbox.publish" if keyless else "events: uow.publish"
    outcome = attempt(family, keyless_publish if keyless else in_unit_of_work, INPUT, world.counts)
    if isinstance(outcome, BaseException):
        return
    _check_round_trip(_stored_event(world, outcome), topic, value, key, headers)


# -------------------------------------------------------------------------------- results


@scaled(100)
@given(value=HOSTILE_VALUE, through=st.sampled_from(["attribute", "decorator"]))
def test_results(world: World, value: Any, through: str) -> None:
    ob = world.ob
    key = world.fresh()

    def run() -> Any:
        if through == "attribute":
            with ob.unit_of_work(key, scope="results") as uow:
                uow.connection.execute(INSERT_ORDER, {"k": "result", "a": 1})
                uow.result = value
                return uow.result

        @ob.idempotent(key="k", scope="results")
        def handler(uow: outbox.UnitOfWork, k: str) -> Any:
            uow.connection.execute(INSERT_ORDER, {"k": "result", "a": 1})
            return value

        return handler(key)

    outcome = attempt("results", run, (SerializationError,), world.counts)
    if isinstance(outcome, BaseException):
        return
    for _ in range(2):  # from Redis, then (the entry deleted) from PostgreSQL
        with ob.unit_of_work(key, scope="results") as uow:
            assert uow.replayed
            assert json_equal(uow.result, json_form(value))
        assert ob.cache is not None
        ob.cache.client.delete(ob.cache.redis_key("results", key))


# ------------------------------------------------------------- garbage and forgeries in Redis


GARBAGE = st.one_of(
    st.binary(max_size=2048),
    st.integers(1, 100_000).map(lambda d: b"[" * d + b"]" * d),
    st.integers(1, 50_000).map(lambda d: b'{"s":"completed","r":' + b"[" * d + b"]" * d + b"}"),
    st.builds(
        lambda r: json.dumps({"s": "completed", "f": None, "r": json.dumps(r)}).encode(),
        st.integers(),
    ),
    st.builds(lambda e: json.dumps({"s": "failed", "e": e}).encode(), st.text(max_size=20)),
    st.just(b""),
)


@scaled(60)
@given(before=GARBAGE, between=GARBAGE)
def test_garbage_under_a_key_changes_no_outcome(
    world: World, before: bytes, between: bytes
) -> None:
    ob = world.ob
    assert ob.cache is not None
    key = world.fresh()
    redis_key = ob.cache.redis_key("garbage", key)

    def place() -> tuple[bool, Any]:
        with ob.unit_of_work(key, scope="garbage") as uow:
            if uow.replayed:
                return True, uow.result
            uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
            uow.result = {"key": key}
            return False, uow.result

    start = world.counts()
    world.client.set(redis_key, before)
    assert attempt("garbage in Redis", place, ()) == (False, {"key": key})
    world.client.set(redis_key, between)
    assert place() == (True, {"key": key})
    assert place() == (True, {"key": key})
    end = world.counts()
    assert (end[0] - start[0], end[2] - start[2]) == (1, 1)  # one key, one effect


# ------------------------------------------------------------------- configuration, schemas


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1e300, float("nan"), float("inf"), True, None, "5", b"5"]),
)
CONFIG_FIELDS = {
    "cache_ttl": NUMBERS,
    "retention": NUMBERS,
    "cache_socket_timeout": NUMBERS,
    "cache_connect_timeout": NUMBERS,
    "cache_retry_after": NUMBERS,
    "max_payload_bytes": NUMBERS,
    "cache_prefix": HOSTILE_STR_OR_NOT,
    "schema": HOSTILE_STR_OR_NOT,
    "permanent_errors": st.one_of(
        st.just((ValueError,)), st.just([KeyError]), NOT_TEXT, st.just(("ValueError",))
    ),
    "wake_relays": st.one_of(st.booleans(), NOT_TEXT),
}


@scaled(100)
@given(
    fields=st.sampled_from([*CONFIG_FIELDS, "none"]).flatmap(
        lambda name: st.fixed_dictionaries({name: CONFIG_FIELDS[name]} if name != "none" else {})
    ),
    engine_options=st.one_of(
        st.none(),
        st.just({"pool_size": -5}),
        st.just({"no_such_option": 1}),
        st.just({"pool_size": "many"}),
        NOT_TEXT,
    ),
    schema=st.one_of(st.none(), HOSTILE_STR_OR_NOT),
)
def test_outbox_configuration(
    world: World, database_url: str, fields: dict[str, Any], engine_options: Any, schema: Any
) -> None:
    def build() -> outbox.Outbox:
        config = OutboxConfig(**fields)
        return outbox.Outbox(
            database_url, schema=schema, config=config, engine_options=engine_options
        )

    outcome = attempt("configuration and schema names", build, INPUT, world.counts)
    if isinstance(outcome, BaseException):
        return
    try:
        # Accepted settings make a working outbox (the schema, if any, exists or not: the
        # tables are the migration's business).
        assert outcome.config.cache_ttl < outcome.config.retention
        if outcome.config.schema is None:
            with outcome.unit_of_work(world.fresh(), scope="config") as uow:
                uow.result = 1
    finally:
        outcome.close()


@scaled(60)
@given(schema=HOSTILE_STR_OR_NOT)
def test_schema_names_reach_no_sql(world: World, schema: Any) -> None:
    def build() -> Any:
        ob = outbox.Outbox(world.engine, schema=schema)
        ob.close()
        return _validate.shown(schema)

    activities = []

    def watched() -> Any:
        with watch(world.engine) as activity:
            activities.append(activity)
            return build()

    outcome = attempt("configuration and schema names", watched, INPUT, world.counts)
    assert activities[0].total == 0
    if not isinstance(outcome, BaseException) and schema is not None:
        assert isinstance(schema, str) and re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema)
        assert not schema.startswith("pg_")


# ------------------------------------------------------------------------------ callables


@scaled(30)
@given(
    key=st.one_of(st.just("request_id"), st.just(str), st.text(max_size=5), NOT_TEXT),
    fingerprint=st.one_of(st.none(), st.just(str), NOT_TEXT),
    scope=st.one_of(st.just("default"), HOSTILE_STR_OR_NOT),
)
def test_the_decorator_refuses_bad_arguments_when_it_decorates(
    world: World, key: Any, fingerprint: Any, scope: Any
) -> None:
    def decorate() -> Callable[..., Any]:
        def handler(uow: Any, request_id: str) -> int:
            return 1

        decorated = world.ob.idempotent(key, scope=scope, fingerprint=fingerprint)(handler)
        # Accepted only within the documented rule: the key names one of the handler's
        # parameters or is a callable, the fingerprint is a callable, False or None, the scope
        # a valid scope name.
        assert key == "request_id" or callable(key), f"accepted key {key!r}"
        assert fingerprint is None or fingerprint is False or callable(fingerprint)
        assert isinstance(scope, str) and 1 <= len(scope) <= 100, f"accepted scope {scope!r}"
        assert re.fullmatch(r"[A-Za-z0-9._:/-]+", scope), f"accepted scope {scope!r}"
        return decorated

    attempt("decorator", decorate, INPUT, world.counts)


def test_the_tally_counts_wrong_types() -> None:
    """The helper that all of the above rely on does fail on a wrong type."""
    from tests.fixtures.hostile import TALLY

    def boom() -> None:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    with pytest.raises(AssertionError, match="UnicodeEncodeError is not one of"):
        attempt("self-check", boom, INPUT)
    for counter in (TALLY.examples, TALLY.wrong_types):  # expected here: not a finding
        del counter["self-check"]
