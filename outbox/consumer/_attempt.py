# generated from outbox/consumer/_attempt_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/consumer/_attempt_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from outbox._core import validate as _validate
from outbox._core.batching import Abandoned
from outbox._core.deadletter import DeadLetter, Reason
from outbox._core.disposition import (
    Action,
    AttemptVerdict,
    Failure,
    Key,
    classify,
)
from outbox._core.failures import is_permanent
from outbox._core.handlers import BATCH_HANDLER
from outbox._core.offsets import Tries
from outbox._core.redact import one_line
from outbox._kafka.consumer import Message
from outbox._otel import spans
from outbox._pg.errors import database_unavailable, transaction_conflict
from outbox.consumer._attempt_base import (
    AttemptsBase,
    Carried,
    _Unit,
    _where,
    store_result,
)
from outbox.errors import (
    DeadLetterError,
    KeyInProgress,
    MissingIdempotencyKey,
    SerializationError,
)
from outbox.uow import Batch, MessageBatch

if TYPE_CHECKING:
    from outbox._redis.cache import OutcomeCache
    from outbox.config import ConsumerConfig
    from outbox.consumer._metrics import ConsumerMetrics
    from outbox.guard import RedisGuard
    from outbox.uow import Outbox, UnitOfWork

log = logging.getLogger("outbox.consumer")


class DeadLetterSink(Protocol):
    """Where an attempt sends dead letters: the runner's dead-letter producer."""

    def send_message(self, message: Message, letter: DeadLetter) -> None: ...


