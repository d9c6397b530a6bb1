"""The guard when Redis fails or holds garbage: stopped, stalled, flushed, out of memory."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox.errors import GuardUnavailable, LeaseLost, OutboxError
from outbox.guard import AsyncRedisGuard, Claim, RedisGuard
from tests.fixtures.guard import Target, new_prefix
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.redis import PrivateRedis
from tests.fixtures.redis_cluster import LocalRedisCluster


@pytest.fixture(autouse=True)
def _collect_dropped_connections() -> Iterator[None]:
    """These tests break Redis under the guard's clients on purpose. On such errors redis-py's
    cluster client drops a node's connection without closing its socket (a plain client closed
    afterwards leaves none); collected at some later moment, the socket's ResourceWarning would
    fail whichever test ran then. Collect here, where the socket was dropped."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


# ---------------------------------------------------------------------------- Redis stopped


def test_closed_policy_refuses_to_run_while_redis_is_down(
    private_redis: Callable[..., PrivateRedis],
) -> None:
    server = private_redis()
    with RedisGuard(server.url, lease=5) as guard:
        with guard.claim("before") as claim:
            claim.result = 1
        server.shutdown()
        ran = []
        for key in ("before", "new"):
            with pytest.raises(GuardUnavailable, match="body was not run") as info:
                guard.run(key, lambda claim: ran.append(claim))
            # Refused on the refused connection itself, not after a wait or a retry loop.
            assert any(isinstance(e, redis.exceptions.ConnectionError) for e in causes(info.value))
            assert info.value.key == key
        assert ran == []
        server.start()  # empty: nothing was persisted
        assert guard.run("new", lambda claim: claim.fence) == 1


