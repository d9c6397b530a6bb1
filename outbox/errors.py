"""Exceptions raised by outbox-kit.

Every exception derives from :class:`OutboxError`, so ``except OutboxError`` catches anything the
toolkit raises on purpose. Driver errors are translated in one place and chained with
``raise ... from exc`` so the original cause stays visible.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every exception raised by outbox-kit."""


class ConfigurationError(OutboxError, ValueError):
    """A setting is missing or invalid (bad URL, bad schema name, inconsistent TTLs...)."""


class ValidationError(OutboxError, ValueError):
    """Input to the toolkit was refused before any I/O took place."""


class InvalidKeyError(ValidationError):
    """An idempotency key or scope is empty, too long or not a string."""


class InvalidTopicError(ValidationError):
    """A topic name that a Kafka broker would refuse."""


class SerializationError(ValidationError):
    """A value, header or result cannot be encoded (not bytes/str/JSON-serializable)."""


class SerializerError(SerializationError):
    """A serializer given to ``publish()`` (``serializer=``, ``key_serializer=``, or
    ``OutboxConfig.serializers``) refused a value, or a consumer's deserializer could not reach
    its schema registry.

    Raised inside the unit of work, before anything is written: a value that does not match its
    schema, a schema the registry does not know (``auto.register.schemas`` off), a registry that
    cannot be reached while its answer is not cached. ``retriable`` is true for the last kind
    (connection refused, timeout, a 5xx answer): the same value may pass later.
    """

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class PayloadTooLargeError(ValidationError):
    """An event value (with key and headers) exceeds the configured size limit."""


class KeyInProgress(OutboxError):
    """Another attempt for the same ``(scope, key)`` is running right now.

    Raised at once, without waiting for the other transaction. Retry later: if the other attempt
    commits, the retry replays its result; if it fails or crashes, the retry runs the body.
    """

    def __init__(self, scope: str, key: str) -> None:
        super().__init__(
            f"idempotency key {key!r} in scope {scope!r} is being processed by another "
            "attempt right now; retry later"
        )
        self.scope = scope
        self.key = key


class PreviouslyFailed(OutboxError):
    """The key was recorded as permanently failed; the body is not run again.

    ``error`` carries the stored error text of the attempt that failed.
    """

    def __init__(self, scope: str, key: str, error: str) -> None:
        super().__init__(
            f"idempotency key {key!r} in scope {scope!r} failed permanently earlier: {error}"
        )
        self.scope = scope
        self.key = key
        self.error = error


class KeyReuseError(OutboxError):
    """The key was used before with a different request fingerprint."""

    def __init__(self, scope: str, key: str) -> None:
        super().__init__(
            f"idempotency key {key!r} in scope {scope!r} was already used for a different "
            "request (fingerprint mismatch); use a new key for a new request"
        )
        self.scope = scope
        self.key = key


class ReplayedWriteError(OutboxError):
    """A write was attempted inside a unit of work that replays a stored result.

    A replayed unit of work must not have effects: return ``uow.result`` instead.
    """


class NoUnitOfWork(OutboxError, LookupError):
    """:func:`outbox.http.current_unit_of_work` was called outside a request that the
    idempotency middleware runs in a unit of work."""


class PermanentError(OutboxError):
    """Raise from the body of a unit of work to record the key as failed.

    The business writes of the attempt are rolled back, the key is stored as failed with this
    error's text, and every later attempt raises :class:`PreviouslyFailed` without running the
    body.
    """


class UndecodableMessage(PermanentError):
    """A consumed message that the runner's deserializer cannot decode (not the wire format,
    a schema id the registry does not know, a value its schema refuses): dead-lettered at once,
    never retried."""


class PublishError(OutboxError):
    """An event could not be delivered to Kafka.

    ``retriable`` tells whether trying again may succeed (broker unreachable, leader moving) or
    not (record too large, unknown topic, authorization refused).
    """

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class TransactionEndedError(OutboxError):
    """The transaction of a unit of work was ended from inside its body."""


class MissingIdempotencyKey(PermanentError):
    """A consumed message carries no idempotency key (no key header, nothing from
    ``key_func``): it cannot be applied at most once, so it is dead-lettered at once. Its dead
    letter names this type."""


class MigrationLockError(OutboxError):
    """A migration could not take the lock it needs within its lock timeout, however often it
    tried: another session held the table. The message names that session."""


class RetentionError(ConfigurationError):
    """``outbox gc`` was asked to forget keys while a duplicate could still arrive."""


class ConsumerError(OutboxError):
    """The consumer cannot go on (a fatal Kafka client error); restart it."""


class DeadLetterError(PublishError):
    """A dead letter could not be confirmed by the broker; the original offset stays uncommitted."""


class FatalProducerError(PublishError):
    """The producer hit a fatal error and must be rebuilt (idempotence state lost)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retriable=True)


class GuardUnavailable(OutboxError):
    """The Redis guard (:mod:`outbox.guard`) could not decide for a key.

    Redis was unreachable, too slow, refused the command, or the key's record in Redis is not
    one the guard wrote. With ``on_redis_error="closed"`` (the default) the body is not run and
    this is raised; with ``"open"`` the body runs without the guard and a warning is logged.
    Also raised, under ``"closed"``, when a body ran but Redis did not record its outcome.
    """

    def __init__(self, message: str, *, scope: str, key: str) -> None:
        super().__init__(message)
        self.scope = scope
        self.key = key


class LeaseLost(OutboxError):
    """A guard's lease on a key ran out and another owner took the key over.

    Raised when the owner whose lease expired tries to record its outcome: nothing is changed
    and the new owner's outcome stands. Effects the old owner had already caused are not undone:
    pass ``claim.fence`` to the systems the body writes to, so that they can refuse an owner
    whose fence is lower than one they have already seen (see ``docs/guard.md``).
    """

    def __init__(self, scope: str, key: str, fence: int, current_fence: int) -> None:
        what = (
            f"ran out and another owner took the key over (it is at fence {current_fence})"
            if current_fence
            else "is gone: the key's record left Redis (expired, evicted or flushed)"
        )
        super().__init__(
            f"the lease on idempotency key {key!r} in scope {scope!r} (fence {fence}) {what}; "
            "this owner's outcome was not recorded. Use a longer lease or lease renewal, and "
            "pass the fence to downstream writes so that they refuse stale owners"
        )
        self.scope = scope
        self.key = key
        self.fence = fence
        self.current_fence = current_fence