class BaseAttempts(AttemptsBase[DeadLetterSink], ABC):
    """Attempts at messages for one runner, wherever their keys' outcomes are kept: key rules,
    the handler around one attempt, the verdict carried out, metrics and dead letters.

    ``dlq`` is where dead letters go (the runner's producer). ``beat`` is called before each
    step that may take long (a handler, a dead letter waiting for the broker), so the runner's
    health check sees the loop move. ``cache`` is the Redis fast path micro-batches may answer
    duplicates from (None: none).
    """

    cache: OutcomeCache | None = None
    batch_form = False
    # False while no tracer provider is set (the micro-batches look once per batch): a message
    # then gets a process span only if it carries a context to pass on -- an empty span per
    # message is not free.
    traced = True

    def _decided(self, message: Message, tries: Tries) -> AttemptVerdict | None:
        """The outcome of a message decided before (a dead letter confirmed, or one to send
        now), or None."""
        if tries.done is not None:
            return tries.done
        if tries.dead_letter is not None:  # only the dead letter itself is left to send
            self._beat()
            return self._send_dead_letter(message, tries, tries.dead_letter)
        return None

    def read(
        self, message: Message, tries: Tries, *, validate: bool = False
    ) -> AttemptVerdict | tuple[str, str | None]:
        """What is known of ``message`` before its unit runs: its outcome when that is decided
        already (a dead letter, no usable key), else its key and fingerprint. ``validate``
        refuses here a key or fingerprint the unit would refuse (a message joining a
        micro-batch: alone, its unit refuses it)."""
        decided = self._decided(message, tries)
        if decided is not None:
            return decided
        try:
            key, fingerprint = self._read_key(message)
            if validate and key is not None:
                _validate.check_key(key)
                _validate.check_fingerprint(fingerprint)
        except Exception as exc:
            return self.dispose(message, tries, exc, reading=Key.UNREADABLE)
        if key is None:
            return self.dispose(message, tries, None, reading=Key.MISSING)
        return key, fingerprint

    def apply(self, message: Message, tries: Tries) -> AttemptVerdict:
        """One attempt at ``message`` by itself: read its key (:meth:`read`), run the handler
        in the key's unit (:meth:`alone`), carry out the verdict."""
        read = self.read(message, tries)
        if isinstance(read, AttemptVerdict):
            return read
        key, fingerprint = read
        return self.alone(message, tries, key, fingerprint)

    @abstractmethod
    def alone(
        self, message: Message, tries: Tries, key: str, fingerprint: str | None
    ) -> AttemptVerdict:
        """Run ``message`` in a unit of its own for ``key`` and carry out the verdict."""

    def attempt(
        self,
        message: Message,
        tries: Tries,
        key: str,
        enter: Callable[[], AbstractContextManager[_Unit]],
        optimistic: bool = False,
    ) -> AttemptVerdict:
        """Run the handler for ``message`` in the unit ``enter()`` opens for ``key`` (a unit of
        work, or a guard's claim), store its result there, and carry out the verdict. The unit
        stores the outcome when it ends: a result, a permanent failure, or nothing (released).
        ``optimistic`` (a unit of an optimistic batch): any failure raises
        :class:`~outbox._core.batching.Abandoned` instead, with no verdict carried out.

        With tracing on (:mod:`outbox._otel`) all of it runs in the message's ``process`` span:
        the handler's spans and the events it publishes join it."""
        if spans is None or not (self.traced or spans.carries_context(message)):
            return self._attempt(message, tries, key, enter, None, optimistic)
        with spans.process(message, self.config.group, self._link) as span:
            outcome = self._attempt(message, tries, key, enter, span, optimistic)
            spans.processed(span, outcome.value)
            return outcome

    def _attempt(
        self,
        message: Message,
        tries: Tries,
        key: str,
        enter: Callable[[], AbstractContextManager[_Unit]],
        span: Any,
        optimistic: bool,
    ) -> AttemptVerdict:
        sent = replayed = False
        answered: str | None = None
        try:
            with enter() as unit:
                replayed = unit.replayed
                if replayed:
                    answered = self.answered_by(unit)
                if not replayed:
                    try:
                        result = self._call(unit, message)
                    except BaseException as exc:
                        if optimistic or not is_permanent(exc, self._permanent_errors):
                            raise
                        # Dead-letter while the key is still held, before the unit records the
                        # failure by the same rule: a key recorded as failed has always been
                        # dead-lettered, so its redeliveries need no second one.
                        self._dead_letter_permanent(message, tries, exc)
                        sent = True
                        raise
                    store_result(unit, result)
        except Carried as exc:
            if optimistic:
                raise Abandoned() from exc.error
            if span is not None:
                spans.failed(span, exc.error)
            return self.dispose(message, tries, exc.error, key=key)
        except Exception as exc:
            if optimistic:
                raise Abandoned() from exc
            if span is not None and not isinstance(exc, KeyInProgress):  # a wait, not an error
                spans.failed(span, exc)
            return self.dispose(message, tries, exc, key=key, dead_lettered=sent)
        return self.dispose(message, tries, None, key=key, replayed=replayed, answered_by=answered)

    def _call(self, unit: Any, message: Message) -> Any:
        """The handler's result for ``message``."""
        return self._handler(unit, self.decoded(message))

    def dispose(
        self,
        message: Message,
        tries: Tries,
        error: BaseException | None,
        *,
        key: str | None = None,
        reading: Key = Key.FOUND,
        replayed: bool = False,
        answered_by: str | None = None,
        dead_lettered: bool = False,
    ) -> AttemptVerdict:
        """:func:`classify` what the attempt came to, and carry the verdict out.
        ``answered_by`` names where a replay's stored outcome came from (``redis`` or
        ``postgres``), counted when the verdict is a replay."""
        verdict = classify(
            error,
            attempts=tries.attempts,
            max_attempts=self.config.max_attempts,
            key=reading,
            replayed=replayed,
            dead_lettered=dead_lettered,
            database_unavailable=error is not None and self.unavailable(error),
            conflict=error is not None and transaction_conflict(error),
        )
        if verdict.counts:
            tries.attempts += 1
        if verdict.failure is not None:
            self._metrics.failed.labels(self.config.group, message.topic(), verdict.failure).inc()
        if verdict.outcome is AttemptVerdict.REPLAYED and answered_by is not None:
            self._metrics.answered(self.config.group, message.topic() or "", answered_by)
        if verdict.action is Action.RETRY:
            assert error is not None
            return self._retry(message, tries, verdict, error, key)
        if verdict.action is Action.DEAD_LETTER:
            assert verdict.reason is not None
            if error is None:  # no key
                error = MissingIdempotencyKey(
                    f"no {self.config.key_header!r} header: without an idempotency key the "
                    "message cannot be applied at most once; have the producer set the header "
                    "(the outbox relay always does) or pass key_func"
                )
            elif verdict.exhausted:
                log.error(
                    "%s failed %d times, dead-lettering it: %s",
                    _where(message), tries.attempts, one_line(error),
                )  # fmt: skip
                # A traceback quotes the message whole, line breaks included: DEBUG only.
                log.debug("%s: the last attempt's traceback", _where(message), exc_info=error)
            tries.dead_letter = DeadLetter.from_exception(
                verdict.reason, error, max(1, tries.attempts)
            )
            return self._send_dead_letter(message, tries, tries.dead_letter)
        if verdict.outcome is AttemptVerdict.PREVIOUSLY_FAILED:
            log.info(
                "%s: key %r failed permanently earlier and was dead-lettered then; "
                "acknowledged without a second dead letter", _where(message), key,
            )  # fmt: skip
        elif verdict.outcome is AttemptVerdict.DEAD_LETTERED:  # confirmed inside the unit of work
            assert error is not None and verdict.reason is not None
            tries.done = AttemptVerdict.DEAD_LETTERED
            self._count_dead_letter(message, verdict.reason)
            log.warning("dead-lettered %s (key %r): %s", _where(message), key, one_line(error))
        return verdict.outcome

    def _dead_letter_permanent(self, message: Message, tries: Tries, exc: BaseException) -> None:
        letter = DeadLetter.from_exception(Reason.PERMANENT_ERROR, exc, tries.attempts + 1)
        self._metrics.failed.labels(self.config.group, message.topic(), Failure.PERMANENT).inc()
        try:
            self._dlq.send_message(message, letter)
        except DeadLetterError as unconfirmed:
            raise Carried(unconfirmed) from unconfirmed

    def _send_dead_letter(
        self, message: Message, tries: Tries, letter: DeadLetter
    ) -> AttemptVerdict:
        try:
            self._dlq.send_message(message, letter)
        except DeadLetterError as exc:
            return self.dispose(message, tries, exc)
        tries.done = AttemptVerdict.DEAD_LETTERED
        self._count_dead_letter(message, letter.reason)
        log.warning("dead-lettered %s (%s): %s", _where(message), letter.reason, letter.error)
        return AttemptVerdict.DEAD_LETTERED


