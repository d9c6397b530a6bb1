"""Units of work of many keys in one transaction (the consumer's micro-batches), on the real
PostgreSQL and Redis: the same outcomes as single units of work, one savepoint per unit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

import outbox
from outbox import AsyncOutbox, OutboxConfig
from outbox._core.claim import STATUS_COMPLETED
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    PermanentError,
    PreviouslyFailed,
)
from outbox.uow import AsyncBatch, Batch
from tests.fixtures.pgbouncer import through
from tests.fixtures.uow import INSERT_ORDER, count, create_orders, rows

SCOPE = "shop"


class Boom(Exception):
    """A transient failure of a body."""


@pytest.fixture(params=["direct", "transaction-pooler"])
def ob(
    request: pytest.FixtureRequest, engine: sa.Engine, redis_url: str, redis_prefix: str
) -> Iterator[outbox.Outbox]:
    """An outbox on this test's database, directly or through PgBouncer in transaction mode
    (tests/fixtures/pgbouncer.py)."""
    create_orders(engine)
    client = redis.Redis.from_url(redis_url)
    if request.param == "direct":
        with outbox.Outbox(
            engine, redis=client, config=OutboxConfig(cache_prefix=redis_prefix)
        ) as instance:
            yield instance
    else:
        url = through(
            request.getfixturevalue("pgbouncers"),
            "transaction",
            engine.url.render_as_string(hide_password=False),
        )
        config = OutboxConfig(cache_prefix=redis_prefix, pooler="transaction")
        with outbox.Outbox(url, redis=client, config=config) as instance:
            yield instance
    client.close()


def order_keys(engine: sa.Engine) -> list[str]:
    return [r[0] for r in rows(engine, "SELECT order_key FROM orders ORDER BY id")]


def statuses(engine: sa.Engine) -> dict[str, str]:
    return dict(rows(engine, "SELECT key, status FROM idempotency_keys"))


def test_each_unit_of_work_commits_with_the_batch_or_not_at_all(
    ob: outbox.Outbox, engine: sa.Engine
) -> None:
    keys = ["a", "b", "c", "d"]
    batch = Batch.open(ob, SCOPE, keys)
    try:
        for key in keys:
            with batch.unit_of_work(key, SCOPE) as uow:
                assert not uow.replayed
                uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
                uow.publish("orders.created", {"key": key}, key=key)
                uow.result = {"order": key}
        # Nothing is visible, nothing is cached, before the batch commits.
        assert count(engine, "orders") == 0 and count(engine, "idempotency_keys") == 0
        assert ob.cache is not None and ob.cache.get(SCOPE, "a") is None
        batch.commit()
    finally:
        batch.close()
    assert order_keys(engine) == keys
    assert statuses(engine) == dict.fromkeys(keys, "completed")
    outbox_rows = rows(engine, "SELECT key, value FROM outbox ORDER BY id")
    assert [bytes(k) for k, _ in outbox_rows] == [k.encode() for k in keys]  # in order
    assert json.loads(bytes(outbox_rows[2][1])) == {"key": "c"}
    results = dict(rows(engine, "SELECT key, result FROM idempotency_keys"))
    assert results["d"] == {"order": "d"}
    cached = ob.cache.get(SCOPE, "b")
    assert cached is not None and cached.status == STATUS_COMPLETED
    assert json.loads(cached.result_json or "") == {"order": "b"}


def test_a_failing_unit_rolls_back_alone_and_a_permanent_one_is_recorded(
    ob: outbox.Outbox, engine: sa.Engine
) -> None:
    keys = ["ok1", "flaky", "poison", "ok2"]
    batch = Batch.open(ob, SCOPE, keys)
    try:
        for key in keys:
            with contextlib.suppress(Boom, PermanentError), batch.unit_of_work(key, SCOPE) as uow:
                uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
                uow.publish("orders.created", {"key": key}, key=key)
                if key == "flaky":
                    raise Boom("transient")
                if key == "poison":
                    raise PermanentError("cannot apply")
            assert batch.usable()
        batch.commit()
    finally:
        batch.close()
    assert order_keys(engine) == ["ok1", "ok2"]
    assert statuses(engine) == {"ok1": "completed", "ok2": "completed", "poison": "failed"}
    assert count(engine, "outbox") == 2
    error = rows(engine, "SELECT error FROM idempotency_keys WHERE key = 'poison'")[0][0]
    assert error == "PermanentError: cannot apply"
    # The failure is final, as in a single unit of work.
    with pytest.raises(PreviouslyFailed), ob.unit_of_work("poison", scope=SCOPE):
        pass


def test_lookups_answer_like_single_units_of_work(
    ob: outbox.Outbox, database_url: str, engine: sa.Engine
) -> None:
    with ob.unit_of_work("done", scope=SCOPE, fingerprint="f1") as uow:
        uow.result = "stored"
    with contextlib.suppress(PermanentError), ob.unit_of_work("failed", scope=SCOPE):
        raise PermanentError("no")
    assert ob.cache is not None
    ob.cache.client.flushdb()  # the answers below come from PostgreSQL
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ob.unit_of_work("busy", scope=SCOPE):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        batch = Batch.open(ob, SCOPE, ["done", "failed", "busy", "new", "reused"])
        try:
            assert [batch.lookup(k).runnable for k in ("done", "failed", "busy", "new")] == [
                False, False, False, True,
            ]  # fmt: skip
            with batch.unit_of_work("done", SCOPE, fingerprint="f1") as uow:
                assert uow.replayed and uow.result == "stored"
            with pytest.raises(PreviouslyFailed), batch.unit_of_work("failed", SCOPE):
                pass
            with pytest.raises(KeyInProgress), batch.unit_of_work("busy", SCOPE):
                pass  # at once: the batch never waits for another attempt
            used = pytest.raises(ConfigurationError, match="already had its unit of work")
            with used, batch.unit_of_work("done", SCOPE):
                pass
            batch.commit()
        finally:
            batch.close()
        # Outcomes read from PostgreSQL warm the cache.
        assert ob.cache.get(SCOPE, "done") is not None
        batch = Batch.open(ob, SCOPE, ["done"])
        try:
            with pytest.raises(KeyReuseError), batch.unit_of_work("done", SCOPE, "f2"):
                pass
        finally:
            batch.close()
    finally:
        release.set()
        holder.join(10)


def test_keys_and_values_of_any_shape_survive_the_batch_statements(
    ob: outbox.Outbox, engine: sa.Engine
) -> None:
    keys = ['quo"te', "back\\slash", "it's", "{brace,comma}", "NULL", "ünï ☃", " spaced "]
    keys += ["new\nline", "tab\there"]  # control characters: quoted element by element
    batch = Batch.open(ob, SCOPE, keys)
    try:
        for i, key in enumerate(keys):
            with batch.unit_of_work(key, SCOPE, fingerprint=f"fp-{key}") as uow:
                uow.publish("t", b"\x00\\x00'\"{}", key=b"\x00\xff" if i % 2 else None)
                uow.result = {"key": key, "text": 'a "b" \\ c'}
        batch.commit()
    finally:
        batch.close()
    stored = dict(rows(engine, "SELECT key, result FROM idempotency_keys"))
    assert stored == {key: {"key": key, "text": 'a "b" \\ c'} for key in keys}
    fingerprints = dict(rows(engine, "SELECT key, fingerprint FROM idempotency_keys"))
    assert fingerprints == {key: f"fp-{key}" for key in keys}
    events = rows(engine, "SELECT key, value FROM outbox ORDER BY id")
    assert [None if k is None else bytes(k) for k, _ in events] == [
        None if i % 2 == 0 else b"\x00\xff" for i in range(len(keys))
    ]
    assert {bytes(v) for _, v in events} == {b"\x00\\x00'\"{}"}


def test_large_events_go_as_binary_parameters(ob: outbox.Outbox, engine: sa.Engine) -> None:
    payload = bytes(range(256)) * 1024  # 256 KiB: past the inline limit
    batch = Batch.open(ob, SCOPE, ["big1", "big2"])
    try:
        for key in ("big1", "big2"):
            with batch.unit_of_work(key, SCOPE) as uow:
                uow.publish("t", payload, key=key)
        assert batch.staged_bytes == 2 * len(payload)
        batch.commit()
    finally:
        batch.close()
    assert [bytes(r[0]) == payload for r in rows(engine, "SELECT value FROM outbox")] == [True] * 2


def test_an_orm_session_and_a_body_that_touches_nothing(
    ob: outbox.Outbox, engine: sa.Engine
) -> None:
    from tests.integration.test_uow import Order

    batch = Batch.open(ob, SCOPE, ["orm", "pure", "orm-fails"])
    try:
        with batch.unit_of_work("orm", SCOPE) as uow:
            uow.session.add(Order(order_key="orm", amount=3))  # flushed when the unit ends
        with batch.unit_of_work("pure", SCOPE) as uow:
            uow.publish("t", {"only": "an event"})
            assert not uow.touched
        with contextlib.suppress(Boom), batch.unit_of_work("orm-fails", SCOPE) as uow:
            uow.session.add(Order(order_key="orm-fails", amount=4))
            uow.session.flush()
            raise Boom("after a flush")
        batch.commit()
    finally:
        batch.close()
    assert order_keys(engine) == ["orm"]
    assert statuses(engine) == {"orm": "completed", "pure": "completed"}


def test_units_of_work_of_one_body_end_together(ob: outbox.Outbox, engine: sa.Engine) -> None:
    batch = Batch.open(ob, SCOPE, ["g1", "g2", "g3", "g4"])
    try:
        with batch.units_of_work([("g1", None), ("g2", None)]) as units:
            units[0].connection.execute(
                INSERT_ORDER, [{"k": u.key, "a": 1} for u in units]
            )  # one statement for both
            for u in units:
                u.result = u.key
        group = batch.units_of_work([("g3", None), ("g4", None)])
        with contextlib.suppress(PermanentError), group as units:
            units[0].connection.execute(INSERT_ORDER, {"k": "g3", "a": 1})
            raise PermanentError("one of them, but which?")
        batch.commit()
    finally:
        batch.close()
    assert order_keys(engine) == ["g1", "g2"]
    # A failure of several units cannot be laid at one key's door: none is recorded.
    assert statuses(engine) == {"g1": "completed", "g2": "completed"}


def test_the_asyncio_batch(database_url: str, redis_url: str, redis_prefix: str) -> None:
    engine = sa.create_engine(database_url)
    create_orders(engine)

    async def main() -> None:
        aob = AsyncOutbox(
            database_url, redis_url=redis_url, config=OutboxConfig(cache_prefix=redis_prefix)
        )
        try:
            batch = await AsyncBatch.open(aob, SCOPE, ["x", "y", "z"])
            try:
                for key in ("x", "y", "z"):
                    with contextlib.suppress(Boom):
                        async with batch.unit_of_work(key, SCOPE) as uow:
                            await uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
                            if key == "y":
                                raise Boom("transient")
                            uow.result = key
                await batch.commit()
            finally:
                await batch.close()
            assert aob.cache is not None and await aob.cache.get(SCOPE, "z") is not None
        finally:
            await aob.close()

    asyncio.run(main())
    assert order_keys(engine) == ["x", "z"]
    assert statuses(engine) == {"x": "completed", "z": "completed"}
    engine.dispose()


def test_a_decided_key_is_answered_without_a_unit_of_work(ob: outbox.Outbox) -> None:
    """Batch.replay decides a key that is not runnable as its unit of work would: a replay
    (warming the cache), or the same refusals; a runnable or used key is refused."""
    with ob.unit_of_work("done", scope=SCOPE, fingerprint="f1") as uow:
        uow.result = "stored"
    with contextlib.suppress(PermanentError), ob.unit_of_work("failed", scope=SCOPE):
        raise PermanentError("no")
    assert ob.cache is not None
    ob.cache.client.flushdb()  # the answers below come from PostgreSQL
    batch = Batch.open(ob, SCOPE, ["done", "failed", "new", "reused"])
    try:
        batch.replay("done", "f1")
        with pytest.raises(ConfigurationError, match="already had its unit of work"):
            batch.replay("done", "f1")
        with pytest.raises(ConfigurationError, match="already had its unit of work"):
            batch.unit_of_work("done", SCOPE, "f1").__enter__()
        with pytest.raises(PreviouslyFailed):
            batch.replay("failed", None)
        with pytest.raises(ConfigurationError, match="its work runs here"):
            batch.replay("new", None)
        batch.commit()
    finally:
        batch.close()
    assert ob.cache.get(SCOPE, "done") is not None  # warmed, as a replayed unit of work does
    batch = Batch.open(ob, SCOPE, ["done"])
    try:
        with pytest.raises(KeyReuseError):
            batch.replay("done", "f2")
    finally:
        batch.close()


def test_units_begun_and_ended_without_a_with_block(ob: outbox.Outbox, engine: sa.Engine) -> None:
    """Batch.begin and Batch.end (the consumer's optimistic path) run a key's unit of work as
    its with-block would: in an optimistic batch, the units that ended well commit with it,
    and one that ends with its body's error abandons it; a decided key has no work to begin."""
    with ob.unit_of_work("done", scope=SCOPE) as uow:
        uow.result = "stored"
    batch = Batch.open(ob, SCOPE, ["done", "n1", "n2"], optimistic=True)
    try:
        with pytest.raises(ConfigurationError, match="decided already"):
            batch.begin("done")
        for key in ("n1", "n2"):
            uow = batch.begin(key)
            uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
            uow.publish("orders.created", {"key": key}, key=key)
            uow.result = {"order": key}
            batch.end(uow, None)
        assert not batch.abandoned
        batch.commit()
    finally:
        batch.close()
    assert order_keys(engine) == ["n1", "n2"]
    assert statuses(engine) == {"done": "completed", "n1": "completed", "n2": "completed"}
    assert count(engine, "outbox") == 2

    batch = Batch.open(ob, SCOPE, ["n3", "n4"], optimistic=True)
    try:
        uow = batch.begin("n3")
        uow.connection.execute(INSERT_ORDER, {"k": "n3", "a": 1})
        batch.end(uow, Boom("transient"))
        assert batch.abandoned and not batch.usable()
    finally:
        batch.close()
    assert order_keys(engine) == ["n1", "n2"]
    assert "n3" not in statuses(engine)
