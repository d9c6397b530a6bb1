"""Owners of a guard claim that die or stall: real processes, SIGKILL and SIGSTOP/SIGCONT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import redis

from outbox.errors import KeyInProgress
from outbox.guard import Claim, RedisGuard
from tests.fixtures.common import wait_for
from tests.fixtures.guard import new_prefix
from tests.fixtures.redis import PrivateRedis

LEASE = 3.0  # long enough that a loaded machine cannot outrun it between two steps

# The owner: claims the key, reports its fence, then waits for a line on stdin inside the body.
# A downstream store (a hash in the same Redis) accepts a write only with a fence at least as
# high as the highest it has seen: the remedy for an owner that acts after its lease.
OWNER = textwrap.dedent(
    """
    import sys, time
    import redis
    from outbox.errors import LeaseLost
    from outbox.guard import RedisGuard

    url, prefix, lease, fenced_write = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    guard = RedisGuard(url, prefix=prefix, lease=lease)
    write = redis.Redis.from_url(url).register_script(fenced_write)
    before = time.monotonic()
    try:
        with guard.claim("victim") as claim:
            print(f"in-body {claim.fence} {before!r}", flush=True)
            sys.stdin.readline()
            accepted = write(keys=[f"{prefix}:ledger"], args=[claim.fence, "owner"])
            print(f"downstream {'accepted' if accepted else 'refused'}", flush=True)
            claim.result = {"by": "owner"}
        print("completed", flush=True)
    except LeaseLost as exc:
        print(f"lease-lost {exc.fence} {exc.current_fence}", flush=True)
    """
)

# Downstream write with a fence check: refuses a fence lower than one it has seen.
FENCED_WRITE = """
local seen = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) < seen then return 0 end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
return 1
"""


@pytest.fixture
def server(redis_server: PrivateRedis) -> PrivateRedis:
    return redis_server


@pytest.fixture
def owner(server: PrivateRedis) -> Iterator[tuple[subprocess.Popen[str], str, int, float]]:
    """A started owner process in its body: (process, key prefix, its fence, time before claim)."""
    prefix = new_prefix()
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER, server.url, prefix, str(LEASE), FENCED_WRITE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[0] == "in-body", line
        yield child, prefix, int(line[1]), float(line[2])
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait(10)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def take_over(guard: RedisGuard) -> tuple[Claim, float]:
    """Claim 'victim' as soon as its owner's lease runs out; returns the claim and the time."""
    taken: list[tuple[Claim, float]] = []

    def attempt() -> bool:
        claim = guard.claim("victim")
        try:
            claim.__enter__()
        except KeyInProgress:
            return False
        taken.append((claim, time.monotonic()))
        return True

    wait_for(attempt, LEASE + 10, "the key was not taken over", interval=0.005)
    return taken[0]


def test_sigkilled_owner_is_taken_over_after_its_lease_not_before(
    server: PrivateRedis, owner: tuple[subprocess.Popen[str], str, int, float]
) -> None:
    child, prefix, fence, before = owner
    with RedisGuard(server.url, prefix=prefix, lease=LEASE) as guard:
        with pytest.raises(KeyInProgress), guard.claim("victim"):
            raise AssertionError("two owners")
        child.kill()
        child.wait(10)
        with pytest.raises(KeyInProgress), guard.claim("victim"):  # dead, but its lease holds
            raise AssertionError("taken over before the lease ran out")
        taker, at = take_over(guard)
        waited = at - before
        print(f"taken over {waited:.3f}s after the dead owner's claim (lease {LEASE}s)")
        # Not before the lease ran out (its end is the take-over's whole point); how soon after it
        # depends on the machine, and the wait above is bounded by LEASE + 10 s.
        assert waited >= LEASE - 0.02
        assert taker.fence == fence + 1
        taker.result = {"by": "taker"}
        taker.__exit__(None, None, None)
        with guard.claim("victim") as claim:
            assert claim.replayed and claim.result == {"by": "taker"}


def test_stopped_owner_loses_its_lease_and_changes_nothing(
    server: PrivateRedis, owner: tuple[subprocess.Popen[str], str, int, float]
) -> None:
    child, prefix, fence, _ = owner
    assert child.stdin is not None and child.stdout is not None
    downstream = redis.Redis.from_url(server.url)
    write = downstream.register_script(FENCED_WRITE)
    with RedisGuard(server.url, prefix=prefix, lease=LEASE) as guard:
        os.kill(child.pid, signal.SIGSTOP)
        taker, _ = take_over(guard)
        assert taker.fence > fence
        assert write(keys=[f"{prefix}:ledger"], args=[taker.fence, "taker"]) == 1
        taker.result = {"by": "taker"}
        taker.__exit__(None, None, None)

        child.stdin.write("go on\n")
        child.stdin.flush()
        os.kill(child.pid, signal.SIGCONT)
        # The stale owner still acts (a lease cannot stop it): the fenced write refuses it,
        # and its completion raises LeaseLost without changing the key.
        assert child.stdout.readline().split() == ["downstream", "refused"]
        assert child.stdout.readline().split() == ["lease-lost", str(fence), str(taker.fence)]
        assert child.wait(10) == 0

        with guard.claim("victim") as claim:
            assert claim.replayed and claim.result == {"by": "taker"}
        assert downstream.hgetall(f"{prefix}:ledger") == {
            b"fence": str(taker.fence).encode(),
            b"value": b"taker",
        }
        # Fences keep growing for the key with every new owner.
        with pytest.raises(ValueError), guard.claim("victim-2") as first:
            raise ValueError
        with guard.claim("victim-2") as second:
            assert second.fence == first.fence + 1
    downstream.close()