class Attempts(BaseAttempts):
    """Attempts at messages in units of work of an :class:`~outbox.uow.Outbox`: one
    of their own (:meth:`alone`), or one of a micro-batch's savepoints (:meth:`run`). ``rules``
    are :class:`BaseAttempts`' keywords (``dlq``, ``key_func``, ``fingerprint_func``,
    ``beat``...)."""

    def __init__(
        self,
        outbox: Outbox,
        handler: Callable[..., Any],
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
        **rules: Any,
    ) -> None:
        permanent = outbox.config.permanent_errors
        super().__init__(handler, config, metrics, permanent_errors=permanent, **rules)
        self.outbox = outbox
        self.cache = outbox.cache
        self.batch_form = bool(getattr(handler, BATCH_HANDLER, False))

    def run_group(self, units: Sequence[UnitOfWork], messages: Sequence[Message]) -> None:
        """Hand a batch handler its units of work and messages together; store each result.
        Raises what the handler raised, or :class:`Carried` for results that cannot be stored."""
        handed = MessageBatch(list(zip(units, map(self.decoded, messages), strict=True)))
        if spans is None:
            results = batch_results(self._handler(handed), units)
        else:  # one span for the handler's one call, linked to every message's context
            with spans.process_batch(messages, self.config.group):
                results = batch_results(self._handler(handed), units)
        for uow, result in zip(units, results, strict=True):
            store_result(uow, result)

    def alone(
        self, message: Message, tries: Tries, key: str, fingerprint: str | None
    ) -> AttemptVerdict:
        return self.run(message, tries, key, fingerprint, self.outbox)

    def run(
        self,
        message: Message,
        tries: Tries,
        key: str,
        fingerprint: str | None,
        units: Outbox | Batch,
        optimistic: bool = False,
    ) -> AttemptVerdict:
        """Run ``message``'s unit of work (its own, or one of a batch) and carry out the
        verdict; ``optimistic``: see :meth:`attempt`."""
        return self.attempt(
            message,
            tries,
            key,
            lambda: units.unit_of_work(key, scope=self._scope, fingerprint=fingerprint),
            optimistic,
        )

    def run_optimistic(
        self, message: Message, tries: Tries, key: str, fingerprint: str | None, batch: Batch
    ) -> AttemptVerdict:
        """:meth:`run` of ``message`` whose key's work runs in ``batch``, an optimistic batch:
        the same unit of work and the same verdicts -- PROCESSED, or
        :class:`~outbox._core.batching.Abandoned` for any failure -- minus the layers that only
        a verdict other than these needs (a message with a ``process`` span to record takes
        :meth:`run`)."""
        if spans is not None and (self.traced or spans.carries_context(message)):
            return self.run(message, tries, key, fingerprint, batch, True)
        uow = batch.begin(key, fingerprint)
        try:
            try:
                store_result(uow, self._call(uow, message))
            except BaseException as exc:
                batch.end(uow, exc)  # the batch is abandoned
                raise
            batch.end(uow, None)
        except Carried as exc:
            raise Abandoned() from exc.error
        except Exception as exc:
            raise Abandoned() from exc
        return AttemptVerdict.PROCESSED

    def decided(
        self,
        message: Message,
        tries: Tries,
        key: str,
        fingerprint: str | None,
        batch: Batch,
    ) -> AttemptVerdict | None:
        """The verdict on ``message`` whose key ``batch``'s lookup decided (a stored outcome,
        or a lock held elsewhere), reached without a unit of work: no handler runs for it, so
        none is needed -- or None when a ``process`` span must record it (it then goes through
        :meth:`run`)."""
        if spans is not None and (self.traced or spans.carries_context(message)):
            return None
        try:
            batch.replay(key, fingerprint)
        except Exception as exc:
            return self.dispose(message, tries, exc, key=key)
        return self.dispose(message, tries, None, key=key, replayed=True, answered_by="postgres")

    def _call(self, unit: Any, message: Message) -> Any:
        """The handler's result for ``message`` (a batch handler gets a batch of one)."""
        handed = self.decoded(message)
        if not self.batch_form:
            return self._handler(unit, handed)
        return batch_results(self._handler(MessageBatch([(unit, handed)])), [unit])[0]

    def unavailable(self, error: BaseException) -> bool:
        return database_unavailable(error)

    def answered_by(self, unit: UnitOfWork) -> str | None:
        return unit.replayed_from


