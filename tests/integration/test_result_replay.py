"""A stored result replays identically from Redis and from PostgreSQL.

For generated JSON results -- floats of every magnitude (subnormal, 1e308, integral ones like
1e16, negative zero), big integers, nested values up to the depth limit, keys in any order, the
empty key, text at the validation rules' edges -- the result of a first run, its replay from
Redis, its replay from PostgreSQL (the Redis entry gone) and its replay from Redis again (warmed
from PostgreSQL) are equal: the same Python types and the same JSON text. For owned, joined and
batched units of work and the HTTP middleware's stored response, on the real services.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import example, given, strategies as st

import outbox
from outbox import OutboxConfig
from outbox.http.wsgi import IdempotencyMiddleware
from outbox.uow import Batch
from tests.fixtures.hostile import json_equal, json_form, scaled
from tests.fixtures.results import RESULTS
from tests.fixtures.uow import rows

ISSUE_EXAMPLES = [1e308, 3.1848137127254646e235, {"": 2.909181916649598e152}, 1e16, -0.0]


class World:
    def __init__(self, engine: sa.Engine, redis_url: str, prefix: str) -> None:
        self.engine = engine
        self.client = redis.Redis.from_url(redis_url)
        self.ob = outbox.Outbox(engine, redis=self.client, config=OutboxConfig(cache_prefix=prefix))

    def forget(self, scope: str, key: str) -> None:
        """Take the key's entry out of Redis: the next replay comes from PostgreSQL."""
        assert self.ob.cache is not None
        assert self.client.delete(self.ob.cache.redis_key(scope, key)) == 1

    def cached(self, scope: str, key: str) -> bool:
        assert self.ob.cache is not None
        return bool(self.client.exists(self.ob.cache.redis_key(scope, key)))

    def close(self) -> None:
        self.ob.close()
        self.client.close()


@pytest.fixture
def world(engine: sa.Engine, redis_url: str, redis_prefix: str) -> Iterator[World]:
    w = World(engine, redis_url, redis_prefix)
    yield w
    w.close()


def _owned_replay(world: World, scope: str, key: str) -> Any:
    with world.ob.unit_of_work(key, scope=scope) as uow:
        assert uow.replayed
        return uow.result


def _joined_replay(world: World, scope: str, key: str) -> Any:
    with world.engine.connect() as conn, world.ob.unit_of_work(key, scope, connection=conn) as uow:
        assert uow.replayed
        return uow.result


def _batch_replay(world: World, scope: str, key: str) -> Any:
    batch = Batch.open(world.ob, scope, [key])
    try:
        with batch.unit_of_work(key, scope) as uow:
            assert uow.replayed
            result = uow.result
        batch.commit()
    finally:
        batch.close()
    return result


def _replays(world: World, scope: str, key: str, mode: str) -> list[tuple[str, Any]]:
    """The result replayed from Redis, from PostgreSQL, and from Redis warmed by PostgreSQL
    (an owned unit of work leaves Redis to its first duplicate, which PostgreSQL answers)."""
    replay = {"owned": _owned_replay, "joined": _joined_replay, "batch": _owned_replay}[mode]
    got: list[tuple[str, Any]] = []
    if mode == "owned":
        assert not world.cached(scope, key)
        got.append(("postgresql, first duplicate", replay(world, scope, key)))
    assert world.cached(scope, key)
    got.append(("redis", replay(world, scope, key)))
    world.forget(scope, key)
    if mode == "batch":  # a batch reads PostgreSQL only (and warms Redis)
        got.append(("postgresql (batch)", _batch_replay(world, scope, key)))
        world.forget(scope, key)
    got.append(("postgresql", replay(world, scope, key)))
    assert world.cached(scope, key)  # warmed from PostgreSQL
    got.append(("redis, warmed", replay(world, scope, key)))
    return got


