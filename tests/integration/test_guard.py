"""The Redis guard's contract on a real redis-server and a real three-master Redis Cluster."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, deque
from typing import Any

import pytest

from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    LeaseLost,
    PermanentError,
    PreviouslyFailed,
    ReplayedWriteError,
    SerializationError,
)
from outbox.guard import Claim, RedisGuard
from tests.fixtures.common import wait_for
from tests.fixtures.guard import Target
from tests.fixtures.redis_cluster import LocalRedisCluster


def test_clean_exit_stores_the_result_and_a_duplicate_replays_it(guard_target: Target) -> None:
    with guard_target.guard() as guard:
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
    guard_target: Target,
) -> None:
    with guard_target.guard() as guard:
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
    guard_target: Target,
) -> None:
    with guard_target.guard() as guard:
        with pytest.raises(PermanentError, match="card declined"), guard.claim("pay-1"):
            raise PermanentError("card declined")
        for _ in range(2):
            with (
                pytest.raises(PreviouslyFailed, match="card declined") as info,
                guard.claim("pay-1"),
            ):
                raise AssertionError("ran after a permanent failure")
            assert info.value.error == "PermanentError: card declined"


def test_other_exception_releases_the_key_for_an_immediate_retry(guard_target: Target) -> None:
    with guard_target.guard(lease=60) as guard:
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


def test_a_live_claim_gets_key_in_progress_at_once(guard_target: Target) -> None:
    with guard_target.guard(lease=60) as guard, guard.claim("busy") as owner:
        for _ in range(5):
            started = time.monotonic()
            with pytest.raises(KeyInProgress), guard.claim("busy"):
                raise AssertionError("two owners")
            assert time.monotonic() - started < 10  # not after the lease's 60 s
        owner.result = "mine"
    with guard_target.guard(prefix=guard.settings.prefix) as again, again.claim("busy") as claim:
        assert claim.replayed and claim.result == "mine"


def test_fingerprint_mismatch_is_key_reuse(guard_target: Target) -> None:
    with guard_target.guard() as guard:
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
    guard_target: Target,
) -> None:
    with guard_target.guard(lease=0.3) as guard:
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


def test_takeover_only_after_the_lease(guard_target: Target) -> None:
    lease = 1.0
    with guard_target.guard(lease=lease) as guard:
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
    guard_target: Target,
) -> None:
    with guard_target.guard(lease=0.2) as guard:
        with guard.claim("late") as claim:
            # The lease runs out (no other owner came): its token still matches.
            time.sleep(0.4)
            claim.result = "late but alone"
        with guard.claim("late") as again:
            assert again.replayed and again.result == "late but alone"


def test_renewal_keeps_the_key_while_a_long_body_runs(guard_target: Target) -> None:
    lease = 2.0  # renewed every 2/3 s: a loaded machine's scheduling cannot outlast it
    with guard_target.guard(lease=lease, renew=True) as guard:
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


def test_without_renewal_a_long_body_loses_its_key(guard_target: Target) -> None:
    with guard_target.guard(lease=0.5) as guard:
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


def test_keys_spread_over_the_cluster_masters(redis_cluster: LocalRedisCluster) -> None:
    target = Target("cluster", redis_cluster.url, cluster=True)
    with target.guard() as guard:
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


def test_sixteen_threads_on_many_keys_run_each_body_once(guard_target: Target) -> None:
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

    with guard_target.guard(lease=60) as guard:

        def body(claim: Claim, key: str) -> dict[str, Any]:
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
                        seen[n][key] = guard.run(key, lambda claim, key=key: body(claim, key))
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
    print(f"{guard_target.name}: KeyInProgress answers {sum(busy.values())}")


def _claim_when_free(guard: RedisGuard, key: str, timeout: float) -> Claim:
    """Claim ``key`` as soon as its holder's lease runs out (the caller exits the claim)."""
    taken: list[Claim] = []

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


def test_an_owner_whose_lease_was_taken_over_cannot_renew_it(guard_target: Target) -> None:
    with guard_target.guard(lease=0.3) as guard:
        stale = guard.claim("renewed")
        stale.__enter__()  # an owner that stalls past its lease
        taker = _claim_when_free(guard, "renewed", timeout=5)
        client = guard_target.client()
        try:
            record = client.hgetall(taker.redis_key)
            # Its heartbeat comes back: the renewal script checks the owner token, so it is
            # told the lease is lost and the new owner's deadline stays where it was.
            assert stale._renew() is False
            assert client.hgetall(taker.redis_key) == record
        finally:
            client.close()
        taker.result = "taker"
        taker.__exit__(None, None, None)
        with pytest.raises(LeaseLost):
            stale.__exit__(None, None, None)
        with guard.claim("renewed") as claim:
            assert claim.replayed and claim.result == "taker"
