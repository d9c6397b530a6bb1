"""The Redis guard's records are not signed: whoever can write to its Redis decides outcomes.

This is the documented boundary (docs/guard.md, "Who can write to Redis decides"): a record
copied to a key that never ran, with a result of the writer's choosing, is replayed and the
body does not run. Unlike the unit of work's cache, there is no database behind the guard to
check a record against, so its integrity is Redis's access control.
"""

from __future__ import annotations

from outbox._core.guard import record_key
from tests.fixtures.guard import Target, new_prefix
from tests.fixtures.redis import PrivateRedis


def test_a_redis_writer_can_make_a_key_that_never_ran_replay_its_result(
    redis_server: PrivateRedis,
) -> None:
    target = Target("redis", redis_server.url, cluster=False)
    prefix = new_prefix()
    guard = target.guard(prefix=prefix)
    client = target.client()
    try:
        assert guard.run("paid", lambda claim: {"charged": 10}, scope="payments") == {"charged": 10}
        genuine = client.hgetall(record_key(prefix, "payments", "paid"))
        forged = {**genuine, b"r": b'{"charged": 999}'}
        client.hset(record_key(prefix, "payments", "never-ran"), mapping=forged)
        ran: list[str] = []
        result = guard.run("never-ran", lambda claim: ran.append("body") or {}, scope="payments")
        assert result == {"charged": 999} and ran == []
    finally:
        guard.close()
        client.close()