def _first_run(world: World, scope: str, key: str, mode: str, value: Any) -> Any:
    if mode == "owned":
        with world.ob.unit_of_work(key, scope=scope) as uow:
            uow.result = value
        return uow.result
    if mode == "joined":
        with world.engine.connect() as conn:
            with world.ob.unit_of_work(key, scope, connection=conn) as uow:
                uow.result = value
            conn.commit()
        return uow.result
    batch = Batch.open(world.ob, scope, [key])
    try:
        with batch.unit_of_work(key, scope) as uow:
            uow.result = value
        batch.commit()
    finally:
        batch.close()
    return uow.result


@scaled(100)
@given(value=RESULTS, mode=st.sampled_from(["owned", "joined", "batch"]))
@example(value=ISSUE_EXAMPLES, mode="owned")
@example(value={"b": 1.5, "a": [1e16, -0.0]}, mode="joined")
@example(value={"z": 1e308, "": {"y": 5e-324}}, mode="batch")
def test_a_result_replays_identically_from_redis_and_postgresql(
    world: World, value: Any, mode: str
) -> None:
    scope, key = "replay", f"k-{uuid.uuid4().hex}"
    original = _first_run(world, scope, key, mode, value)
    assert json_equal(original, json_form(value))
    for path, replayed in _replays(world, scope, key, mode):
        assert json_equal(replayed, original), f"{mode}, replayed from {path}: {replayed!r}"


def test_json_equal_tells_types_spellings_and_key_order_apart() -> None:
    assert json_equal({"a": [1.0, None, "x"]}, {"a": [1.0, None, "x"]})
    assert not json_equal(1e16, 10**16)
    assert not json_equal(-0.0, 0.0)
    assert not json_equal({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert not json_equal(True, 1)
    assert not json_equal([1e308], [int(1e308)])


# -- the HTTP middleware's stored response ----------------------------------------------------


def _call(middleware: Any, key: str, body: bytes) -> tuple[str, dict[str, str], bytes]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/echo", "SCRIPT_NAME": "", "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(body), "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)), "HTTP_IDEMPOTENCY_KEY": key,
    }  # fmt: skip
    answer: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer[:] = [status, dict(headers)]
        return lambda data: None

    chunks = middleware(environ, start_response)
    try:
        data = b"".join(chunks)
    finally:
        getattr(chunks, "close", lambda: None)()
    return answer[0], answer[1], data


def _echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """Answers with the JSON it received, as the handler's own ``json.dumps`` writes it."""
    value = json.loads(environ["wsgi.input"].read())
    body = json.dumps({"echo": value, "at": 1.5e300}, ensure_ascii=False).encode()
    start_response("201 Created", [("Content-Type", "application/json"), ("X-Run", "1")])
    return [body]


@scaled(30)
@given(value=RESULTS)
@example(value=ISSUE_EXAMPLES)
def test_the_http_stored_response_replays_identically(world: World, value: Any) -> None:
    middleware = IdempotencyMiddleware(_echo, world.ob)
    key = f"k-{uuid.uuid4().hex}"
    body = json.dumps(value, ensure_ascii=False).encode()
    status, headers, data = _call(middleware, key, body)
    assert status == "201 Created" and "idempotent-replayed" not in headers
    (stored_row,) = rows(world.engine, "SELECT result FROM idempotency_keys WHERE key = :k", k=key)
    assert list(stored_row[0]) == ["body", "status", "headers", "encoding"]  # plain jsonb
    first = _owned_replay(world, "http", key)
    world.forget("http", key)
    from_postgresql = _owned_replay(world, "http", key)
    assert json_equal(from_postgresql, first)
    for _ in ("redis", "postgresql"):
        again = _call(middleware, key, body)
        assert again[0] == status and again[2] == data
        assert again[1]["idempotent-replayed"] == "true"
        assert {n.lower(): v for n, v in again[1].items()}["content-type"] == "application/json"
        world.forget("http", key)