def test_open_policy_runs_unguarded_and_warns(
    private_redis: Callable[..., PrivateRedis], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.guard")
    server = private_redis()
    with RedisGuard(server.url, on_redis_error="open") as guard:
        server.shutdown()
        seen: list[tuple[bool, int]] = []

        def body(claim: Claim) -> str:
            seen.append((claim.guarded, claim.fence))
            return "sent"

        assert guard.run("mail", body) == "sent"
        assert guard.run("mail", body) == "sent"  # and again: nothing remembers it
        assert seen == [(False, 0), (False, 0)]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2
        assert "may run twice" in warnings[0].getMessage()


@pytest.mark.parametrize("policy", ["closed", "open"])
def test_redis_stopping_during_the_body(
    private_redis: Callable[..., PrivateRedis], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="outbox.guard")
    server = private_redis()
    with RedisGuard(server.url, on_redis_error=policy, lease=5) as guard:
        claim = guard.claim("k")
        claim.__enter__()
        server.shutdown()  # while the body runs
        claim.result = "done"
        if policy == "closed":
            with pytest.raises(GuardUnavailable, match="ran, but its outcome was not recorded"):
                claim.__exit__(None, None, None)
        else:
            claim.__exit__(None, None, None)
            assert "carrying on" in caplog.text


def test_async_guard_under_both_policies(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    server.shutdown()

    async def run() -> None:
        async with AsyncRedisGuard(server.url) as closed:
            with pytest.raises(GuardUnavailable):
                async with closed.claim("k"):
                    raise AssertionError("ran while Redis was down")
        open_ = AsyncRedisGuard(server.url, on_redis_error="open")
        async with open_, open_.claim("k") as claim:
            assert not claim.guarded
            claim.result = 1

    asyncio.run(run())


def test_a_stalled_redis_is_known_within_a_second(
    private_redis: Callable[..., PrivateRedis], tcp_proxy: Callable[..., TcpProxy]
) -> None:
    server = private_redis()
    proxy = tcp_proxy("127.0.0.1", server.port)
    with RedisGuard(f"redis://127.0.0.1:{proxy.port}/0") as guard:
        assert guard.run("warm", lambda claim: 1) == 1  # a connection in the pool
        proxy.stall()
        with pytest.raises(GuardUnavailable) as refused:
            guard.run("k", lambda claim: 1)
        # Known by the client's own socket timeout (docs/guard.md: the timeouts add up to at
        # most 1 s), not by a wait that happened to end.
        assert any(isinstance(e, redis.exceptions.TimeoutError) for e in causes(refused.value))
        proxy.restore()


def test_a_dead_cluster_master_fails_only_its_own_keys(redis_cluster: LocalRedisCluster) -> None:
    # A cluster of this test's own (the session's must stay whole); the session fixture has
    # already shown that redis-server and redis-cli are there.
    cluster = LocalRedisCluster().start()
    try:
        target = Target("cluster", cluster.url, cluster=True)
        client = target.client()
        with target.guard() as guard:
            keys = [f"k{i}" for i in range(30)]
            for key in keys:
                guard.run(key, lambda claim: 1)
            dead = cluster.nodes[1]
            on_dead = {
                key
                for key in keys
                if client.get_node_from_key(guard.claim(key).redis_key).port == dead.port  # type: ignore[union-attr]
            }
            assert 0 < len(on_dead) < len(keys)
            client.close()
            dead.kill()
            for key in keys:
                if key in on_dead:
                    with pytest.raises(GuardUnavailable) as refused:
                        guard.run(key, lambda claim: 2)
                    # the dead master's own connection error, not a cluster-wide failure
                    assert any(
                        isinstance(
                            e, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError
                        )
                        for e in causes(refused.value)
                    )
                else:
                    assert guard.run(key, lambda claim: 2) == 1  # replayed from a live master
    finally:
        cluster.close()


# ---------------------------------------------------------------------------- Redis flushed


def test_a_lost_record_turns_the_owners_completion_into_lease_lost(
    redis_server: PrivateRedis,
) -> None:
    prefix = new_prefix()
    admin = redis.Redis.from_url(redis_server.url)
    with RedisGuard(redis_server.url, prefix=prefix) as guard:
        with pytest.raises(LeaseLost, match="record left Redis"), guard.claim("k") as claim:
            claim.result = 1
            admin.delete(claim.redis_key)  # what FLUSHALL or an eviction does to one key
        with guard.claim("k") as claim:
            assert not claim.replayed and claim.fence == 1  # a new record starts over
    admin.close()


def test_flushed_script_cache_is_reloaded(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    admin = redis.Redis.from_url(server.url)
    with RedisGuard(server.url) as guard:
        assert guard.run("a", lambda claim: 1) == 1
        admin.script_flush()
        assert guard.run("b", lambda claim: 2) == 2
        assert guard.run("a", lambda claim: 3) == 1
    assert admin.info("commandstats")["cmdstat_eval"]["calls"] >= 1
    admin.close()


def test_out_of_memory_script_error_is_guard_unavailable(
    private_redis: Callable[..., PrivateRedis],
) -> None:
    server = private_redis()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # every write is refused inside the script
    with RedisGuard(server.url) as guard:
        # Redis 7 lets the claim's first writes through and refuses a later one: the error
        # comes at the claim or at the completion, and is GuardUnavailable either way.
        with pytest.raises(GuardUnavailable, match="maxmemory") as info:
            guard.run("k", lambda claim: 1)
        causes = []
        cause: BaseException | None = info.value
        while cause is not None:
            causes.append(type(cause))
            cause = cause.__cause__
        assert redis.exceptions.OutOfMemoryError in causes
    admin.close()


# ---------------------------------------------------------------------------- garbage


def _now_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _write(client: Any, key: str, shape: str) -> None:
    now = _now_ms(client)
    future = str(now + 60_000)
    hashes: dict[str, dict[str, str | bytes]] = {
        "empty-ish hash": {"junk": "1"},
        "unknown status": {"s": "X", "t": "tok", "n": "1"},
        "no token": {"s": "P", "n": "1", "d": future},
        "fence not a number": {"s": "P", "t": "tok", "n": "abc", "d": future},
        "negative fence": {"s": "R", "t": "tok", "n": "-1"},
        "fence too large": {"s": "R", "t": "tok", "n": "1e400"},
        "fence not an integer": {"s": "R", "t": "tok", "n": "1.5"},
        "deadline not a number": {"s": "P", "t": "tok", "n": "1", "d": "soon"},
        "deadline years ahead": {"s": "P", "t": "tok", "n": "1", "d": str(now + 10**12)},
        "completed without result": {"s": "C", "t": "tok", "n": "1"},
        "truncated result": {"s": "C", "t": "tok", "n": "1", "r": '{"a": [1, '},
        "result not UTF-8": {"s": "C", "t": "tok", "n": "1", "r": b"\xff\xfe"},
        "result nested too deep": {
            "s": "C",
            "t": "tok",
            "n": "1",
            "r": "[" * 50_000 + "]" * 50_000,
        },
        "failed without error": {"s": "F", "t": "tok", "n": "1"},
    }
    if shape == "string":
        client.set(key, '{"s": "C"}')
    elif shape == "list":
        client.rpush(key, "s", "C")
    elif shape == "set":
        client.sadd(key, "C")
    elif shape == "zset":
        client.zadd(key, {"C": 1})
    elif shape == "stream":
        client.xadd(key, {"s": "C"})
    else:
        client.hset(key, mapping=hashes[shape])


GARBAGE = [
    "string", "list", "set", "zset", "stream",
    "empty-ish hash", "unknown status", "no token", "fence not a number", "negative fence",
    "fence too large", "fence not an integer", "deadline not a number", "deadline years ahead",
    "completed without result", "truncated result", "result not UTF-8", "result nested too deep",
    "failed without error",
]  # fmt: skip


@pytest.mark.parametrize("shape", GARBAGE)
def test_garbage_is_guard_unavailable_or_runs_unguarded(guard_target: Target, shape: str) -> None:
    prefix = new_prefix()
    client = guard_target.client()
    try:
        for policy in ("closed", "open"):
            with guard_target.guard(prefix=prefix, on_redis_error=policy) as guard:
                key = f"{shape}-{policy}"
                _write(client, guard.claim(key).redis_key, shape)
                ran: list[bool] = []

                def body(claim: Claim, ran: list[bool] = ran) -> None:
                    ran.append(claim.guarded)

                if policy == "closed":
                    with pytest.raises(GuardUnavailable, match="not written by this guard"):
                        guard.run(key, body)
                    assert ran == []
                else:
                    guard.run(key, body)
                    assert ran == [False]
    finally:
        client.close()


def test_a_record_turned_to_garbage_during_the_body(guard_target: Target) -> None:
    client = guard_target.client()
    try:
        with guard_target.guard() as guard:
            claim = guard.claim("k")
            claim.__enter__()
            client.delete(claim.redis_key)
            client.set(claim.redis_key, "garbage")
            with pytest.raises(GuardUnavailable, match="holds a string"):
                claim.__exit__(None, None, None)
    finally:
        client.close()


def test_a_valid_released_record_written_by_hand_runs_fresh(redis_server: PrivateRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    with RedisGuard(redis_server.url, prefix=new_prefix()) as guard:
        key = guard.claim("k").redis_key
        client.hset(key, mapping={"s": "R", "t": "someone", "n": "41", "f": ""})
        with guard.claim("k") as claim:
            assert claim.fence == 42
    client.close()


garbage_values = st.one_of(
    st.binary(max_size=12),
    st.sampled_from(
        [b"P", b"C", b"F", b"R", b"", b"0", b"1", b"-1", b"1.5", b"1e400", b"nan", b"inf",
         b"0x10", b" 7 ", b"null", b"[1]", b'{"a":', b"9999999999999999", b"\xff"]
    ),
)  # fmt: skip
garbage_records = st.dictionaries(
    st.sampled_from(["s", "t", "n", "d", "f", "r", "e", "x"]), garbage_values, max_size=8
)


def test_any_hash_under_the_key_gives_an_outbox_error_or_a_run(redis_server: PrivateRedis) -> None:
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    prefix = new_prefix()
    outcomes: dict[str, int] = {}
    with (
        RedisGuard(redis_server.url, prefix=prefix) as closed,
        RedisGuard(redis_server.url, prefix=prefix, on_redis_error="open") as open_,
    ):

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(record=garbage_records, now_deadline=st.booleans(), guard_open=st.booleans())
        def attempt(record: dict[str, bytes], now_deadline: bool, guard_open: bool) -> None:
            guard = open_ if guard_open else closed
            redis_key = guard.claim("k").redis_key
            client.delete(redis_key)
            if now_deadline and "d" in record:
                record["d"] = str(_now_ms(client) + 5_000).encode()
            if record:
                client.hset(redis_key, mapping=record)  # type: ignore[arg-type]
            try:
                guard.run("k", lambda claim: "ran")
                outcome = "ran"
            except OutboxError as exc:
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        attempt()
    client.close()
    print(f"outcomes over generated records: {outcomes}")
    assert outcomes.get("GuardUnavailable", 0) > 0 and outcomes.get("ran", 0) > 0
