"""The consumer runner's central decision: what becomes of a message after one attempt.

The runner reads the key, runs the unit of work (or learns that a dead letter could not be
produced), and hands what happened to :func:`classify`. The answer is a :class:`Disposition`:
acknowledge the message (its offset may be committed), try it again after a backoff -- counted
against ``max_attempts`` or not --, or dead-letter it with a reason. The runner carries it out;
nothing here does I/O, so every branch is unit-tested without services.

Two rules hold the guarantees together:

* A failure that is not the message's fault -- the key is busy in another attempt (or, under the
  Redis guard, was taken over by one), PostgreSQL or the guard's Redis is unreachable, the
  dead-letter topic does not confirm -- never counts as an attempt: an outage must not exhaust
  a message's attempts and dead-letter it.
* A message is acknowledged only once it is finished: its unit of work committed or replayed
  (or its guarded outcome was stored in Redis), its key had failed (and was dead-lettered)
  before, or its dead letter was confirmed.

Whether an exception is *permanent* is not decided here but by
:func:`outbox._core.failures.is_permanent`, the rule the unit of work records failures by: the
runner asks it while the key is still held, dead-letters the message first, and tells
:func:`classify` so with ``dead_lettered=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from outbox._core.deadletter import Reason
from outbox.errors import (
    DeadLetterError,
    GuardUnavailable,
    KeyInProgress,
    KeyReuseError,
    LeaseLost,
    PreviouslyFailed,
    SerializerError,
    ValidationError,
)


class AttemptVerdict(StrEnum):
    """What became of one attempt at a message."""

    PROCESSED = "processed"
    """The handler ran and its unit of work committed."""
    REPLAYED = "replayed"
    """A duplicate: the key had completed, the stored result was replayed, the handler skipped."""
    PREVIOUSLY_FAILED = "previously_failed"
    """The key had failed permanently (and was dead-lettered then): acknowledged, not re-sent."""
    DEAD_LETTERED = "dead_lettered"
    """Sent to the dead-letter topic and confirmed."""
    RETRY = "retry"
    """Not finished: the same message is tried again after a backoff (nothing was committed)."""


class Action(StrEnum):
    """What the runner does with the message."""

    ACKNOWLEDGE = "acknowledge"
    """Finished: the offset behind it may be committed."""
    RETRY = "retry"
    """Try the same message again after a backoff; its partition waits meanwhile."""
    DEAD_LETTER = "dead_letter"
    """Produce its dead letter; acknowledge it once the broker confirmed."""


class Key(StrEnum):
    """How reading the message's idempotency key went."""

    FOUND = "found"
    MISSING = "missing"
    """The message carries no key: it cannot be applied at most once."""
    UNREADABLE = "unreadable"
    """Reading the key (or the fingerprint) raised the attempt's error."""


class Schedule(StrEnum):
    """Which backoff a retry waits (``ConsumerConfig`` fields of the same prefix)."""

    RETRY = "retry_backoff"
    """``retry_backoff`` doubling to ``retry_backoff_max``: failures and outages."""
    IN_PROGRESS = "in_progress_backoff"
    """``in_progress_backoff`` doubling to ``in_progress_backoff_max``: a busy key (or one
    another guard owner took over)."""


class Failure(StrEnum):
    """Why an attempt did not finish its message (the ``kind`` label of the failure metric)."""

    ERROR = "error"
    PERMANENT = "permanent"
    KEY_IN_PROGRESS = "key_in_progress"
    CONFLICT = "conflict"
    """PostgreSQL rolled the transaction back for a concurrent one (serialization failure,
    deadlock)."""
    DEAD_LETTER_UNAVAILABLE = "dead_letter_unavailable"
    DATABASE_UNAVAILABLE = "database_unavailable"
    GUARD_UNAVAILABLE = "guard_unavailable"
    """The Redis guard could not decide (or store the outcome) under ``on_redis_error="closed"``."""
    LEASE_LOST = "lease_lost"
    """The handler ran past its guard lease and another owner took the key over."""


@dataclass(frozen=True)
class Disposition:
    """The verdict on one attempt at a message.

    ``outcome`` is what the message ends as once ``action`` is carried out (``DEAD_LETTERED``
    for a dead letter still to produce). ``counts`` says whether the attempt counts against
    ``max_attempts``; a retry that does not count is a wait, paced by its own number of waits.
    ``failure`` is set when the attempt failed.
    """

    action: Action
    outcome: AttemptVerdict
    reason: Reason | None = None
    counts: bool = False
    schedule: Schedule | None = None
    failure: Failure | None = None

    @property
    def exhausted(self) -> bool:
        """True when the message is dead-lettered because its attempts ran out."""
        return self.reason is Reason.RETRIES_EXHAUSTED


