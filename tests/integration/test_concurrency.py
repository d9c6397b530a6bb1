"""Exactly one committed effect per (scope, key) under 16 racing threads."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import outbox
from outbox import OutboxConfig
from outbox.errors import KeyInProgress
from tests.fixtures.pgbouncer import through
from tests.fixtures.uow import INSERT_ORDER, create_orders, rows

THREADS = 16
SHARED_KEYS = 40
ROUNDS = 3


# "@transaction" / "@session": through PgBouncer in that mode (tests/fixtures/pgbouncer.py),
# three server connections for the sixteen threads.
@pytest.fixture(params=["postgres", "redis", "postgres@transaction", "postgres@session"])
def ob(
    request: pytest.FixtureRequest, engine: sa.Engine, redis_url: str, redis_prefix: str
) -> Iterator[outbox.Outbox]:
    create_orders(engine)
    store, _, route = request.param.partition("@")
    redis_option = {"redis_url": redis_url} if store == "redis" else {}
    url = engine.url.render_as_string(hide_password=False)
    if route:
        url = through(request.getfixturevalue("pgbouncers"), route, url)
    if route == "session":
        # A server connection per client connection for its life: one connection per unit
        # of work, so that sixteen clients take turns on three server connections.
        eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    else:
        # A pool large enough for every thread: pool waits are not lock waits. Behind a
        # transaction pooler, without prepared statements.
        args = {"prepare_threshold": None} if route else {}
        eng = sa.create_engine(url, pool_size=THREADS, max_overflow=0, connect_args=args)
    config = OutboxConfig(cache_prefix=redis_prefix, pooler=route or None)
    with outbox.Outbox(eng, config=config, **redis_option) as o:
        yield o
    eng.dispose()


def test_one_effect_per_key_with_16_threads(ob: outbox.Outbox) -> None:
    shared = [f"shared-{i}" for i in range(SHARED_KEYS)]
    barrier = threading.Barrier(THREADS)
    outcomes: Counter[str] = Counter()
    ran: Counter[str] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def attempt(key: str) -> None:
        while True:
            try:
                with ob.unit_of_work(key, scope="race") as uow:
                    if uow.replayed:
                        assert uow.result == {"key": key}
                        with lock:
                            outcomes["replayed"] += 1
                        return
                    uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
                    uow.publish("orders.created", {"key": key}, key=key)
                    uow.result = {"key": key}
                with lock:
                    outcomes["ran"] += 1
                    ran[key] += 1
                return
            except KeyInProgress:
                with lock:
                    outcomes["in_progress"] += 1

    def worker(n: int) -> None:
        rng = random.Random(n)
        try:
            barrier.wait(timeout=30)
            for r in range(ROUNDS):
                keys = shared[:]
                rng.shuffle(keys)
                keys += [f"own-{n}-{r}-{i}" for i in range(5)]  # new keys mixed in
                rng.shuffle(keys)
                for key in keys:
                    attempt(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads)
    assert errors == []

    expected_keys = SHARED_KEYS + THREADS * ROUNDS * 5
    per_key = rows(ob.engine, "SELECT order_key, count(*) AS n FROM orders GROUP BY order_key")
    assert len(per_key) == expected_keys
    assert {r.n for r in per_key} == {1}
    events = rows(ob.engine, "SELECT key, count(*) AS n FROM outbox GROUP BY key")
    assert len(events) == expected_keys and {r.n for r in events} == {1}
    assert rows(ob.engine, "SELECT count(*) AS n FROM idempotency_keys")[0].n == expected_keys
    # Every body that ran, committed; every other attempt replayed (or retried).
    assert set(ran.values()) == {1} and len(ran) == expected_keys
    assert outcomes["ran"] == expected_keys
    assert outcomes["replayed"] == SHARED_KEYS * (THREADS * ROUNDS - 1)
