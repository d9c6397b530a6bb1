"""The consumer runner's decisions, without services: what becomes of a message after an attempt,
which failures are permanent, and which offsets may be committed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, strategies as st

from outbox._core.deadletter import Reason
from outbox._core.disposition import (
    DATABASE_DOWN,
    DEAD_LETTER_DOWN,
    GUARD_DOWN,
    KEY_BUSY,
    TAKEN_OVER,
    Action,
    AttemptVerdict,
    Disposition,
    Failure,
    Key,
    Schedule,
    classify,
)
from outbox._core.failures import is_permanent
from outbox._core.offsets import Assignment, fair_shares
from outbox.errors import (
    ConfigurationError,
    DeadLetterError,
    GuardUnavailable,
    InvalidKeyError,
    InvalidTopicError,
    KeyInProgress,
    KeyReuseError,
    LeaseLost,
    OutboxError,
    PayloadTooLargeError,
    PermanentError,
    PreviouslyFailed,
    SerializationError,
    ValidationError,
)


def verdict(error: BaseException | None, **facts: Any) -> Disposition:
    facts.setdefault("attempts", 0)
    facts.setdefault("max_attempts", 5)
    return classify(error, **facts)


def dead_letter_down() -> DeadLetterError:
    return DeadLetterError("dead letter to 'orders.dlq' not confirmed", retriable=True)


ERRORS: list[BaseException] = [
    RuntimeError("boom"),
    ValueError("bad"),
    PermanentError("no"),
    KeyInProgress("billing", "k"),
    PreviouslyFailed("billing", "k", "ValueError: no"),
    KeyReuseError("billing", "k"),
    InvalidKeyError("too long"),
    SerializationError("not JSON"),
    dead_letter_down(),
    GuardUnavailable("Redis failed the guard", scope="billing", key="k"),
    LeaseLost("billing", "k", 1, 2),
]
errors = st.sampled_from(ERRORS)
maybe_errors = st.one_of(st.none(), errors)
keys = st.sampled_from(list(Key))
attempts = st.integers(min_value=0, max_value=20)
limits = st.integers(min_value=1, max_value=10)


# -- acknowledged ---------------------------------------------------------------------------------


def test_a_committed_unit_of_work_is_processed_and_a_duplicate_replayed() -> None:
    assert verdict(None).outcome is AttemptVerdict.PROCESSED
    assert verdict(None, replayed=True).outcome is AttemptVerdict.REPLAYED
    for outcome in (verdict(None), verdict(None, replayed=True)):
        assert outcome.action is Action.ACKNOWLEDGE
        assert (outcome.failure, outcome.counts, outcome.reason) == (None, False, None)


def test_a_key_that_failed_before_is_acknowledged_without_a_second_dead_letter() -> None:
    outcome = verdict(PreviouslyFailed("billing", "k", "ValueError: no"), attempts=4)
    assert (outcome.action, outcome.outcome) == (
        Action.ACKNOWLEDGE,
        AttemptVerdict.PREVIOUSLY_FAILED,
    )


@given(error=maybe_errors, key=keys, tried=attempts, db_down=st.booleans())
def test_a_dead_letter_confirmed_inside_the_unit_of_work_acknowledges_the_message(
    error: BaseException | None, key: Key, tried: int, db_down: bool
) -> None:
    # Whatever ended the unit of work afterwards (the permanent error itself, or a failure to
    # record it), the message is in the dead-letter topic: it must not be sent twice.
    if not possible(error, key):
        error = None if key is Key.MISSING else RuntimeError("unreadable")
    outcome = verdict(
        error, key=key, attempts=tried, dead_lettered=True, database_unavailable=db_down
    )
    assert (outcome.action, outcome.outcome) == (Action.ACKNOWLEDGE, AttemptVerdict.DEAD_LETTERED)
    assert outcome.reason is Reason.PERMANENT_ERROR
    assert outcome.failure is None and not outcome.counts


# -- dead-lettered at once ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "key", "reason"),
    [
        (None, Key.MISSING, Reason.MISSING_KEY),
        (InvalidKeyError("header 'k' is not UTF-8"), Key.UNREADABLE, Reason.INVALID_INPUT),
        (KeyReuseError("billing", "k"), Key.FOUND, Reason.KEY_REUSE),
        (InvalidKeyError("key too long"), Key.FOUND, Reason.INVALID_INPUT),
        (InvalidTopicError("bad topic"), Key.FOUND, Reason.INVALID_INPUT),
        (PayloadTooLargeError("too large"), Key.FOUND, Reason.INVALID_INPUT),
        (SerializationError("result not JSON"), Key.FOUND, Reason.INVALID_INPUT),
        (ValidationError("refused"), Key.FOUND, Reason.INVALID_INPUT),
    ],
)
def test_what_retrying_cannot_fix_is_dead_lettered_at_once(
    error: BaseException | None, key: Key, reason: Reason
) -> None:
    outcome = verdict(error, key=key)
    assert (outcome.action, outcome.outcome, outcome.reason) == (
        Action.DEAD_LETTER,
        AttemptVerdict.DEAD_LETTERED,
        reason,
    )
    assert not outcome.counts and outcome.failure is None and not outcome.exhausted


# -- retried --------------------------------------------------------------------------------------


@given(tried=attempts, limit=limits, db_down=st.booleans())
def test_a_busy_key_waits_briefly_and_never_counts(tried: int, limit: int, db_down: bool) -> None:
    outcome = verdict(
        KeyInProgress("billing", "k"),
        attempts=tried,
        max_attempts=limit,
        database_unavailable=db_down,
    )
    assert outcome == KEY_BUSY
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.IN_PROGRESS,
        Failure.KEY_IN_PROGRESS,
        False,
    )


@given(tried=attempts, limit=limits)
def test_a_transaction_conflict_is_retried_without_counting(tried: int, limit: int) -> None:
    outcome = verdict(
        RuntimeError("could not serialize access due to concurrent update"),
        attempts=tried,
        max_attempts=limit,
        conflict=True,
    )
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.IN_PROGRESS,
        Failure.CONFLICT,
        False,
    )


@given(tried=attempts, limit=limits)
def test_a_database_outage_is_retried_forever_without_counting(tried: int, limit: int) -> None:
    outcome = verdict(
        RuntimeError("server closed the connection"),
        attempts=tried,
        max_attempts=limit,
        database_unavailable=True,
    )
    assert outcome == DATABASE_DOWN
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.RETRY,
        Failure.DATABASE_UNAVAILABLE,
        False,
    )


@given(tried=attempts, limit=limits, db_down=st.booleans())
def test_a_guard_that_cannot_decide_is_retried_forever_without_counting(
    tried: int, limit: int, db_down: bool
) -> None:
    # Redis down under on_redis_error="closed": like a database outage, not the message's fault.
    error = GuardUnavailable("Redis failed the guard", scope="billing", key="k")
    outcome = verdict(error, attempts=tried, max_attempts=limit, database_unavailable=db_down)
    assert outcome == GUARD_DOWN
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.RETRY,
        Failure.GUARD_UNAVAILABLE,
        False,
    )


@given(tried=attempts, limit=limits)
def test_a_lease_lost_to_another_owner_waits_like_a_busy_key(tried: int, limit: int) -> None:
    # The new owner's outcome stands; the retry meets it (busy, then replayed), uncounted.
    outcome = verdict(LeaseLost("billing", "k", 1, 2), attempts=tried, max_attempts=limit)
    assert outcome == TAKEN_OVER
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.IN_PROGRESS,
        Failure.LEASE_LOST,
        False,
    )


def test_a_guard_failure_after_a_confirmed_dead_letter_is_acknowledged() -> None:
    # The permanent failure was dead-lettered while the claim held the key; Redis then failed
    # to record it: the message is in the dead-letter topic, so it is finished.
    error = GuardUnavailable("the outcome was not recorded", scope="billing", key="k")
    outcome = verdict(error, dead_lettered=True)
    assert (outcome.action, outcome.outcome) == (Action.ACKNOWLEDGE, AttemptVerdict.DEAD_LETTERED)


@given(key=st.sampled_from([Key.FOUND, Key.MISSING]), tried=attempts, limit=limits)
def test_a_dead_letter_the_broker_did_not_confirm_is_retried_without_counting(
    key: Key, tried: int, limit: int
) -> None:
    # Never acknowledge a message whose dead letter is not durable.
    outcome = verdict(dead_letter_down(), key=key, attempts=tried, max_attempts=limit)
    assert outcome == DEAD_LETTER_DOWN
    assert (outcome.action, outcome.schedule, outcome.failure, outcome.counts) == (
        Action.RETRY,
        Schedule.RETRY,
        Failure.DEAD_LETTER_UNAVAILABLE,
        False,
    )


@given(limit=limits)
def test_other_errors_count_and_are_dead_lettered_after_max_attempts(limit: int) -> None:
    tried = 0
    while True:
        outcome = verdict(RuntimeError("boom"), attempts=tried, max_attempts=limit)
        assert outcome.counts and outcome.failure is Failure.ERROR
        tried += 1
        if outcome.action is Action.DEAD_LETTER:
            break
        assert (outcome.outcome, outcome.schedule) == (AttemptVerdict.RETRY, Schedule.RETRY)
    assert tried == limit
    assert outcome.reason is Reason.RETRIES_EXHAUSTED and outcome.exhausted


@given(error=errors, tried=attempts, limit=limits, db_down=st.booleans())
def test_reading_the_key_fails_as_invalid_input_or_as_a_counted_error(
    error: BaseException, tried: int, limit: int, db_down: bool
) -> None:
    # A key function's own failure is the message's: no outage or busy-key leniency.
    outcome = verdict(
        error, key=Key.UNREADABLE, attempts=tried, max_attempts=limit, database_unavailable=db_down
    )
    if isinstance(error, ValidationError):
        assert (outcome.action, outcome.reason) == (Action.DEAD_LETTER, Reason.INVALID_INPUT)
        assert not outcome.counts
    else:
        assert outcome.counts and outcome.failure is Failure.ERROR
        exhausted = tried + 1 >= limit
        assert outcome.action is (Action.DEAD_LETTER if exhausted else Action.RETRY)


def test_facts_that_cannot_happen_together_are_refused() -> None:
    with pytest.raises(ValueError, match="needs the error"):
        verdict(None, key=Key.UNREADABLE)
    with pytest.raises(ValueError, match="nothing ran"):
        verdict(KeyInProgress("billing", "k"), key=Key.MISSING)


def possible(error: BaseException | None, key: Key) -> bool:
    if key is Key.UNREADABLE:
        return error is not None
    if key is Key.MISSING:
        return error is None or isinstance(error, DeadLetterError)
    return True


# -- what holds for every verdict -----------------------------------------------------------------


@given(
    error=maybe_errors,
    key=keys,
    tried=attempts,
    limit=limits,
    replayed=st.booleans(),
    dead_lettered=st.booleans(),
    db_down=st.booleans(),
)
def test_every_verdict_is_consistent(
    error: BaseException | None,
    key: Key,
    tried: int,
    limit: int,
    replayed: bool,
    dead_lettered: bool,
    db_down: bool,
) -> None:
    if not possible(error, key):
        return
    outcome = classify(
        error,
        attempts=tried,
        max_attempts=limit,
        key=key,
        replayed=replayed,
        dead_lettered=dead_lettered,
        database_unavailable=db_down,
    )
    # A retry has a backoff and finishes nothing; nothing else has a backoff.
    assert (outcome.action is Action.RETRY) == (outcome.outcome is AttemptVerdict.RETRY)
    assert (outcome.action is Action.RETRY) == (outcome.schedule is not None)
    # Only a dead letter has a reason (a confirmed one is acknowledged with it).
    assert (outcome.reason is not None) == (outcome.outcome is AttemptVerdict.DEAD_LETTERED)
    # Only the message's own failures count, and they always do.
    assert outcome.counts == (outcome.failure is Failure.ERROR)
    # Running out of attempts takes counted failures: an outage, a busy key or a missing dead
    # letter never dead-letters a message.
    if outcome.exhausted:
        assert outcome.counts and tried + 1 >= limit
    if (
        isinstance(error, KeyInProgress | DeadLetterError | GuardUnavailable | LeaseLost)
        and key is not Key.UNREADABLE
    ):
        assert outcome.action is not Action.DEAD_LETTER
    # Nothing is acknowledged that failed without a confirmed dead letter.
    if (
        outcome.action is Action.ACKNOWLEDGE
        and outcome.outcome is not AttemptVerdict.PREVIOUSLY_FAILED
    ):
        assert error is None or dead_lettered


# -- permanent failures ---------------------------------------------------------------------------


class Declined(Exception):
    pass


class Stop(BaseException):
    pass


def test_permanent_errors_are_permanent_error_or_a_configured_class() -> None:
    assert is_permanent(PermanentError("no"))
    assert is_permanent(PermanentError("no"), (Declined,))
    assert not is_permanent(Declined("no"))
    assert is_permanent(Declined("no"), (Declined,))
    assert is_permanent(type("Sub", (Declined,), {})("no"), (Declined,))  # subclasses too
    assert not is_permanent(RuntimeError("boom"), (Declined,))
    # The toolkit's own refusals never, though ValidationError and ConfigurationError are
    # ValueErrors: only PermanentError among OutboxErrors records a failure.
    assert not is_permanent(SerializationError("x"), (ValueError,))
    assert not is_permanent(InvalidTopicError("x"), (Exception,))
    assert not is_permanent(ConfigurationError("x"), (ValueError,))
    assert not is_permanent(KeyInProgress("s", "k"), (OutboxError,))
    assert is_permanent(type("Mine", (PermanentError,), {})("no"), ())
    assert is_permanent(ValueError("the business refuses"), (ValueError,))
    # The runner's internal carriers are BaseExceptions: even `Exception` does not catch them.
    assert not is_permanent(Stop(), (Exception,))
    assert is_permanent(Stop(), (Stop,))


# -- offsets --------------------------------------------------------------------------------------


def test_a_commit_never_passes_an_unfinished_message() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("orders", 0), ("orders", 1)])
    assert assignment.to_commit() == []  # nothing finished yet
    p0 = assignment.get(("orders", 0))
    assert p0 is not None
    p0.backlog.extend(["m10", "m11", "m12"])
    p0.finish(10)
    assert assignment.to_commit() == [("orders", 0, 11)]  # m11 is still in hand
    assert assignment.to_commit(only=[("orders", 1)]) == []
    assignment.confirm(("orders", 0), 11)
    assert assignment.to_commit() == []  # the broker has it already
    p0.finish(11)
    assert assignment.to_commit() == [("orders", 0, 12)]
    assignment.confirm(("orders", 0), 5)  # a late answer to an older commit moves nothing back
    assert p0.committed == 11
    assignment.confirm(("orders", 9), 3)  # not ours (revoked meanwhile): ignored
    assert ("orders", 9) not in assignment


@given(st.lists(st.sampled_from(["finish", "confirm"]), max_size=30))
def test_the_offset_to_commit_is_the_one_after_the_last_finished_message(
    steps: list[str],
) -> None:
    assignment: Assignment[int] = Assignment()
    assignment.assign([("t", 0)])
    state = assignment.get(("t", 0))
    assert state is not None
    state.backlog.extend(range(100, 100 + len(steps)))
    finished: int | None = None
    confirmed: int | None = None
    for step in steps:
        if step == "finish":
            finished = state.backlog[0]
            state.finish(finished)
        elif finished is not None:
            assignment.confirm(("t", 0), finished + 1)
            confirmed = finished + 1
        expected = [] if finished is None or confirmed == finished + 1 else [("t", 0, finished + 1)]
        assert assignment.to_commit() == expected


def test_finishing_a_message_resets_what_was_held_for_it() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0)])
    state = assignment.get(("t", 0))
    assert state is not None
    state.backlog.extend(["a", "b"])
    state.attempts, state.waits, state.retry_at = 3, 2, 99.0
    state.finish(7)
    assert (state.attempts, state.waits, state.retry_at, state.dead_letter) == (0, 0, 0.0, None)
    assert list(state.backlog) == ["b"] and state.next_offset == 8


def test_forgetting_partitions_drops_their_messages_and_what_was_held_for_them() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0), ("t", 1)])
    state = assignment.get(("t", 1))
    assert state is not None
    state.backlog.append("x")
    state.next_offset, state.attempts = 8, 2
    assignment.forget([("t", 1), ("t", 2)])
    assert ("t", 1) not in assignment and ("t", 0) in assignment
    assert assignment.to_commit(only=[("t", 1)]) == []  # the new owner commits it now
    assignment.assign([("t", 1)])  # assigned again: starts afresh
    again = assignment.get(("t", 1))
    assert again is not None and not again.backlog
    assert (again.next_offset, again.attempts) == (None, 0)


def test_the_poll_waits_no_longer_than_the_next_retry() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0), ("t", 1)])
    assert assignment.next_retry(now=100.0, longest=0.5) == 0.5
    idle = assignment.get(("t", 0))
    waiting = assignment.get(("t", 1))
    assert idle is not None and waiting is not None
    idle.retry_at = 100.1  # no message in hand: its retry time does not matter
    waiting.backlog.append("m")
    waiting.retry_at = 100.2
    assert assignment.next_retry(now=100.0, longest=0.5) == pytest.approx(0.2)
    assert assignment.next_retry(now=101.0, longest=0.5) == 0.0  # overdue: do not wait


# -- micro-batches --------------------------------------------------------------------------------


def test_fair_shares_split_a_batch_evenly_and_pass_on_what_a_partition_cannot_use() -> None:
    assert fair_shares([10, 10, 10], 10) == [3, 3, 4]
    assert fair_shares([1, 100, 100], 10) == [1, 4, 5]
    assert fair_shares([1, 3, 2], 5) == [1, 2, 2]
    assert fair_shares([0, 5], 10) == [0, 5]
    assert fair_shares([3, 3], 10) == [3, 3]
    assert fair_shares([2, 5, 2], 1) == [0, 1, 0]  # the longest backlog first
    assert fair_shares([], 5) == []


@given(st.lists(st.integers(0, 50), max_size=8), st.integers(1, 200))
def test_fair_shares_take_as_much_as_there_is_and_never_more(sizes: list[int], limit: int) -> None:
    shares = fair_shares(sizes, limit)
    assert sum(shares) == min(limit, sum(sizes))
    assert all(0 <= share <= size for share, size in zip(shares, sizes, strict=True))
    # Even: a partition gets less than another only when it has no more to give.
    for i, (share, size) in enumerate(zip(shares, sizes, strict=True)):
        if share < size:
            assert all(other <= share + 1 for other in shares[:i] + shares[i + 1 :])


def test_a_batch_takes_from_the_heads_of_the_partitions_that_do_not_wait() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0), ("t", 1), ("t", 2)])
    p0, p1, p2 = (assignment.get(("t", i)) for i in range(3))
    assert p0 is not None and p1 is not None and p2 is not None
    p0.backlog.extend(["a0", "a1", "a2", "a3"])
    p1.backlog.extend(["b0", "b1"])
    p2.backlog.extend(["c0"])
    p2.retry_at = 100.5  # its head waits for a retry
    plan = assignment.take(5, now=100.0)
    assert [(tp, messages) for tp, _, messages in plan] == [
        (("t", 0), ["a0", "a1", "a2"]),
        (("t", 1), ["b0", "b1"]),
    ]
    assert [m for _, _, messages in assignment.take(5, now=101.0) for m in messages] == [
        "a0", "a1", "b0", "b1", "c0",
    ]  # fmt: skip
    assert list(p0.backlog) == ["a0", "a1", "a2", "a3"]  # taking removes nothing


def test_what_attempts_behind_the_head_came_to_is_kept_until_it_is_the_head() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0)])
    state = assignment.get(("t", 0))
    assert state is not None
    state.backlog.extend(["m10", "m11", "m12"])
    assert state.tries(10, head=True) is state  # the head's tries are the partition's own
    behind = state.tries(11, head=False)
    behind.attempts, behind.retry_at = 2, 55.0
    assert state.tries(11, head=False) is behind
    state.finish(10, next_head=11)
    assert (state.attempts, state.retry_at) == (2, 55.0)  # m11 is the head: its tries came along
    assert state.ahead == {}
    state.finish(11, next_head=12)
    assert (state.attempts, state.retry_at, state.done) == (0, 0.0, None)


def test_lag_is_the_high_watermark_minus_the_next_offset_to_commit() -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0), ("t", 1), ("t", 2), ("t", 3)])
    p0, p1, p2 = assignment.get(("t", 0)), assignment.get(("t", 1)), assignment.get(("t", 2))
    assert p0 is not None and p1 is not None and p2 is not None
    p0.backlog.extend(["m5", "m6"])
    p0.finish(5)  # next offset to commit: 6
    assignment.confirm(("t", 1), 40)  # nothing finished here yet, 40 committed before
    p2.next_offset = 12  # a high watermark behind it (stale fetch) is no negative lag
    highs = {("t", 0): 9, ("t", 1): 44, ("t", 2): 10, ("t", 3): 7, ("u", 0): 3}
    offset_of = {"m5": 5, "m6": 6, "m20": 20}.__getitem__
    assert sorted(assignment.lags(highs, offset_of)) == [("t", 0, 3), ("t", 1, 4), ("t", 2, 0)]
    # unknown high watermarks (not fetched yet, or librdkafka's "invalid" -1001) say nothing
    assert assignment.lags({("t", 0): -1001}, offset_of) == []
    # stuck on the first message since the assignment: nothing finished or committed
    p3 = assignment.get(("t", 3))
    assert p3 is not None
    p3.backlog.append("m20")
    assert ("t", 3, 0) in assignment.lags(highs, offset_of)  # a stale high watermark: 0
    assert ("t", 3, 5) in assignment.lags({("t", 3): 25}, offset_of)


@given(
    high=st.integers(min_value=0, max_value=10**12),
    finished=st.integers(min_value=0, max_value=10**12),
)
def test_lag_is_never_negative(high: int, finished: int) -> None:
    assignment: Assignment[str] = Assignment()
    assignment.assign([("t", 0)])
    state = assignment.get(("t", 0))
    assert state is not None
    state.next_offset = finished
    assert assignment.lags({("t", 0): high}, int) == [("t", 0, max(0, high - finished))]
