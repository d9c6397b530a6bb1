"""What both flavours of the attempts (:mod:`outbox.consumer._attempt_async` and its sync twin)
share: an attempt's key rules, its message decoded, a retry scheduled, and the exception that
carries an error out of a unit of work. Nothing here waits, so it is written once, not
generated."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from outbox._core.deadletter import Reason
from outbox._core.disposition import AttemptVerdict, Disposition, Failure, Schedule
from outbox._core.offsets import Tries
from outbox._core.redact import one_line
from outbox._core.retry import backoff_delay
from outbox._kafka.consumer import Message, header_key
from outbox._kafka.serialization import Deserializer, decode
from outbox.errors import SerializationError

if TYPE_CHECKING:
    from outbox.config import ConsumerConfig
    from outbox.consumer._metrics import ConsumerMetrics

log = logging.getLogger("outbox.consumer")

KeyFunc = Callable[[Message], "str | None"]
"""``key_func(message) -> str | None``: the idempotency key of a message (None: none)."""
FingerprintFunc = Callable[[Message], "str | None"]
"""``fingerprint_func(message) -> str | None``: a request hash stored with the key."""


class _Unit(Protocol):
    """What an attempt needs of the unit a handler runs in: a unit of work, or a guard's claim."""

    @property
    def replayed(self) -> bool: ...

    @property
    def result(self) -> Any: ...

    @result.setter
    def result(self, value: Any) -> None: ...


Sink = TypeVar("Sink")


class AttemptsBase(Generic[Sink]):
    """The settings of a runner's attempts and the decisions on them that wait for nothing;
    ``dlq`` is where its dead letters go (each flavour's ``DeadLetterSink``)."""

    def __init__(
        self,
        handler: Callable[..., Any],
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
        *,
        permanent_errors: tuple[type[BaseException], ...],
        dlq: Sink,
        key_func: KeyFunc | None,
        fingerprint_func: FingerprintFunc | None,
        beat: Callable[[], None],
        key_deserializer: Deserializer | None = None,
        value_deserializer: Deserializer | None = None,
    ) -> None:
        self.config = config
        self._deserializers = (key_deserializer, value_deserializer)
        self._decodes = key_deserializer is not None or value_deserializer is not None
        self._handler = handler
        self._key_func = key_func
        self._fingerprint_func = fingerprint_func
        self._scope = config.effective_scope
        self._permanent_errors = permanent_errors
        self._metrics = metrics
        self._beat = beat
        self._link = config.trace_context == "link"
        self._dlq = dlq

    def _read_key(self, message: Message) -> tuple[str | None, str | None]:
        if self._key_func is not None:
            key = self._key_func(message)
        else:
            key = header_key(message, self.config.key_header)
        fingerprint = self._fingerprint_func(message) if self._fingerprint_func else None
        return key, fingerprint

    def answered_by(self, unit: Any) -> str | None:
        """Where a replayed ``unit``'s stored outcome came from: ``"redis"`` or
        ``"postgres"``."""
        return None

    def decoded(self, message: Message) -> Any:
        """``message`` as the handler gets it: decoded by the runner's deserializers, if any
        (:func:`outbox._kafka.serialization.decode`; raises
        :class:`~outbox.errors.UndecodableMessage` for bytes they refuse)."""
        if not self._decodes:
            return message
        return decode(message, *self._deserializers)

    def unavailable(self, error: BaseException) -> bool:
        """True when ``error`` says the store of outcomes is out of reach (an outage that is
        not the message's fault); what :func:`classify` does not tell by the error's type."""
        return False

    def _retry(
        self,
        message: Message,
        tries: Tries,
        verdict: Disposition,
        error: BaseException,
        key: str | None,
    ) -> AttemptVerdict:
        """Schedule the same message again after the verdict's backoff."""
        if verdict.schedule is Schedule.IN_PROGRESS:
            base, cap = self.config.in_progress_backoff, self.config.in_progress_backoff_max
        else:
            base, cap = self.config.retry_backoff, self.config.retry_backoff_max
        if verdict.counts:
            delay = backoff_delay(tries.attempts, base, cap)
        else:  # not the message's fault: paced by its own count, never exhausts its attempts
            tries.waits += 1
            delay = backoff_delay(tries.waits, base, cap)
        tries.retry_at = time.monotonic() + delay
        where = _where(message)
        if verdict.failure is Failure.KEY_IN_PROGRESS:
            log.debug("%s: key %r in progress elsewhere; retry in %.3fs", where, key, delay)
        elif verdict.failure is Failure.DATABASE_UNAVAILABLE:
            log.warning(
                "%s: PostgreSQL unavailable (%s); retrying in %.2fs, attempts not counted",
                where, one_line(error), delay,
            )  # fmt: skip
        elif verdict.failure is Failure.GUARD_UNAVAILABLE:
            log.warning(
                "%s: the guard's Redis cannot answer (%s); retrying in %.2fs, attempts not "
                "counted", where, one_line(error), delay,
            )  # fmt: skip
        elif verdict.failure is Failure.LEASE_LOST:
            log.warning(
                "%s: %s; retrying in %.3fs, the new owner's outcome stands",
                where, one_line(error), delay,
            )  # fmt: skip
        elif verdict.failure is Failure.DEAD_LETTER_UNAVAILABLE:
            log.error("%s: %s; retrying in %.2fs", where, one_line(error), delay)
        else:
            log.warning(
                "%s failed (attempt %d of %d), retrying in %.2fs: %s",
                where, tries.attempts, self.config.max_attempts, delay, one_line(error),
            )  # fmt: skip
        return AttemptVerdict.RETRY

    def _count_dead_letter(self, message: Message, reason: Reason) -> None:
        self._metrics.dead_lettered.labels(self.config.group, message.topic(), reason).inc()


class Carried(BaseException):
    """Carries ``error`` out of a unit of work, which rolls back without recording the key as
    failed: a handler result the key cannot store, or a dead letter the broker did not confirm.

    A BaseException, so that no ``OutboxConfig.permanent_errors`` entry (even ``Exception``) can
    make the unit of work record a failure for such a message.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def store_result(unit: _Unit, result: Any) -> None:
    """Store the handler's ``result`` with the key, or raise :class:`Carried` (rolled back, or
    the key released)."""
    try:
        unit.result = result
    except SerializationError as exc:
        raise Carried(
            SerializationError(
                f"the handler's return value cannot be stored as the key's result ({exc}); "
                "return JSON-compatible data (dict, list, str, number, bool or None)"
            )
        ) from exc


def _where(message: Message) -> str:
    return f"{message.topic()}[{message.partition()}]@{message.offset()}"
