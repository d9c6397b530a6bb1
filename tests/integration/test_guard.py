"""One contract, two flavours: ``RedisGuard`` and ``AsyncRedisGuard`` keep the same promises on a
real redis-server and a real three-master Redis Cluster.

Each contract test drives a *door* (:class:`SyncDoor`, :class:`AsyncDoor`): the same test code
claims keys through one flavour. The asyncio door runs its guard on an event loop of its own
thread, so the test stays sync and a body can block while the guard's heartbeat runs. What only
one flavour has (a cancelled task, many tasks on one loop, coroutine handlers, the caller's
client) is tested below the contract, in that flavour.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
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
    ReplayedWriteError,
    SerializationError,
)
from outbox.guard import AsyncClaim, AsyncRedisGuard, Claim, RedisGuard
from tests.fixtures.common import wait_for
from tests.fixtures.guard import Target, new_prefix
from tests.fixtures.redis_cluster import LocalRedisCluster

FLAVOURS = ["sync", "asyncio"]


class Held:
    """One flavour's claim, entered and exited from sync code; its attributes are the claim's."""

    def __init__(self, door: Door, claim: Claim | AsyncClaim) -> None:
        object.__setattr__(self, "_door", door)
        object.__setattr__(self, "claim", claim)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.claim, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.claim, name, value)

    def __enter__(self) -> Held:
        self._door.call(
            self.claim.__enter__ if isinstance(self.claim, Claim) else self.claim.__aenter__
        )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        claim = self.claim
        if isinstance(claim, Claim):
            done: bool | None = self._door.call(lambda: claim.__exit__(kind, exc, tb))
        else:
            done = self._door.call(lambda: claim.__aexit__(kind, exc, tb))
        return done

    def renew(self) -> bool:
        """The heartbeat's renewal, once."""
        result: bool = self._door.call(self.claim._renew)
        return result


