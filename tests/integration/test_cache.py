"""The Redis fast path on real Redis servers: a cache, never the truth."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa

import outbox
from outbox import OutboxConfig
from outbox._core.claim import STATUS_COMPLETED, STATUS_FAILED, StoredOutcome
from outbox._core.readahead import WINDOW
from outbox._redis.entry import MAX_ENTRY_BYTES
from outbox.errors import ConfigurationError, PermanentError, PreviouslyFailed
from tests.fixtures.redis import PrivateRedis
from tests.fixtures.uow import INSERT_ORDER, count, place, watch


@pytest.fixture
def ob(
    make_outbox: Callable[..., outbox.Outbox], redis_url: str, redis_prefix: str
) -> outbox.Outbox:
    return make_outbox(redis_url, cache_prefix=redis_prefix)


def test_duplicate_of_completed_key_touches_no_postgres(ob: outbox.Outbox) -> None:
    assert place(ob, "o-1") == (False, {"order": "o-1"})
    assert place(ob, "o-1") == (True, {"order": "o-1"})  # PostgreSQL answers, Redis learns
    with watch(ob.engine) as activity:
        for _ in range(5):
            assert place(ob, "o-1") == (True, {"order": "o-1"})
    assert activity.total == 0, activity
    # The same counter does see PostgreSQL when the cache cannot answer.
    assert ob.cache is not None
    ob.cache.client.delete(ob.cache.redis_key("shop", "o-1"))
    with watch(ob.engine) as activity:
        assert place(ob, "o-1") == (True, {"order": "o-1"})
    assert activity.checkouts == 1
    # ...and that answer warmed the cache again.
    with watch(ob.engine) as activity:
        assert place(ob, "o-1") == (True, {"order": "o-1"})
    assert activity.total == 0


def test_failed_outcomes_are_cached_too(ob: outbox.Outbox) -> None:
    with pytest.raises(PermanentError), ob.unit_of_work("f-1", scope="shop"):
        raise PermanentError("out of stock")
    with watch(ob.engine) as activity, pytest.raises(PreviouslyFailed, match="out of stock"):
        place(ob, "f-1")
    assert activity.total == 0


def test_redis_is_written_only_after_the_commit(ob: outbox.Outbox) -> None:
    assert ob.cache is not None
    cache_key = ob.cache.redis_key("shop", "w-1")
    with ob.unit_of_work("w-1", scope="shop") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "w-1", "a": 1})
        uow.result = {"done": True}
        assert ob.cache.client.exists(cache_key) == 0
    # A first attempt writes nothing to Redis; its first duplicate, answered by PostgreSQL's
    # committed row, does.
    assert ob.cache.client.exists(cache_key) == 0
    with ob.unit_of_work("w-1", scope="shop") as uow:
        assert uow.replayed_from == "postgres"
    entry = json.loads(ob.cache.client.get(cache_key))
    assert entry["s"] == "completed" and json.loads(entry["r"]) == {"done": True}
    # A unit of work that does not commit leaves Redis untouched.
    with pytest.raises(RuntimeError), ob.unit_of_work("w-2", scope="shop"):
        raise RuntimeError("boom")
    assert ob.cache.client.exists(ob.cache.redis_key("shop", "w-2")) == 0


def test_ttl_is_configurable(
    make_outbox: Callable[..., outbox.Outbox], redis_url: str, redis_prefix: str
) -> None:
    ob = make_outbox(
        redis_url,
        cache_prefix=redis_prefix,
        cache_ttl=120.0,
        retention=3600.0,
        min_redelivery_window=60.0,
    )
    place(ob, "t-1")
    place(ob, "t-1")  # the first duplicate caches the outcome
    assert ob.cache is not None
    ttl_ms = ob.cache.client.pttl(ob.cache.redis_key("shop", "t-1"))
    assert 110_000 < ttl_ms <= 120_000


def test_cache_warmed_from_postgres_never_outlives_the_key(
    make_outbox: Callable[..., outbox.Outbox], redis_url: str, redis_prefix: str
) -> None:
    """A duplicate answered by PostgreSQL puts the outcome in Redis, but only for as long as the
    database keeps the key (``retention`` after its last update, then ``outbox gc``)."""
    ob = make_outbox(
        redis_url,
        cache_prefix=redis_prefix,
        cache_ttl=600.0,
        retention=3600.0,
        min_redelivery_window=60.0,
    )
    assert ob.cache is not None
    client = ob.cache.client
    for key, age in (("young", 0), ("old", 3600 - 100), ("expiring", 3600 - 0.5)):
        place(ob, key)
        with ob.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE idempotency_keys SET updated_at = now() - make_interval(secs => :a) "
                    "WHERE scope = 'shop' AND key = :k"
                ),
                {"a": age, "k": key},
            )
        client.delete(ob.cache.redis_key("shop", key))
        assert place(ob, key) == (True, {"order": key})  # replayed by PostgreSQL
    ttl = {k: client.pttl(ob.cache.redis_key("shop", k)) for k in ("young", "old", "expiring")}
    assert 590_000 < ttl["young"] <= 600_000  # the full cache_ttl
    assert 0 < ttl["old"] <= 100_000  # what is left of the key's retention
    assert ttl["expiring"] == -2  # under a second left: not cached at all


def test_ttl_must_be_shorter_than_retention() -> None:
    with pytest.raises(ConfigurationError, match="shorter than retention"):
        OutboxConfig(cache_ttl=7 * 86400.0, retention=7 * 86400.0).validate()


def test_garbage_in_redis_never_changes_the_outcome(ob: outbox.Outbox) -> None:
    assert ob.cache is not None
    for i, junk in enumerate(
        [b"not json", b'{"s": "completed", "r": 5}', b'{"s": "weird"}', b"[]", b'{"s": "failed"}']
    ):
        key = f"g-{i}"
        ob.cache.client.set(ob.cache.redis_key("shop", key), junk)
        assert place(ob, key) == (False, {"order": key})  # the database decides: a new key
        assert place(ob, key) == (True, {"order": key})
    assert count(ob.engine, "orders") == 5


def test_keys_are_single_and_unambiguous(ob: outbox.Outbox) -> None:
    assert ob.cache is not None
    a = ob.cache.redis_key("a:b", "c")
    b = ob.cache.redis_key("a", "b:c")
    assert a != b
    assert a.startswith(ob.config.cache_prefix + ":")


def test_first_attempts_stop_asking_redis_until_a_duplicate_arrives(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    """A key is in Redis only once a duplicate of it was answered: after a window of first
    attempts that found nothing there, the next ones go straight to their claims; the next
    duplicate, answered by PostgreSQL, turns the reads on again, and its key's further
    duplicates come from Redis."""
    server = private_redis()
    ob = make_outbox(server.url, cache_prefix="ahead")
    client = redis.Redis.from_url(server.url)

    def gets() -> int:
        stats: dict[str, dict[str, int]] = client.info("commandstats")
        return stats.get("cmdstat_get", {}).get("calls", 0)

    try:
        for i in range(WINDOW):
            assert place(ob, f"new-{i}") == (False, {"order": f"new-{i}"})
        assert gets() == WINDOW  # each asked Redis first, and found nothing
        for i in range(10):
            assert place(ob, f"later-{i}") == (False, {"order": f"later-{i}"})
        assert gets() == WINDOW  # not these
        assert place(ob, "new-0") == (True, {"order": "new-0"})  # PostgreSQL answers
        assert gets() == WINDOW
        with watch(ob.engine) as activity:
            assert place(ob, "new-0") == (True, {"order": "new-0"})
        assert activity.total == 0, activity  # Redis answered
        assert gets() == WINDOW + 1
        assert place(ob, "later-10") == (False, {"order": "later-10"})
        assert gets() == WINDOW + 2  # reading ahead again
    finally:
        client.close()


def test_a_batch_reads_its_keys_in_one_mget_with_the_answers_of_single_reads(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    """On a single Redis, get_many is one MGET; each answer is what get gives: an entry, or
    None for a key never stored and for garbage. (A server of its own: its command counts
    are this test's alone.)"""
    ob = make_outbox(private_redis().url)
    assert ob.cache is not None
    cache, client = ob.cache, ob.cache.client
    for key in ("m-1", "m-3"):
        place(ob, key)
        place(ob, key)  # a replay: the cache holds the outcome from here on
    client.set(cache.redis_key("shop", "m-junk"), b"not json")
    keys = ["m-1", "m-2", "m-3", "m-junk"]

    def calls(command: str) -> int:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0

    mgets, gets = calls("mget"), calls("get")
    many = cache.get_many("shop", keys)
    assert calls("mget") == mgets + 1 and calls("get") == gets
    assert [c is not None for c in many] == [True, False, True, False]
    assert many == [cache.get("shop", k) for k in keys]


def test_a_batch_writes_its_outcomes_in_one_write_and_its_connection_survives_a_refusal(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    """On a single Redis, put_many packs its SETs itself and writes them at once: each entry
    is there with its own expiry, readable as put gives it; an entry too large to cache is
    left out. A server that refuses the SETs (an error reply for each) makes the cache step
    aside, and the connection it kept is still in step: the next answers are the right ones.
    (A server of its own: it is made to refuse writes.)"""
    server = private_redis()
    ob = make_outbox(server.url, cache_retry_after=0.2)
    assert ob.cache is not None
    cache, client = ob.cache, ob.cache.client
    place(ob, "trust")  # reads the key of the database's entries
    assert cache.trusted
    done = StoredOutcome(STATUS_COMPLETED, "fp-1", json.dumps({"n": 1}), None)
    failed = StoredOutcome(STATUS_FAILED, None, None, "out of stock é")
    huge = StoredOutcome(STATUS_COMPLETED, None, json.dumps("x" * MAX_ENTRY_BYTES), None)

    def calls(command: str) -> int:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        return int(stats.get("calls", 0)) if isinstance(stats, dict) else 0

    sets = calls("set")
    cache.put_many("shop", [("p-1", done, None), ("p-big", huge, None), ("p-2", failed, 30.0)])
    assert calls("set") == sets + 2
    assert cache.get_many("shop", ["p-1", "p-big", "p-2"]) == [done, None, failed]
    assert 25_000 < client.pttl(cache.redis_key("shop", "p-2")) <= 30_000
    assert client.pttl(cache.redis_key("shop", "p-1")) > 30_000

    client.config_set("maxmemory", "1")  # every SET is refused: OOM
    try:
        cache.put_many("shop", [(f"q-{i}", done, None) for i in range(5)])
        assert not cache.available()  # stepped aside
    finally:
        client.config_set("maxmemory", "0")
    wait_for_cache = time.monotonic() + 5
    while not cache.available():
        assert time.monotonic() < wait_for_cache
        time.sleep(0.05)
    assert cache.get_many("shop", ["q-0", "p-1"]) == [None, done]
    assert cache.get("shop", "p-2") == failed
    cache.put_many("shop", [("q-0", done, None)])
    assert cache.get("shop", "q-0") == done
