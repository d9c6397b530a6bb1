"""What a Redis writer can do to the guard: with a ``secret``, its COMPLETED and FAILED records
are signed and a forged or moved one is never replayed; without one, the guard's integrity is
the write access to its Redis (docs/guard.md, "Who can write to Redis decides")."""

from __future__ import annotations

import pytest

from outbox._core.guard import record_key
from outbox.errors import GuardUnavailable, PermanentError, PreviouslyFailed
from outbox.guard import RedisGuard
from tests.fixtures.guard import Target, new_prefix
from tests.fixtures.redis import PrivateRedis

SECRET = "a-secret-of-the-guarded-services-0123456789"


def _forge(target: Target, prefix: str, result: bytes) -> None:
    """Copy the genuine record of ``paid`` to ``never-ran`` with another result."""
    client = target.client()
    try:
        genuine = client.hgetall(record_key(prefix, "payments", "paid"))
        forged = {**genuine, b"r": result}
        client.hset(record_key(prefix, "payments", "never-ran"), mapping=forged)
    finally:
        client.close()


def _guard(redis_server: PrivateRedis, **settings: object) -> tuple[Target, str, RedisGuard]:
    target = Target("redis", redis_server.url, cluster=False)
    prefix = new_prefix()
    return target, prefix, target.guard(prefix=prefix, **settings)


def test_with_a_secret_a_forged_or_moved_record_is_never_replayed(
    redis_server: PrivateRedis,
) -> None:
    target, prefix, guard = _guard(redis_server, secret=SECRET)
    try:
        assert guard.run("paid", lambda claim: {"charged": 10}, scope="payments") == {"charged": 10}
        assert guard.run("paid", lambda claim: {}, scope="payments") == {"charged": 10}
        genuine = target.client().hget(record_key(prefix, "payments", "paid"), "r")
        assert isinstance(genuine, bytes)
        ran: list[str] = []
        attempts = {
            b'{"charged": 999}': "not signed",  # the format of a guard without a secret
            b"s1:99999999999999:" + b"0" * 32 + b':{"charged": 999}': "does not match",
            genuine: "does not match",  # a genuine record moved to another key
        }
        for result, why in attempts.items():
            _forge(target, prefix, result)
            with pytest.raises(GuardUnavailable, match=why):
                guard.run("never-ran", lambda claim: ran.append("body"), scope="payments")
        assert ran == []

        def decline(claim: object) -> None:
            raise PermanentError("card declined")

        with pytest.raises(PermanentError):
            guard.run("declined", decline, scope="payments")
        with pytest.raises(PreviouslyFailed, match="card declined"):
            guard.run("declined", decline, scope="payments")
    finally:
        guard.close()


def test_without_a_secret_a_redis_writer_decides_the_outcome(redis_server: PrivateRedis) -> None:
    target, prefix, guard = _guard(redis_server)
    try:
        assert guard.run("paid", lambda claim: {"charged": 10}, scope="payments") == {"charged": 10}
        _forge(target, prefix, b'{"charged": 999}')
        ran: list[str] = []
        result = guard.run("never-ran", lambda claim: ran.append("body") or {}, scope="payments")
        assert result == {"charged": 999} and ran == []
    finally:
        guard.close()
