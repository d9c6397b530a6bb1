"""The producers a fleet's relays borrow (outbox.relay._producers): lent to one relay at a
time, reused while healthy, never lent again with records in flight, the spare ones closed
after they stayed idle."""

from __future__ import annotations

import itertools
import time
from typing import Any, cast

from outbox._kafka.producer import KafkaProducer
from outbox.relay._producers import ProducerPool


class _Producer:
    """What the pool asks of a producer, and what it did to it."""

    numbers = itertools.count()

    def __init__(self) -> None:
        self.number = next(self.numbers)
        self.healthy = True
        self.closed = False
        self.served = 0

    def reusable(self) -> bool:
        return self.healthy

    def serve(self) -> None:
        self.served += 1

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


def _pool(keep: int = 1, linger: float = 30.0) -> tuple[ProducerPool, list[_Producer]]:
    built: list[_Producer] = []

    def factory() -> KafkaProducer:
        built.append(_Producer())
        return cast(KafkaProducer, built[-1])

    return ProducerPool(factory, keep=keep, linger=linger), built


def _p(producer: Any) -> _Producer:
    return cast(_Producer, producer)


def _settled(pool: ProducerPool, idle: int) -> None:
    """Wait for the pool's builder thread to have ``idle`` producers idle."""
    deadline = time.monotonic() + 10
    while pool.idle < idle:
        assert time.monotonic() < deadline, f"{pool.idle} idle, {idle} expected"
        time.sleep(0.001)


def test_a_producer_given_back_is_lent_again_instead_of_a_new_one() -> None:
    pool, built = _pool(keep=1)
    pool.warm()
    _settled(pool, 1)
    first = pool.lend()
    _settled(pool, 1)  # the next one, built ahead while the first is lent
    pool.give_back(first)
    for _ in range(5):
        producer = pool.lend()
        assert producer is first  # the one given back last
        pool.give_back(producer)
    assert len(built) == 2 and pool.built == 2 and pool.lent == 0


def test_relays_sending_at_once_each_get_a_producer_of_their_own() -> None:
    pool, _ = _pool(keep=1)
    held = [pool.lend() for _ in range(3)]
    assert len({id(p) for p in held}) == 3 and pool.lent == 3
    _settled(pool, 1)
    for producer in held:
        pool.give_back(producer)
    assert pool.idle == 4 and pool.lent == 0
    pool.close()


def test_a_producer_with_records_in_flight_or_broken_is_closed_not_lent_again() -> None:
    pool, _ = _pool(keep=0)  # none built ahead
    producer = pool.lend()
    _p(producer).healthy = False
    pool.give_back(producer)
    assert _p(producer).closed and pool.idle == 0
    assert pool.lend() is not producer


def test_a_producer_its_relay_threw_away_is_no_longer_counted_as_lent() -> None:
    pool, _ = _pool(keep=0)  # none built ahead
    pool.lend()
    pool.forget()
    assert pool.lent == 0 and pool.idle == 0


def test_warm_builds_the_producers_kept_idle_ahead_of_need() -> None:
    pool, built = _pool(keep=2)
    pool.warm()
    pool.warm()
    _settled(pool, 2)
    assert len(built) == 2
    pool.lend()
    _settled(pool, 2)  # built ahead: the next lend takes an idle one
    assert len(built) == 3
    pool.close()


def test_spare_producers_are_closed_once_idle_for_linger_and_keep_stay() -> None:
    pool, built = _pool(keep=1, linger=0.0)
    held = [pool.lend() for _ in range(3)]
    _settled(pool, 1)
    for producer in held:
        pool.give_back(producer)
    pool.serve()
    assert pool.idle == 1
    # The most recently given back stays (the warmest); the others are closed.
    assert [p.closed for p in built].count(False) == 1 and not _p(held[-1]).closed
    assert all(p.served == 1 for p in built)
    pool.close()


def test_spare_producers_stay_while_they_were_idle_less_than_linger() -> None:
    pool, built = _pool(keep=1, linger=3600.0)
    held = [pool.lend() for _ in range(3)]
    _settled(pool, 1)
    for producer in held:
        pool.give_back(producer)
    pool.serve()
    assert pool.idle == 4 and not any(p.closed for p in built)
    pool.close()


def test_close_closes_every_idle_producer_and_builds_no_more() -> None:
    pool, built = _pool(keep=2)
    pool.warm()
    _settled(pool, 2)
    pool.close()
    assert pool.idle == 0 and all(p.closed for p in built)
    pool.lend()  # a relay that still sends gets one, the pool builds none ahead
    time.sleep(0.05)
    assert pool.idle == 0 and len(built) == 3


def test_only_the_spare_producers_idle_for_linger_are_closed_whatever_their_place() -> None:
    """One built ahead goes to the front of the idle list, newer than those given back behind
    it: closing the stale ones must take exactly those out, never lend a closed one."""
    pool, built = _pool(keep=1, linger=30.0)
    held = [pool.lend() for _ in range(3)]
    _settled(pool, 1)  # built ahead, at the front
    for producer in held:
        pool.give_back(producer)
    # The three given back have been idle for long; the one built ahead just now.
    pool._idle = [(p, since - 60.0 if p in held else since) for p, since in pool._idle]
    pool.serve()
    closed = [p for p in built if p.closed]
    assert len(closed) == 3 and pool.idle == 1
    lent = [pool.lend() for _ in range(1)]
    assert not any(_p(p).closed for p in lent)
    pool.close()