class GuardedAttempts(BaseAttempts):
    """Attempts at messages, each under a claim of the runner's
    :class:`~outbox.guard.RedisGuard`, for handlers whose effects are not in PostgreSQL.

    The handler runs as ``handler(claim, message)`` inside ``guard.claim(key, scope=<the
    runner's scope>, fingerprint=...)``; its return value is the claim's result, stored when the
    claim ends, and only then is the message finished. Everything else -- key rules, verdicts,
    retries, dead letters -- is :class:`BaseAttempts`'. There is no transaction to share, so
    a guarded runner handles one message at a time (``batch_size=1``). ``rules`` are
    :class:`BaseAttempts`' keywords (``dlq``, ``key_func``, ``fingerprint_func``, ``beat``...).
    """

    def __init__(
        self,
        guard: RedisGuard,
        handler: Callable[..., Any],
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
        **rules: Any,
    ) -> None:
        permanent = guard.settings.permanent_errors
        super().__init__(handler, config, metrics, permanent_errors=permanent, **rules)
        self.guard = guard

    def answered_by(self, unit: Any) -> str | None:
        return "redis"  # the guard keeps its outcomes in Redis only

    def alone(
        self, message: Message, tries: Tries, key: str, fingerprint: str | None
    ) -> AttemptVerdict:
        return self.attempt(
            message,
            tries,
            key,
            lambda: self.guard.claim(key, scope=self._scope, fingerprint=fingerprint),
        )


def batch_handler(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``handler`` as taking a whole micro-batch: ``handler(batch)`` instead of
    ``handler(uow, message)``.

    ``batch`` (:class:`MessageBatch`) iterates ``(uow, message)`` pairs in partition-offset
    order, each message with its own unit of work; ``batch.connection`` / ``batch.session`` are
    the batch's one transaction, for bulk statements. Set each ``uow.result`` (or return a list
    with one result per message) and publish with ``uow.publish``. Only messages whose work must
    run are in it: duplicates are replayed without it. When it raises, none of its messages is
    committed, and each is then given to it alone (a batch of one), so that the failure lands on
    the message that causes it.
    """
    setattr(handler, BATCH_HANDLER, True)
    return handler


def batch_results(results: Any, units: Sequence[UnitOfWork]) -> list[Any]:
    """What a batch handler returned, as one result per unit of work: ``None`` keeps each
    ``uow.result``; a list gives them in order."""
    if results is None:
        return [uow.result for uow in units]
    if isinstance(results, list | tuple) and len(results) == len(units):
        return list(results)
    raise Carried(
        SerializationError(
            f"a batch handler returns None or a list of {len(units)} result(s), one per "
            f"message, got {type(results).__name__}"
        )
    )