PROCESSED = Disposition(Action.ACKNOWLEDGE, AttemptVerdict.PROCESSED)
REPLAYED = Disposition(Action.ACKNOWLEDGE, AttemptVerdict.REPLAYED)
PREVIOUSLY_FAILED = Disposition(Action.ACKNOWLEDGE, AttemptVerdict.PREVIOUSLY_FAILED)
CONFIRMED_DEAD_LETTER = Disposition(
    Action.ACKNOWLEDGE, AttemptVerdict.DEAD_LETTERED, Reason.PERMANENT_ERROR
)
KEY_BUSY = Disposition(
    Action.RETRY,
    AttemptVerdict.RETRY,
    schedule=Schedule.IN_PROGRESS,
    failure=Failure.KEY_IN_PROGRESS,
)
CONFLICT = Disposition(
    Action.RETRY, AttemptVerdict.RETRY, schedule=Schedule.IN_PROGRESS, failure=Failure.CONFLICT
)
DATABASE_DOWN = Disposition(
    Action.RETRY,
    AttemptVerdict.RETRY,
    schedule=Schedule.RETRY,
    failure=Failure.DATABASE_UNAVAILABLE,
)
GUARD_DOWN = Disposition(
    Action.RETRY, AttemptVerdict.RETRY, schedule=Schedule.RETRY, failure=Failure.GUARD_UNAVAILABLE
)
TAKEN_OVER = Disposition(
    Action.RETRY, AttemptVerdict.RETRY, schedule=Schedule.IN_PROGRESS, failure=Failure.LEASE_LOST
)
DEAD_LETTER_DOWN = Disposition(
    Action.RETRY,
    AttemptVerdict.RETRY,
    schedule=Schedule.RETRY,
    failure=Failure.DEAD_LETTER_UNAVAILABLE,
)


def dead_letter(reason: Reason) -> Disposition:
    """Dead-letter the message at once, for ``reason``."""
    return Disposition(Action.DEAD_LETTER, AttemptVerdict.DEAD_LETTERED, reason)


def classify(
    error: BaseException | None,
    *,
    attempts: int,
    max_attempts: int,
    key: Key = Key.FOUND,
    replayed: bool = False,
    dead_lettered: bool = False,
    database_unavailable: bool = False,
    conflict: bool = False,
) -> Disposition:
    """Decide what becomes of a message after one attempt at it.

    ``error`` is what the attempt raised (``None``: the unit of work committed, or replayed the
    stored result when ``replayed``). ``attempts`` is the number of counted attempts before
    this one. ``key`` tells how reading the key went (without a key nothing runs, so the only
    error it goes with is its dead letter's). ``dead_lettered`` means the handler's
    permanent error was dead-lettered and confirmed while the key was held.
    ``database_unavailable`` is the caller's verdict on ``error``
    (:func:`outbox._pg.errors.database_unavailable`), ``conflict`` its verdict that PostgreSQL
    rolled the transaction back for a concurrent one
    (:func:`outbox._pg.errors.transaction_conflict`). A :class:`~outbox.errors.DeadLetterError`
    as ``error`` means a dead letter was not confirmed. Under the Redis guard,
    :class:`~outbox.errors.GuardUnavailable` means Redis could not decide or store the outcome
    (``on_redis_error="closed"``) and :class:`~outbox.errors.LeaseLost` that another owner took
    the key over: neither is the message's fault.
    """
    if key is Key.UNREADABLE and error is None:
        raise ValueError("key=Key.UNREADABLE needs the error that reading the key raised")
    if key is Key.MISSING and not (error is None or isinstance(error, DeadLetterError)):
        raise ValueError("key=Key.MISSING: without a key nothing ran that could raise")
    if dead_lettered:
        # Whatever ended the unit of work after the dead letter was confirmed (the permanent
        # error itself, or a failure to record it), the message is in the dead-letter topic.
        return CONFIRMED_DEAD_LETTER
    if key is Key.UNREADABLE:
        if isinstance(error, ValidationError):
            return dead_letter(Reason.INVALID_INPUT)
        return _failed(attempts, max_attempts)
    if isinstance(error, DeadLetterError):
        # Never acknowledge a message whose dead letter is not durable: keep trying it.
        return DEAD_LETTER_DOWN
    if key is Key.MISSING:
        return dead_letter(Reason.MISSING_KEY)
    if error is None:
        return REPLAYED if replayed else PROCESSED
    if isinstance(error, KeyInProgress):
        return KEY_BUSY
    if isinstance(error, LeaseLost):
        # The new owner's outcome stands; the retry meets it (busy, then replayed).
        return TAKEN_OVER
    if isinstance(error, GuardUnavailable):
        # Like a database outage: retried, in order, until the guard's Redis answers again.
        return GUARD_DOWN
    if isinstance(error, PreviouslyFailed):
        # The key failed permanently before and was dead-lettered then: no second dead letter.
        return PREVIOUSLY_FAILED
    if isinstance(error, KeyReuseError):
        return dead_letter(Reason.KEY_REUSE)
    if isinstance(error, SerializerError) and error.retriable:
        # A schema registry out of reach (decoding the message, or a publish of its handler):
        # the same message may pass once it answers, so it is retried like any failure.
        return _failed(attempts, max_attempts)
    if isinstance(error, ValidationError):
        return dead_letter(Reason.INVALID_INPUT)
    if database_unavailable:
        # Not the message's fault: retried, in order, until PostgreSQL answers again.
        return DATABASE_DOWN
    if conflict:
        # A serialization failure or a deadlock: nothing committed, and the message is not at
        # fault; retried like a busy key, without counting an attempt.
        return CONFLICT
    return _failed(attempts, max_attempts)


def _failed(attempts: int, max_attempts: int) -> Disposition:
    """A counted failure: retried with backoff, dead-lettered once the attempts run out."""
    if attempts + 1 >= max_attempts:
        return Disposition(
            Action.DEAD_LETTER,
            AttemptVerdict.DEAD_LETTERED,
            Reason.RETRIES_EXHAUSTED,
            counts=True,
            failure=Failure.ERROR,
        )
    return Disposition(
        Action.RETRY,
        AttemptVerdict.RETRY,
        counts=True,
        schedule=Schedule.RETRY,
        failure=Failure.ERROR,
    )
