"""AsyncRedisGuard: the same contract as RedisGuard, on the same records, on real servers."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio

from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    LeaseLost,
    OutboxError,
    PermanentError,
    PreviouslyFailed,
    SerializationError,
)
from outbox.guard import AsyncClaim, AsyncRedisGuard, Claim, RedisGuard
from tests.fixtures.guard import Target, new_prefix

# Scripts of attempts on one key: what each attempt's body does, and the outcomes both flavours
# must give.
SCRIPTS: dict[str, tuple[list[str], list[Any]]] = {
    "completes": (["ok:1", "ok:2"], [("ran", 1), ("replayed", {"value": 1})]),
    "fails for good": (["permanent", "ok:1"], [("ran", 1), "PermanentError", "PreviouslyFailed"]),
    "fails, then completes": (
        ["transient", "transient", "ok:1", "ok:2", "permanent"],
        [
            ("ran", 1), "transient", ("ran", 2), "transient", ("ran", 3),
            ("replayed", {"value": 1}), ("replayed", {"value": 1}),
        ],
    ),
    "reuses the key": (["ok:1", "fp:other"], [("ran", 1), "KeyReuseError"]),
    "sets no JSON": (
        ["nojson", "ok:1", "ok:2"],
        [("ran", 1), "SerializationError", ("ran", 2), ("replayed", {"value": 1})],
    ),
}  # fmt: skip


def _sync_outcomes(guard: RedisGuard, key: str, steps: list[str]) -> list[Any]:
    outcomes: list[Any] = []
    for step in steps:
        fingerprint = "other" if step == "fp:other" else "same"
        try:
            with guard.claim(key, fingerprint=fingerprint) as claim:
                if claim.replayed:
                    outcomes.append(("replayed", claim.result))
                    continue
                outcomes.append(("ran", claim.fence))
                _body(claim, step)
        except OutboxError as exc:
            outcomes.append(type(exc).__name__)
        except RuntimeError:
            outcomes.append("transient")
    return outcomes


async def _async_outcomes(guard: AsyncRedisGuard, key: str, steps: list[str]) -> list[Any]:
    outcomes: list[Any] = []
    for step in steps:
        fingerprint = "other" if step == "fp:other" else "same"
        try:
            async with guard.claim(key, fingerprint=fingerprint) as claim:
                if claim.replayed:
                    outcomes.append(("replayed", claim.result))
                    continue
                outcomes.append(("ran", claim.fence))
                _body(claim, step)
        except OutboxError as exc:
            outcomes.append(type(exc).__name__)
        except RuntimeError:
            outcomes.append("transient")
    return outcomes


def _body(claim: Claim | AsyncClaim, step: str) -> None:
    if step.startswith("ok:"):
        claim.result = {"value": int(step[3:])}
    elif step == "permanent":
        raise PermanentError("refused")
    elif step == "transient":
        raise RuntimeError("try again")
    elif step == "nojson":
        claim.result = {1j}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_sync_and_async_guards_give_the_same_outcomes(guard_target: Target, script: str) -> None:
    steps, expected = SCRIPTS[script]
    with guard_target.guard() as guard:
        assert _sync_outcomes(guard, "k", steps) == expected

    async def run() -> list[Any]:
        async with guard_target.async_guard() as guard:
            return await _async_outcomes(guard, "k", steps)

    assert asyncio.run(run()) == expected


def test_both_flavours_share_the_records(guard_target: Target) -> None:
    prefix = new_prefix()

    async def run() -> None:
        with guard_target.guard(prefix=prefix) as sync_guard:
            async with guard_target.async_guard(prefix=prefix) as async_guard:
                with sync_guard.claim("a") as claim:
                    claim.result = "from sync"
                async with async_guard.claim("a") as aclaim:
                    assert aclaim.replayed and aclaim.result == "from sync"
                async with async_guard.claim("b") as aclaim:
                    aclaim.result = "from async"
                    with pytest.raises(KeyInProgress), sync_guard.claim("b"):
                        pass
                with sync_guard.claim("b") as claim:
                    assert claim.replayed and claim.result == "from async"
                with pytest.raises(ValueError), sync_guard.claim("c"):
                    raise ValueError
                async with async_guard.claim("c") as aclaim:
                    assert aclaim.fence == 2

    asyncio.run(run())


def test_async_outcomes_and_errors(guard_target: Target) -> None:
    async def run() -> None:
        async with guard_target.async_guard(lease=0.3) as guard:
            async with guard.claim("x", fingerprint="f1") as claim:
                claim.result = [1, "two"]
                with pytest.raises(SerializationError):
                    claim.result = float("nan")
            async with guard.claim("x") as claim:
                assert claim.replayed and claim.result == [1, "two"]
            with pytest.raises(KeyReuseError):
                async with guard.claim("x", fingerprint="f2"):
                    pass
            with pytest.raises(PermanentError):
                async with guard.claim("y"):
                    raise PermanentError("bounced")
            with pytest.raises(PreviouslyFailed, match="bounced"):
                async with guard.claim("y"):
                    pass
            # Takeover after the lease; the stale owner's completion changes nothing.
            stale = guard.claim("z")
            await stale.__aenter__()
            with pytest.raises(KeyInProgress):
                async with guard.claim("z"):
                    pass
            taker = await _claim_when_free(guard, "z", timeout=5)
            assert taker.fence == stale.fence + 1
            taker.result = "taker"
            await taker.__aexit__(None, None, None)
            with pytest.raises(LeaseLost):
                await stale.__aexit__(None, None, None)
            async with guard.claim("z") as claim:
                assert claim.result == "taker"

    asyncio.run(run())


def test_cancelled_body_releases_the_key(guard_target: Target) -> None:
    async def run() -> None:
        async with guard_target.async_guard(lease=60) as guard:
            entered = asyncio.Event()

            async def owner() -> None:
                async with guard.claim("c"):
                    entered.set()
                    await asyncio.Event().wait()  # until cancelled

            task = asyncio.create_task(owner())
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            async with guard.claim("c") as claim:  # free at once, no lease waited out
                assert not claim.replayed and claim.fence == 2

    asyncio.run(run())


def test_async_renewal_keeps_the_key(guard_target: Target) -> None:
    lease = 2.0  # renewed every 2/3 s: a loaded machine's scheduling cannot outlast it

    async def run() -> None:
        async with guard_target.async_guard(lease=lease, renew=True) as guard:
            release = asyncio.Event()
            entered = asyncio.Event()

            async def owner() -> int:
                async with guard.claim("long") as claim:
                    entered.set()
                    await release.wait()
                    claim.result = "finished"
                return claim.fence

            task = asyncio.create_task(owner())
            await entered.wait()
            loop = asyncio.get_running_loop()
            started = loop.time()
            while loop.time() - started < 2.5 * lease:
                with pytest.raises(KeyInProgress):
                    async with guard.claim("long"):
                        pass
                await asyncio.sleep(0.05)
            release.set()
            assert await task == 1
            async with guard.claim("long") as claim:
                assert claim.replayed and claim.result == "finished"

    asyncio.run(run())


def test_async_decorator_and_run(guard_target: Target) -> None:
    async def run() -> None:
        async with guard_target.async_guard() as guard:
            calls: list[str] = []

            @guard.idempotent(key="rid", fingerprint=lambda rid, amount: str(amount))
            async def charge(claim: AsyncClaim, rid: str, amount: int) -> dict[str, int]:
                calls.append(rid)
                await asyncio.sleep(0)
                return {"amount": amount, "fence": claim.fence}

            assert await charge("r1", 5) == {"amount": 5, "fence": 1}
            assert await charge("r1", amount=5) == {"amount": 5, "fence": 1}
            with pytest.raises(KeyReuseError):
                await charge("r1", 6)
            assert calls == ["r1"]

            async def fn(claim: AsyncClaim) -> str:
                return "ran"

            assert await guard.run("r2", fn) == "ran"
            assert await guard.run("r2", fn) == "ran"

            def plain(claim: AsyncClaim, rid: str) -> None: ...

            with pytest.raises(ConfigurationError, match=r"RedisGuard\.idempotent"):
                guard.idempotent(key="rid")(plain)  # type: ignore[arg-type]

    asyncio.run(run())


def test_sixteen_tasks_on_many_keys_run_each_body_once(guard_target: Target) -> None:
    keys = [f"race-{i}" for i in range(100)]
    runs: Counter[str] = Counter()
    active: set[str] = set()
    overlaps: list[str] = []

    async def run() -> list[dict[str, Any]]:
        async with guard_target.async_guard(lease=60) as guard:

            def body_for(key: str) -> Callable[[AsyncClaim], Awaitable[int]]:
                async def body(claim: AsyncClaim) -> int:
                    if key in active:
                        overlaps.append(key)
                    active.add(key)
                    runs[key] += 1
                    await asyncio.sleep(0)  # other tasks run while the key is held
                    active.discard(key)
                    return claim.fence

                return body

            async def worker(n: int) -> dict[str, Any]:
                seen: dict[str, Any] = {}
                pending = random.Random(n).sample(keys, len(keys))
                while pending:
                    key = pending.pop(0)
                    try:
                        seen[key] = await guard.run(key, body_for(key))
                    except KeyInProgress:
                        pending.append(key)
                        await asyncio.sleep(0)
                return seen

            return await asyncio.wait_for(asyncio.gather(*(worker(n) for n in range(16))), 120)

    seen = asyncio.run(run())
    assert overlaps == []
    assert runs == Counter(dict.fromkeys(keys, 1))
    assert all(s == dict.fromkeys(keys, 1) for s in seen)


def test_caller_client_is_used_and_left_open(guard_target: Target) -> None:
    if guard_target.cluster:
        make: Any = redis.asyncio.cluster.RedisCluster.from_url
    else:
        make = redis.asyncio.Redis.from_url

    async def run() -> None:
        client = make(guard_target.url)
        try:
            guard = AsyncRedisGuard(client, prefix=new_prefix())
            async with guard, guard.claim("mine") as claim:
                claim.result = 1
            assert await client.ping()
            with pytest.raises(ConfigurationError, match="RedisGuard"):
                RedisGuard(client)
        finally:
            await client.aclose()

    asyncio.run(run())


async def _claim_when_free(guard: AsyncRedisGuard, key: str, timeout: float) -> AsyncClaim:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        claim = guard.claim(key)
        try:
            await claim.__aenter__()
            return claim
        except KeyInProgress:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.01)


def test_an_async_owner_whose_lease_was_taken_over_cannot_renew_it(guard_target: Target) -> None:
    async def run() -> None:
        async with guard_target.async_guard(lease=0.3) as guard:
            stale = guard.claim("renewed")
            await stale.__aenter__()  # an owner that stalls past its lease
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while True:  # the first claim after the stale owner's lease ran out
                taker = guard.claim("renewed")
                try:
                    await taker.__aenter__()
                    break
                except KeyInProgress:
                    assert loop.time() < deadline, "the key was not taken over"
                    await asyncio.sleep(0.01)
            client: Any = (
                redis.asyncio.RedisCluster.from_url(guard_target.url)
                if guard_target.cluster
                else redis.asyncio.Redis.from_url(guard_target.url)
            )
            try:
                record = await client.hgetall(taker.redis_key)
                # The renewal script checks the owner token: the stale owner's heartbeat is
                # told the lease is lost, and the new owner's deadline stays where it was.
                assert await stale._renew() is False
                assert await client.hgetall(taker.redis_key) == record
            finally:
                await client.aclose()
            taker.result = "taker"
            await taker.__aexit__(None, None, None)
            with pytest.raises(LeaseLost):
                await stale.__aexit__(None, None, None)
            async with guard.claim("renewed") as claim:
                assert claim.replayed and claim.result == "taker"

    asyncio.run(run())