class Door:
    """A guard of one flavour, driven from sync code (threads may share it)."""

    name: str
    guard: RedisGuard | AsyncRedisGuard

    def call(self, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def claim(self, key: str, **kwargs: Any) -> Held:
        return Held(self, self.guard.claim(key, **kwargs))

    def run(self, key: str, body: Callable[[Any], Any], **kwargs: Any) -> Any:
        """``guard.run(key, body)``; ``body`` is a sync function of the claim in both flavours."""
        raise NotImplementedError

    @property
    def prefix(self) -> str:
        return self.guard.settings.prefix


class SyncDoor(Door):
    name = "sync"

    def __init__(self, target: Target, settings: dict[str, Any]) -> None:
        self.guard = target.guard(**settings)

    def call(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def run(self, key: str, body: Callable[[Any], Any], **kwargs: Any) -> Any:
        assert isinstance(self.guard, RedisGuard)
        return self.guard.run(key, body, **kwargs)

    def close(self) -> None:
        assert isinstance(self.guard, RedisGuard)
        self.guard.close()


class AsyncDoor(Door):
    """Runs the asyncio flavour on an event loop of its own thread (the tests stay sync)."""

    name = "asyncio"

    def __init__(self, target: Target, settings: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def make() -> AsyncRedisGuard:
            return await target.async_guard(**settings).__aenter__()

        self.guard = self.call(make)

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the loop's thread, awaited there when it returns an awaitable."""

        async def on_loop() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(120)

    def run(self, key: str, body: Callable[[Any], Any], **kwargs: Any) -> Any:
        assert isinstance(self.guard, AsyncRedisGuard)
        guard = self.guard

        async def async_body(claim: AsyncClaim) -> Any:
            return body(claim)

        return self.call(lambda: guard.run(key, async_body, **kwargs))

    def close(self) -> None:
        assert isinstance(self.guard, AsyncRedisGuard)
        try:
            self.call(self.guard.aclose)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(params=FLAVOURS)
def flavour(request: pytest.FixtureRequest) -> str:
    """The guard's flavour a contract test runs on."""
    name: str = request.param
    return name


@contextlib.contextmanager
def opened(flavour: str, target: Target, **settings: Any) -> Iterator[Door]:
    """A door on a new guard of ``flavour`` (a key prefix of its own unless one is given)."""
    door = SyncDoor(target, settings) if flavour == "sync" else AsyncDoor(target, settings)
    try:
        yield door
    finally:
        door.close()


# -- the contract, in both flavours --------------------------------------------------------------


def test_clean_exit_stores_the_result_and_a_duplicate_replays_it(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target) as guard:
        runs = 0
        for _ in range(3):
            with guard.claim("order-1", scope="shop") as claim:
                if claim.replayed:
                    assert claim.result == {"paid": [1, 2]}  # its JSON form: tuple -> list
                    continue
                runs += 1
                claim.result = {"paid": (1, 2)}
        assert runs == 1
        # Scopes are separate key spaces.
        with guard.claim("order-1", scope="other") as claim:
            assert not claim.replayed


def test_result_that_is_not_json_is_refused_at_once_and_frees_the_key(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target) as guard:
        with pytest.raises(SerializationError), guard.claim("k") as claim:
            claim.result = {"when": object()}
            raise AssertionError("the assignment did not raise")
        with guard.claim("k") as claim:  # released: the retry runs
            assert not claim.replayed
            claim.result = None
        with guard.claim("k") as claim:
            assert claim.replayed and claim.result is None
            with pytest.raises(ReplayedWriteError):
                claim.result = 1


def test_permanent_error_is_stored_and_replayed_as_previously_failed(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target) as guard:
        with pytest.raises(PermanentError, match="card declined"), guard.claim("pay-1"):
            raise PermanentError("card declined")
        for _ in range(2):
            with (
                pytest.raises(PreviouslyFailed, match="card declined") as info,
                guard.claim("pay-1"),
            ):
                raise AssertionError("ran after a permanent failure")
            assert info.value.error == "PermanentError: card declined"


def test_other_exception_releases_the_key_for_an_immediate_retry(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target, lease=60) as guard:
        fences = []
        for attempt in range(3):
            with pytest.raises(TimeoutError), guard.claim("mail-1") as claim:
                fences.append(claim.fence)
                raise TimeoutError(f"smtp timeout {attempt}")
        started = time.monotonic()
        with guard.claim("mail-1") as claim:
            assert not claim.replayed
            fences.append(claim.fence)
        assert time.monotonic() - started < 10  # no lease (60 s) waited out
        assert fences == [1, 2, 3, 4]


def test_a_live_claim_gets_key_in_progress_at_once(guard_target: Target, flavour: str) -> None:
    with opened(flavour, guard_target, lease=60) as guard, guard.claim("busy") as owner:
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(KeyInProgress), guard.claim("busy"):
                raise AssertionError("two owners")
            assert time.monotonic() - started < 10  # not after the lease's 60 s
        owner.result = "mine"
    with opened(flavour, guard_target, prefix=guard.prefix) as again, again.claim("busy") as claim:
        assert claim.replayed and claim.result == "mine"


def test_fingerprint_mismatch_is_key_reuse(guard_target: Target, flavour: str) -> None:
    with opened(flavour, guard_target) as guard:
        with guard.claim("req", fingerprint="sha-a") as claim:
            claim.result = 1
        with guard.claim("req", fingerprint="sha-a") as claim:
            assert claim.replayed
        with guard.claim("req") as claim:  # no fingerprint given: nothing to compare
            assert claim.replayed
        with pytest.raises(KeyReuseError), guard.claim("req", fingerprint="sha-b"):
            pass
        with pytest.raises(PermanentError), guard.claim("bad", fingerprint="x"):
            raise PermanentError("no")
        with pytest.raises(KeyReuseError), guard.claim("bad", fingerprint="y"):
            pass


def test_tokens_are_unique_and_fences_grow_across_releases_and_takeovers(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target, lease=0.3) as guard:
        tokens, fences = set(), []
        for _ in range(3):  # releases
            with pytest.raises(ValueError), guard.claim("f") as claim:
                tokens.add(claim.token)
                fences.append(claim.fence)
                raise ValueError
        stale = guard.claim("f")
        stale.__enter__()  # an owner that never comes back
        tokens.add(stale.token)
        fences.append(stale.fence)
        taker = _claim_when_free(guard, "f", timeout=5)
        tokens.add(taker.token)
        fences.append(taker.fence)
        taker.__exit__(None, None, None)
        assert len(tokens) == 5
        assert fences == sorted(set(fences)) and fences[0] == 1
        with pytest.raises(LeaseLost) as lost:
            stale.__exit__(None, None, None)
        assert (lost.value.fence, lost.value.current_fence) == (stale.fence, taker.fence)


def test_takeover_only_after_the_lease(guard_target: Target, flavour: str) -> None:
    lease = 1.0
    with opened(flavour, guard_target, lease=lease) as guard:
        before = time.monotonic()
        abandoned = guard.claim("slow")
        abandoned.__enter__()
        taker = _claim_when_free(guard, "slow", timeout=lease + 5)
        waited = time.monotonic() - before
        assert waited >= lease - 0.02, f"taken over after {waited:.3f}s, lease {lease}s"
        assert taker.fence == abandoned.fence + 1
        taker.result = "taker"
        taker.__exit__(None, None, None)
        with pytest.raises(LeaseLost):
            abandoned.__exit__(None, None, None)
        with guard.claim("slow") as claim:
            assert claim.replayed and claim.result == "taker"


def test_an_owner_past_its_lease_still_completes_when_nobody_took_over(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target, lease=0.2) as guard:
        with guard.claim("late") as claim:
            # The lease runs out (no other owner came): its token still matches.
            time.sleep(0.4)
            claim.result = "late but alone"
        with guard.claim("late") as again:
            assert again.replayed and again.result == "late but alone"


def test_renewal_keeps_the_key_while_a_long_body_runs(guard_target: Target, flavour: str) -> None:
    lease = 2.0  # renewed every 2/3 s: a loaded machine's scheduling cannot outlast it
    with opened(flavour, guard_target, lease=lease, renew=True) as guard:
        entered, release = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def owner() -> None:
            try:
                with guard.claim("long") as claim:
                    entered.set()
                    assert release.wait(30)
                    claim.result = "finished"
                outcome["fence"] = claim.fence
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=owner)
        thread.start()
        assert entered.wait(10)
        started = time.monotonic()
        refused = 0
        while time.monotonic() - started < 2.5 * lease:  # well past the lease
            with pytest.raises(KeyInProgress), guard.claim("long"):
                pass
            refused += 1
            time.sleep(0.05)
        release.set()
        thread.join(30)
        assert outcome == {"fence": 1}, outcome
        assert refused > 10
        with guard.claim("long") as claim:
            assert claim.replayed and claim.result == "finished"


def test_without_renewal_a_long_body_loses_its_key(guard_target: Target, flavour: str) -> None:
    with opened(flavour, guard_target, lease=0.5) as guard:
        entered, release = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def owner() -> None:
            try:
                with guard.claim("long") as claim:
                    entered.set()
                    assert release.wait(30)
                    claim.result = "too late"
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=owner)
        thread.start()
        assert entered.wait(10)
        taker = _claim_when_free(guard, "long", timeout=10)
        taker.result = "taker"
        taker.__exit__(None, None, None)
        release.set()
        thread.join(30)
        assert isinstance(outcome.get("error"), LeaseLost), outcome
        with guard.claim("long") as claim:
            assert claim.result == "taker"


def test_keys_spread_over_the_cluster_masters(
    redis_cluster: LocalRedisCluster, flavour: str
) -> None:
    target = Target("cluster", redis_cluster.url, cluster=True)
    with opened(flavour, target) as guard:
        for i in range(30):
            with guard.claim(f"spread-{i}") as claim:
                claim.result = i
        client = target.client()
        try:
            masters = set()
            for i in range(30):
                redis_key = guard.claim(f"spread-{i}").redis_key
                node = client.get_node_from_key(redis_key)  # type: ignore[union-attr]
                masters.add(node.port)
                assert client.exists(redis_key) == 1
        finally:
            client.close()
        assert len(masters) == 3


def test_sixteen_threads_on_many_keys_run_each_body_once(
    guard_target: Target, flavour: str
) -> None:
    keys = [f"race-{i}" for i in range(150)]
    workers = 16
    runs: Counter[str] = Counter()
    active: set[str] = set()
    overlaps: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(workers)
    seen: list[dict[str, Any]] = [{} for _ in range(workers)]
    errors: list[BaseException] = []
    busy = Counter[int]()

    with opened(flavour, guard_target, lease=60) as guard:

        def body(claim: Any, key: str) -> dict[str, Any]:
            with lock:
                if key in active:
                    overlaps.append(key)
                active.add(key)
                runs[key] += 1
            time.sleep(0)  # let other threads in while the key is held
            with lock:
                active.discard(key)
            return {"key": key, "fence": claim.fence, "token": claim.token}

        def worker(n: int) -> None:
            try:
                pending = deque(random.Random(n).sample(keys, len(keys)))
                barrier.wait(30)
                while pending:
                    key = pending.popleft()
                    try:
                        seen[n][key] = guard.run(key, functools.partial(body, key=key))
                    except KeyInProgress:
                        busy[n] += 1
                        pending.append(key)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert overlaps == []
    assert runs == Counter(dict.fromkeys(keys, 1))
    for key in keys:
        answers = {tuple(sorted(s[key].items())) for s in seen}
        assert len(answers) == 1, f"{key}: different results {answers}"
        assert seen[0][key]["fence"] == 1
    print(f"{guard_target.name}, {flavour}: KeyInProgress answers {sum(busy.values())}")


def _claim_when_free(guard: Door, key: str, timeout: float) -> Held:
    """Claim ``key`` as soon as its holder's lease runs out (the caller exits the claim)."""
    taken: list[Held] = []

    def attempt() -> bool:
        claim = guard.claim(key)
        try:
            claim.__enter__()
        except KeyInProgress:
            return False
        taken.append(claim)
        return True

    wait_for(attempt, timeout, f"{key!r} was not taken over", interval=0.01)
    return taken[0]


def test_an_owner_whose_lease_was_taken_over_cannot_renew_it(
    guard_target: Target, flavour: str
) -> None:
    with opened(flavour, guard_target, lease=0.3) as guard:
        stale = guard.claim("renewed")
        stale.__enter__()  # an owner that stalls past its lease
        taker = _claim_when_free(guard, "renewed", timeout=5)
        client = guard_target.client()
        try:
            record = client.hgetall(taker.redis_key)
            # Its heartbeat comes back: the renewal script checks the owner token, so it is
            # told the lease is lost and the new owner's deadline stays where it was.
            assert stale.renew() is False
            assert client.hgetall(taker.redis_key) == record
        finally:
            client.close()
        taker.result = "taker"
        taker.__exit__(None, None, None)
        with pytest.raises(LeaseLost):
            stale.__exit__(None, None, None)
        with guard.claim("renewed") as claim:
            assert claim.replayed and claim.result == "taker"


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


def _outcomes(guard: Door, key: str, steps: list[str]) -> list[Any]:
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


def _body(claim: Held, step: str) -> None:
    if step.startswith("ok:"):
        claim.result = {"value": int(step[3:])}
    elif step == "permanent":
        raise PermanentError("refused")
    elif step == "transient":
        raise RuntimeError("try again")
    elif step == "nojson":
        claim.result = {1j}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_scripted_attempts_give_the_same_outcomes(
    guard_target: Target, flavour: str, script: str
) -> None:
    steps, expected = SCRIPTS[script]
    with opened(flavour, guard_target) as guard:
        assert _outcomes(guard, "k", steps) == expected


def test_outcomes_and_errors(guard_target: Target, flavour: str) -> None:
    with opened(flavour, guard_target, lease=0.3) as guard:
        with guard.claim("x", fingerprint="f1") as claim:
            claim.result = [1, "two"]
            with pytest.raises(SerializationError):
                claim.result = float("nan")
        with guard.claim("x") as claim:
            assert claim.replayed and claim.result == [1, "two"]
        with pytest.raises(KeyReuseError), guard.claim("x", fingerprint="f2"):
            pass
        with pytest.raises(PermanentError), guard.claim("y"):
            raise PermanentError("bounced")
        with pytest.raises(PreviouslyFailed, match="bounced"), guard.claim("y"):
            pass
        # Takeover after the lease; the stale owner's completion changes nothing.
        stale = guard.claim("z")
        stale.__enter__()
        with pytest.raises(KeyInProgress), guard.claim("z"):
            pass
        taker = _claim_when_free(guard, "z", timeout=5)
        assert taker.fence == stale.fence + 1
        taker.result = "taker"
        taker.__exit__(None, None, None)
        with pytest.raises(LeaseLost):
            stale.__exit__(None, None, None)
        with guard.claim("z") as claim:
            assert claim.result == "taker"


# -- across the flavours ----------------------------------------------------------------------


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


# -- the sync flavour only ----------------------------------------------------------------------


def test_decorator_and_run(guard_target: Target) -> None:
    with guard_target.guard() as guard:
        calls: list[tuple[str, int]] = []

        @guard.idempotent(key="request_id", scope="mail")
        def send(claim: Claim, request_id: str, to: int) -> dict[str, int]:
            calls.append((request_id, to))
            return {"fence": claim.fence, "to": to}

        assert send("r-1", 7) == {"fence": 1, "to": 7}
        assert send("r-1", to=8) == {"fence": 1, "to": 7}  # replayed, not called
        assert send(request_id="r-2", to=9) == {"fence": 1, "to": 9}
        assert calls == [("r-1", 7), ("r-2", 9)]

        by_callable = guard.idempotent(key=lambda order: f"o-{order['id']}")(
            lambda claim, order: order["id"] * 2
        )
        assert by_callable({"id": 21}) == 42
        assert guard.run("o-21", lambda claim: -1) == 42  # the decorator's scope is "default"

        with pytest.raises(ConfigurationError, match="no parameter 'missing'"):
            guard.idempotent(key="missing")(send)

        async def coroutine(claim: Claim, key: str) -> None: ...

        with pytest.raises(ConfigurationError, match="AsyncRedisGuard"):
            guard.idempotent(key="key")(coroutine)


# -- the asyncio flavour only -------------------------------------------------------------------


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


async def _async_claim_when_free(guard: AsyncRedisGuard, key: str, timeout: float) -> AsyncClaim:
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
