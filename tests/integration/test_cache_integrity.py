"""A cache that cannot lie: entries a Redis writer forged, moved, kept past their expiry, or
that a recreated or restored database inherited, never skip a body. Only the database's own
entries -- signed with a key derived from a secret in PostgreSQL and the database's identity --
answer duplicates."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

import pytest
import redis
import sqlalchemy as sa

import outbox
from outbox import OutboxConfig
from outbox._core.claim import STATUS_COMPLETED, StoredOutcome
from outbox._redis.entry import derive_key, encode_entry
from outbox.schema import CACHE_SECRET
from tests.fixtures.postgres import DatabaseFactory
from tests.fixtures.uow import count, create_orders, place, watch


@pytest.fixture
def ob(
    make_outbox: Callable[..., outbox.Outbox], redis_url: str, redis_prefix: str
) -> outbox.Outbox:
    return make_outbox(redis_url, cache_prefix=redis_prefix)


def _raw(ob: outbox.Outbox, key: str) -> bytes | None:
    assert ob.cache is not None
    value: bytes | None = ob.cache.client.get(ob.cache.redis_key("shop", key))
    return value


def _write(ob: outbox.Outbox, key: str, value: bytes) -> None:
    assert ob.cache is not None
    ob.cache.client.set(ob.cache.redis_key("shop", key), value)


def test_a_forged_completed_entry_never_skips_the_body(ob: outbox.Outbox) -> None:
    place(ob, "warm")  # the cache knows its key now
    forged_result = json.dumps({"order": "forged"})
    guessed_key = derive_key(b"\x00" * 32, 1, 1, 1, 1)
    assert ob.cache is not None
    forgeries = {
        # The entry format of earlier versions: well-formed, unsigned.
        "f-legacy": json.dumps({"s": "completed", "f": None, "r": forged_result}).encode(),
        # Signed, with a key a Redis writer can compute without the database's secret.
        "f-guessed": encode_entry(
            StoredOutcome(STATUS_COMPLETED, None, forged_result, None),
            guessed_key,
            ob.cache.redis_key("shop", "f-guessed"),
            int(time.time() * 1000) + 60_000,
        )
        or b"",
    }
    for key, forged in forgeries.items():
        _write(ob, key, forged)
        assert place(ob, key) == (False, {"order": key})  # the body ran
        assert place(ob, key) == (True, {"order": key})  # and its own entry answers now
    assert count(ob.engine, "orders") == 1 + len(forgeries)


def test_an_entry_moved_to_another_key_is_not_trusted(ob: outbox.Outbox) -> None:
    place(ob, "o-1")
    place(ob, "o-1")  # the first duplicate caches the outcome
    genuine = _raw(ob, "o-1")
    assert genuine is not None
    _write(ob, "o-2", genuine)
    assert place(ob, "o-2") == (False, {"order": "o-2"})
    assert count(ob.engine, "orders") == 2


def test_an_entry_kept_past_its_expiry_is_not_trusted(
    make_outbox: Callable[..., outbox.Outbox], redis_url: str, redis_prefix: str
) -> None:
    ob = make_outbox(
        redis_url,
        cache_prefix=redis_prefix,
        cache_ttl=1.0,
        retention=3600.0,
        min_redelivery_window=60.0,
    )
    place(ob, "o-1")
    place(ob, "o-1")  # the first duplicate caches the outcome
    assert ob.cache is not None
    ob.cache.client.persist(ob.cache.redis_key("shop", "o-1"))  # a writer keeps it alive
    time.sleep(1.1)
    assert _raw(ob, "o-1") is not None
    # The key is forgotten by the database (outbox gc): it must run again.
    with ob.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM idempotency_keys WHERE key = 'o-1'"))
    assert place(ob, "o-1") == (False, {"order": "o-1"})
    assert count(ob.engine, "orders") == 2


@pytest.fixture
def second_database(_database_factory: DatabaseFactory) -> Iterator[tuple[str, str]]:
    """``(name, url)`` of one more fresh database for this test."""
    name = _database_factory.create()
    try:
        yield name, _database_factory.url_for(name)
    finally:
        _database_factory.drop(name)


def _outbox(url: str, redis_url: str, prefix: str) -> outbox.Outbox:
    engine = sa.create_engine(url)
    create_orders(engine)
    return outbox.Outbox(
        engine, redis=redis.Redis.from_url(redis_url), config=OutboxConfig(cache_prefix=prefix)
    )


def _close(ob: outbox.Outbox) -> None:
    ob.close()
    ob.engine.dispose()
    assert ob.cache is not None
    ob.cache.client.close()


def test_a_recreated_database_does_not_trust_its_predecessors_entries(
    _database_factory: DatabaseFactory,
    second_database: tuple[str, str],
    redis_url: str,
    redis_prefix: str,
) -> None:
    name, url = second_database
    running = _outbox(url, redis_url, redis_prefix)
    try:
        for key in ("o-1", "o-3"):
            assert place(running, key) == (False, {"order": key})
            assert place(running, key) == (True, {"order": key})
        # The database is dropped and created again (same name, same template, same secret
        # row); Redis keeps its entries.
        _database_factory.drop(name)
        _database_factory._execute(
            f'CREATE DATABASE "{name}" TEMPLATE "{_database_factory.create_template()}"'
        )
        # The running process's pooled connections died with the old database: its first
        # statement fails, and the pool reconnects.
        with pytest.raises(sa.exc.OperationalError):
            create_orders(running.engine)
        create_orders(running.engine)
        # A process started now runs the key again...
        fresh = _outbox(url, redis_url, redis_prefix)
        try:
            assert place(fresh, "o-1") == (False, {"order": "o-1"})
        finally:
            _close(fresh)
        # ...and so does the one that was running, now that it reconnected.
        assert place(running, "o-2") == (False, {"order": "o-2"})
        assert place(running, "o-3") == (False, {"order": "o-3"})
        assert count(running.engine, "orders") == 3  # o-1 (by the fresh process), o-2, o-3
    finally:
        _close(running)


def test_a_restored_secret_does_not_make_another_database_trusted(
    make_outbox: Callable[..., outbox.Outbox],
    second_database: tuple[str, str],
    redis_url: str,
    redis_prefix: str,
) -> None:
    original = make_outbox(redis_url, cache_prefix=redis_prefix)
    assert place(original, "o-1") == (False, {"order": "o-1"})
    # A restore copies the secret row into another database (a dump restored elsewhere).
    with original.engine.connect() as conn:
        secret = conn.execute(sa.text(f"SELECT secret FROM {CACHE_SECRET}")).scalar_one()
    _, url = second_database
    restored = _outbox(url, redis_url, redis_prefix)
    try:
        with restored.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {CACHE_SECRET} SET secret = :s"), {"s": secret})
        assert place(restored, "o-1") == (False, {"order": "o-1"})
        assert count(restored.engine, "orders") == 1
    finally:
        _close(restored)


def test_without_its_secret_the_cache_steps_aside(
    make_outbox: Callable[..., outbox.Outbox],
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ob = make_outbox(redis_url, cache_prefix=redis_prefix)
    with ob.engine.begin() as conn:
        conn.execute(sa.text(f"DELETE FROM {CACHE_SECRET}"))
    caplog.set_level(logging.WARNING, logger="outbox.cache")
    assert place(ob, "o-1") == (False, {"order": "o-1"})
    assert place(ob, "o-1") == (True, {"order": "o-1"})  # from PostgreSQL
    assert _raw(ob, "o-1") is None  # nothing unsigned is written
    assert "outbox migrate" in caplog.text
    assert count(ob.engine, "orders") == 1


def test_the_fast_path_reads_the_key_once(ob: outbox.Outbox) -> None:
    place(ob, "o-1")
    place(ob, "o-1")  # the first duplicate caches the outcome
    with watch(ob.engine) as activity:
        for _ in range(20):
            assert place(ob, "o-1") == (True, {"order": "o-1"})
    assert activity.total == 0
