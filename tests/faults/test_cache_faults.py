"""The Redis fast path when Redis fails -- stopped, unreachable, flushed or slow: the outcomes
are the database's, the same as with a healthy cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

import outbox
from outbox.errors import PermanentError, PreviouslyFailed
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.redis import PrivateRedis
from tests.fixtures.uow import count, place


def _outcomes(ob: outbox.Outbox) -> list[tuple[bool, object]]:
    results = [place(ob, "r-1"), place(ob, "r-1"), place(ob, "r-2")]
    with pytest.raises(PermanentError), ob.unit_of_work("r-3", scope="shop"):
        raise PermanentError("nope")
    with pytest.raises(PreviouslyFailed):
        place(ob, "r-3")
    results.append(place(ob, "r-2"))
    return results


EXPECTED = [
    (False, {"order": "r-1"}),
    (True, {"order": "r-1"}),
    (False, {"order": "r-2"}),
    (True, {"order": "r-2"}),
]


def test_redis_stopped_gives_the_same_outcomes(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    server = private_redis()
    ob = make_outbox(server.url, cache_retry_after=0.2)
    place(ob, "warm")
    server.shutdown()
    assert _outcomes(ob) == EXPECTED
    assert count(ob.engine, "orders") == 3
    # Back up: the fast path resumes by itself.
    server.start()
    place(ob, "after")  # writes the cache again once the retry delay has passed

    def cached() -> bool:
        place(ob, "after")
        assert ob.cache is not None
        return bool(redis.Redis.from_url(server.url).exists(ob.cache.redis_key("shop", "after")))

    wait_for(cached, timeout=10, message="cache resumed after Redis came back")


def test_redis_unreachable_gives_the_same_outcomes(
    make_outbox: Callable[..., outbox.Outbox],
) -> None:
    ob = make_outbox(f"redis://127.0.0.1:{free_port()}/0")
    assert _outcomes(ob) == EXPECTED


def test_redis_flushed_gives_the_same_outcomes(
    make_outbox: Callable[..., outbox.Outbox], private_redis: Callable[..., PrivateRedis]
) -> None:
    server = private_redis()
    ob = make_outbox(server.url)
    assert place(ob, "r-1") == (False, {"order": "r-1"})
    redis.Redis.from_url(server.url).flushall()
    assert place(ob, "r-1") == (True, {"order": "r-1"})
    assert count(ob.engine, "orders") == 1


def test_redis_slow_gives_the_same_outcomes(
    make_outbox: Callable[..., outbox.Outbox],
    private_redis: Callable[..., PrivateRedis],
    tcp_proxy: Callable[..., TcpProxy],
) -> None:
    server = private_redis()
    proxy = tcp_proxy("127.0.0.1", server.port)
    ob = make_outbox(f"redis://127.0.0.1:{proxy.port}/0", cache_retry_after=0.2)
    assert place(ob, "warm") == (False, {"order": "warm"})
    proxy.stall()  # connections stay open, nothing comes back: reads time out
    try:
        assert _outcomes(ob) == EXPECTED
    finally:
        proxy.restore()
    assert count(ob.engine, "orders") == 3
