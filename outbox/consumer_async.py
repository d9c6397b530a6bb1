"""Idempotent Kafka consumer runner: exactly-once effects from at-least-once delivery.

Each message is run through ``unit_of_work(key, scope=<group>)`` keyed by its
``X-Idempotency-Key`` header, and its offset is committed only once the unit of work committed,
replayed a stored result, or the message was dead-lettered (and the broker confirmed the dead
letter). Redelivery after a crash or a rebalance is absorbed by the idempotency key::

    from outbox import AsyncOutbox
    from outbox.consumer import AsyncConsumerRunner

    async def handle(uow, message):
        order = json.loads(message.value())
        uow.session.add(Order(id=order["id"]))
        uow.publish("order.accepted", {"id": order["id"]}, key=str(order["id"]))
        return {"accepted": order["id"]}          # stored, replayed to duplicates

    runner = AsyncConsumerRunner(
        AsyncOutbox(url), handle, topics=["orders"], group="billing",
        bootstrap_servers="kafka:9092",
    )
    await runner.run()        # returns after runner.stop() (e.g. from a signal handler)

or ``outbox consume app:handle --topic orders --group billing``. The delivery semantics
(offsets, retries, dead letters, rebalances) are described in ``docs/consumer.md``.

This module is the loop: poll, :func:`outbox._core.disposition.classify` what one attempt at a
message came to, carry the verdict out, commit offsets behind finished messages. The Kafka
clients are in :mod:`outbox._kafka`, the dead-letter format in :mod:`outbox._core.deadletter`.

Both flavours come from one source: ``outbox/consumer_async.py`` (asyncio) is written by hand and
``outbox/consumer.py`` (sync, which offers the asyncio runner too) is generated from it by
``tools/async_to_sync.py``, so the loop exists once. In the asyncio flavour the Kafka clients'
blocking calls are awaited and run on each client's own thread; in the sync one they are plain
calls.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from outbox._core.deadletter import DeadLetter, DeadLetterInfo, Reason
from outbox._core.disposition import Action, Disposition, Failure, Key, Outcome, Schedule, classify
from outbox._core.failures import is_permanent
from outbox._core.offsets import TP, Assignment, Partition
from outbox._core.redact import one_line
from outbox._core.retry import backoff_delay
from outbox._core.stopping import stop_on_signals
from outbox._kafka.config import consumer_config, producer_config
from outbox._kafka.consumer import AsyncKafkaConsumer, Committed, Message, coordinates, header_key
from outbox._kafka.deadletter import AsyncDeadLetterProducer
from outbox._pg.errors import database_unavailable
from outbox.config import (
    ENV_CONSUMER_GROUP as ENV_GROUP,
    ENV_CONSUMER_METRICS_PORT as ENV_METRICS_PORT,
    ENV_KAFKA_CONFIG as ENV_KAFKA_CONFIG,
    ConsumerConfig,
)
from outbox.consumer_metrics import ConsumerMetrics, serve_metrics
from outbox.errors import (
    ConfigurationError,
    ConsumerError,
    DeadLetterError,
    SerializationError,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outbox.uow_async import AsyncOutbox, AsyncUnitOfWork

__all__ = [
    "ENV_GROUP",
    "ENV_KAFKA_CONFIG",
    "ENV_METRICS_PORT",
    "AsyncConsumerRunner",
    "AsyncHandler",
    "ConsumerConfig",
    "ConsumerError",
    "DeadLetterInfo",
    "FingerprintFunc",
    "KeyFunc",
    "Outcome",
    "Reason",
    "backoff_delay",
    "consume",
    "database_unavailable",
    "header_key",
    "serve_metrics",
]

log = logging.getLogger("outbox.consumer")

_ASYNC = True

AsyncHandler = Callable[["AsyncUnitOfWork", Message], Awaitable[Any]]
"""``async def handler(uow, message) -> result``: apply one message inside its unit of work.

The return value must be JSON-serializable; it is stored with the key and replayed to
duplicates (the handler is not called for them).
"""
KeyFunc = Callable[[Message], "str | None"]
"""``key_func(message) -> str | None``: the idempotency key of a message (None: none)."""
FingerprintFunc = Callable[[Message], "str | None"]
"""``fingerprint_func(message) -> str | None``: a request hash stored with the key."""


class AsyncConsumerRunner:
    """Feeds Kafka messages through units of work and commits offsets behind them.

    ``AsyncConsumerRunner(outbox, handler, topics=[...], group="billing",
    bootstrap_servers=..., kafka_config={...}, key_header=..., max_attempts=5,
    dlq_topic_suffix=".dlq", ...)`` takes the fields of :class:`ConsumerConfig` as keywords (or a
    ready ``config=``). ``key_func`` replaces the header lookup; ``fingerprint_func`` adds a
    request fingerprint to each key; ``metrics_registry`` receives the metrics (default: the
    global registry).

    :meth:`run` returns after :meth:`stop` is called (from a signal handler, another task or
    another thread), once the message in hand finished and the finished offsets are committed.
    One runner is one Kafka consumer; run several processes (or runners) with the same group to
    scale out.
    """

    def __init__(
        self,
        outbox: AsyncOutbox,
        handler: AsyncHandler,
        config: ConsumerConfig | None = None,
        *,
        key_func: KeyFunc | None = None,
        fingerprint_func: FingerprintFunc | None = None,
        metrics_registry: CollectorRegistry | None = None,
        **settings: Any,
    ) -> None:
        if config is None:
            config = ConsumerConfig(**settings)
        elif settings:
            config = dataclasses.replace(config, **settings)
        if not callable(handler):
            raise ConfigurationError(f"handler must be callable, got {handler!r}")
        if is_coroutine_handler(handler) != _ASYNC:
            raise ConfigurationError(
                f"{type(self).__name__} runs "
                + ("coroutine functions" if _ASYNC else "plain functions")
                + f" as handler(uow, message), got {handler!r}: the sync runner takes plain "
                "functions, the asyncio runner coroutine functions"
            )
        if outbox.is_async != _ASYNC:
            raise ConfigurationError(
                f"{type(self).__name__} needs an outbox of its flavour "
                f"({'asyncio' if _ASYNC else 'sync'}), got {type(outbox).__name__}"
            )
        self.config = config.validate()
        self.outbox = outbox
        self._handler = handler
        self._key_func = key_func
        self._fingerprint_func = fingerprint_func
        self._scope = config.effective_scope
        self._permanent_errors = outbox.config.permanent_errors
        self.metrics_registry = metrics_registry
        self._metrics = ConsumerMetrics.for_registry(metrics_registry)
        self._stopping = threading.Event()
        self._partitions: Assignment[Message] = Assignment()
        self._consumer: AsyncKafkaConsumer | None = None
        self._dlq: AsyncDeadLetterProducer | None = None
        self._last_commit = 0.0
        self._fatal: str | None = None
        self._running = threading.Lock()
        # Last turn of the poll loop (monotonic); None while the loop is not running.
        self._heartbeat: float | None = None

    # -- public --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Consume until :meth:`stop`; then commit finished offsets and leave the group.

        A runner runs once: a :meth:`stop` that comes before :meth:`run` makes it return at once.
        Raises :class:`ConsumerError` on a fatal Kafka client error (after committing what was
        finished).
        """
        if not self._running.acquire(blocking=False):
            raise ConfigurationError("this ConsumerRunner is already running")
        try:
            bootstrap = self.config.effective_bootstrap
            self._consumer = AsyncKafkaConsumer(
                consumer_config(bootstrap, self.config.group, self.config.kafka_config),
                on_error=self._on_client_error,
                on_commit=self._on_commit,
            )
            self._dlq = AsyncDeadLetterProducer(
                producer_config(bootstrap, self.config.kafka_config, purpose="dead-letter"),
                group=self.config.group,
                suffix=self.config.dlq_topic_suffix,
                timeout=self.config.dlq_timeout,
            )
            self._consumer.subscribe(
                self.config.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            log.info(
                "consuming %s as group %r (scope %r) from %s",
                ", ".join(self.config.topics), self.config.group, self._scope, bootstrap,
            )  # fmt: skip
            while not self._stopping.is_set():
                self._heartbeat = time.monotonic()
                timeout = self._poll_timeout()
                for message in await self._consumer.consume(self.config.batch_size, timeout):
                    self._accept(message)
                await self._work()
                await self._commit_if_due()
        finally:
            self._heartbeat = None
            try:
                await self._shutdown()
            finally:
                self._running.release()
        if self._fatal is not None:
            raise ConsumerError(f"fatal Kafka client error: {self._fatal}; restart the consumer")

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (safe from signal handlers)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    def healthy(self, max_silence: float) -> bool:
        """True while :meth:`run` is consuming and its loop moved within ``max_silence`` seconds.

        The loop moves on every poll (at least every ``poll_timeout``) and on every attempt at a
        message, so only one step that takes longer -- a handler, or a dead letter waiting up to
        ``dlq_timeout`` for the broker -- makes the runner look stuck. False before :meth:`run`,
        once :meth:`stop` was called, and after :meth:`run` returned.
        """
        beat = self._heartbeat
        return (
            beat is not None
            and not self._stopping.is_set()
            and time.monotonic() - beat <= max_silence
        )

    # -- partitions and offsets ----------------------------------------------------------------

    def _on_client_error(self, error: str, fatal: bool) -> None:
        # librdkafka reconnects by itself; these are reported, never dropped silently.
        if fatal:
            log.error("fatal Kafka client error: %s", error)
            self._fatal = error
            self.stop()
        else:
            log.warning("Kafka client error: %s", error)

    def _on_assign(self, partitions: list[TP]) -> None:
        self._partitions.assign(partitions)
        log.info("assigned %s", _describe(partitions))

    def _on_revoke(self, partitions: list[TP]) -> None:
        # The new owner starts at the committed offset: commit what is finished. Messages in a
        # backlog are dropped here and redelivered there; a unit of work that committed but
        # whose offset did not is replayed there, not applied twice. Rebalance callbacks run
        # inside a client call, on the client's thread: the commit is made right there.
        consumer = self._consumer
        offsets = self._partitions.to_commit(partitions)
        if consumer is not None and offsets:
            try:
                self._on_commit(None, consumer.commit_now(offsets))
            except ConsumerError as exc:
                log.warning("offset commit of %s failed: %s", _describe(offsets), exc)
        self._forget(partitions)
        log.info("revoked %s", _describe(partitions))

    def _on_lost(self, partitions: list[TP]) -> None:
        # Another member may own these already; committing now could move its offsets back.
        self._forget(partitions)
        log.warning("lost %s without a commit (session timed out?)", _describe(partitions))

    def _forget(self, partitions: list[TP]) -> None:
        self._partitions.forget(partitions)
        if self._consumer is not None:
            self._consumer.release(partitions)

    def _on_commit(self, error: str | None, committed: list[Committed]) -> None:
        if error is not None:
            # The next commit carries the same or a later offset; until then a crash only means
            # redelivery, which the idempotency key absorbs.
            log.warning("offset commit failed: %s", error)
            return
        for topic, partition, offset, failed in committed:
            if failed is not None:
                log.warning("offset commit of %s[%d] failed: %s", topic, partition, failed)
                continue
            self._partitions.confirm((topic, partition), offset)

    async def _commit(self, sync: bool, only: list[TP] | None = None) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        offsets = self._partitions.to_commit(only)
        self._last_commit = time.monotonic()
        if not offsets:
            return
        try:
            committed = await consumer.commit(offsets, sync=sync)
        except ConsumerError as exc:
            log.warning("offset commit of %s failed: %s", _describe(offsets), exc)
            return
        if sync:
            self._on_commit(None, committed)

    async def _commit_if_due(self) -> None:
        if time.monotonic() - self._last_commit >= self.config.commit_interval:
            await self._commit(sync=False)

    def _poll_timeout(self) -> float:
        longest = min(self.config.poll_timeout, self.config.commit_interval)
        return self._partitions.next_retry(time.monotonic(), longest)

    def _accept(self, message: Message) -> None:
        topic, partition, offset = coordinates(message)
        state = self._partitions.get((topic, partition))
        if state is None:
            # Fetched before its partition was revoked in this same poll: it belongs to the new
            # owner now. Processing it here would apply it with no offset of ours to commit,
            # and the new owner would meet it again.
            log.debug("dropped %s[%d]@%d: partition no longer assigned", topic, partition, offset)
            return
        state.backlog.append(message)
        self._metrics.consumed.labels(self.config.group, topic).inc()

    # -- the work ------------------------------------------------------------------------------

    async def _work(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        for key, state in self._partitions.items():
            while state.backlog and not self._stopping.is_set():
                if key not in self._partitions:
                    break  # revoked while a dead-letter commit served a rebalance
                now = time.monotonic()
                if state.retry_at > now:
                    break
                message = state.backlog[0]
                self._heartbeat = now
                outcome = await self._attempt(message, state)
                if outcome is Outcome.RETRY:
                    # Its partition waits; the backlog keeps what was received after it.
                    consumer.pause(key)
                    break
                state.finish(coordinates(message)[2])
                if outcome is Outcome.DEAD_LETTERED:
                    # Shrinks the window in which a crash would dead-letter it a second time.
                    await self._commit(sync=True, only=[key])
            if key not in self._partitions:
                continue  # revoked while a dead-letter commit served a rebalance
            if not state.backlog:
                consumer.resume(key)

    async def _attempt(self, message: Message, state: Partition[Message]) -> Outcome:
        started = time.perf_counter()
        outcome = None
        try:
            outcome = await self._apply(message, state)
        finally:
            seconds = time.perf_counter() - started
            self._metrics.attempted(self.config.group, coordinates(message)[0], outcome, seconds)
        return outcome

    async def _apply(self, message: Message, state: Partition[Message]) -> Outcome:
        """One attempt at ``message``: read its key, run its unit of work, carry out the verdict."""
        if state.dead_letter is not None:  # only the dead letter itself is left to send
            return await self._send_dead_letter(message, state, state.dead_letter)
        try:
            if self._key_func is not None:
                key = self._key_func(message)
            else:
                key = header_key(message, self.config.key_header)
            fingerprint = self._fingerprint_func(message) if self._fingerprint_func else None
        except Exception as exc:
            return await self._dispose(message, state, exc, reading=Key.UNREADABLE)
        if key is None:
            return await self._dispose(message, state, None, reading=Key.MISSING)
        sent = replayed = False
        try:
            async with self.outbox.unit_of_work(
                key, scope=self._scope, fingerprint=fingerprint
            ) as uow:
                replayed = uow.replayed
                if not replayed:
                    try:
                        result = await self._handler(uow, message)
                    except BaseException as exc:
                        if not is_permanent(exc, self._permanent_errors):
                            raise
                        # Dead-letter while the key is still held, before the unit of work
                        # records the failure by the same rule: a key recorded as failed has
                        # always been dead-lettered, so its redeliveries need no second one.
                        await self._dead_letter_permanent(message, state, exc)
                        sent = True
                        raise
                    _store_result(uow, result)
        except _Carried as exc:
            return await self._dispose(message, state, exc.error, key=key)
        except Exception as exc:
            return await self._dispose(message, state, exc, key=key, dead_lettered=sent)
        return await self._dispose(message, state, None, key=key, replayed=replayed)

    async def _dispose(
        self,
        message: Message,
        state: Partition[Message],
        error: BaseException | None,
        *,
        key: str | None = None,
        reading: Key = Key.FOUND,
        replayed: bool = False,
        dead_lettered: bool = False,
    ) -> Outcome:
        """:func:`classify` what the attempt came to, and carry the verdict out."""
        verdict = classify(
            error,
            attempts=state.attempts,
            max_attempts=self.config.max_attempts,
            key=reading,
            replayed=replayed,
            dead_lettered=dead_lettered,
            database_unavailable=error is not None and database_unavailable(error),
        )
        if verdict.counts:
            state.attempts += 1
        if verdict.failure is not None:
            self._metrics.failed.labels(self.config.group, message.topic(), verdict.failure).inc()
        if verdict.action is Action.RETRY:
            assert error is not None
            return self._retry(message, state, verdict, error, key)
        if verdict.action is Action.DEAD_LETTER:
            assert verdict.reason is not None
            if error is None:  # no key
                error = _MissingKey(
                    f"no {self.config.key_header!r} header: without an idempotency key the "
                    "message cannot be applied at most once; have the producer set the header "
                    "(the outbox relay always does) or pass key_func"
                )
            elif verdict.exhausted:
                log.error(
                    "%s failed %d times, dead-lettering it: %s",
                    _where(message), state.attempts, one_line(error), exc_info=error,
                )  # fmt: skip
            state.dead_letter = DeadLetter.from_exception(
                verdict.reason, error, max(1, state.attempts)
            )
            return await self._send_dead_letter(message, state, state.dead_letter)
        if verdict.outcome is Outcome.PREVIOUSLY_FAILED:
            log.info(
                "%s: key %r failed permanently earlier and was dead-lettered then; "
                "acknowledged without a second dead letter", _where(message), key,
            )  # fmt: skip
        elif verdict.outcome is Outcome.DEAD_LETTERED:  # confirmed inside the unit of work
            assert error is not None and verdict.reason is not None
            self._count_dead_letter(message, verdict.reason)
            log.warning("dead-lettered %s (key %r): %s", _where(message), key, one_line(error))
        return verdict.outcome

    def _retry(
        self,
        message: Message,
        state: Partition[Message],
        verdict: Disposition,
        error: BaseException,
        key: str | None,
    ) -> Outcome:
        """Schedule the same message again after the verdict's backoff."""
        if verdict.schedule is Schedule.IN_PROGRESS:
            base, cap = self.config.in_progress_backoff, self.config.in_progress_backoff_max
        else:
            base, cap = self.config.retry_backoff, self.config.retry_backoff_max
        if verdict.counts:
            delay = backoff_delay(state.attempts, base, cap)
        else:  # not the message's fault: paced by its own count, never exhausts its attempts
            state.waits += 1
            delay = backoff_delay(state.waits, base, cap)
        state.retry_at = time.monotonic() + delay
        where = _where(message)
        if verdict.failure is Failure.KEY_IN_PROGRESS:
            log.debug("%s: key %r in progress elsewhere; retry in %.3fs", where, key, delay)
        elif verdict.failure is Failure.DATABASE_UNAVAILABLE:
            log.warning(
                "%s: PostgreSQL unavailable (%s); retrying in %.2fs, attempts not counted",
                where, one_line(error), delay,
            )  # fmt: skip
        elif verdict.failure is Failure.DEAD_LETTER_UNAVAILABLE:
            log.error("%s: %s; retrying in %.2fs", where, error, delay)
        else:
            log.warning(
                "%s failed (attempt %d of %d), retrying in %.2fs: %s",
                where, state.attempts, self.config.max_attempts, delay, one_line(error),
            )  # fmt: skip
        return Outcome.RETRY

    async def _dead_letter_permanent(
        self, message: Message, state: Partition[Message], exc: BaseException
    ) -> None:
        letter = DeadLetter.from_exception(Reason.PERMANENT_ERROR, exc, state.attempts + 1)
        self._metrics.failed.labels(self.config.group, message.topic(), Failure.PERMANENT).inc()
        assert self._dlq is not None
        try:
            await self._dlq.send_message(message, letter)
        except DeadLetterError as unconfirmed:
            raise _Carried(unconfirmed) from unconfirmed

    async def _send_dead_letter(
        self, message: Message, state: Partition[Message], letter: DeadLetter
    ) -> Outcome:
        assert self._dlq is not None
        try:
            await self._dlq.send_message(message, letter)
        except DeadLetterError as exc:
            return await self._dispose(message, state, exc)
        self._count_dead_letter(message, letter.reason)
        log.warning("dead-lettered %s (%s): %s", _where(message), letter.reason, letter.error)
        return Outcome.DEAD_LETTERED

    def _count_dead_letter(self, message: Message, reason: Reason) -> None:
        self._metrics.dead_lettered.labels(self.config.group, message.topic(), reason).inc()

    async def _shutdown(self) -> None:
        consumer = self._consumer
        if consumer is not None:
            try:
                await self._commit(sync=True)
            finally:
                try:
                    await consumer.close()  # leaves the group: partitions move on at once
                except ConsumerError as exc:
                    log.warning("closing the Kafka consumer failed: %s", exc)
                self._consumer = None
        if self._dlq is not None:
            await self._dlq.close()
            self._dlq = None
        self._partitions.clear()
        log.info("consumer of group %r stopped", self.config.group)


class _MissingKey(Exception):
    """Stands for the error of a message that carries no idempotency key."""


class _Carried(BaseException):
    """Carries ``error`` out of a unit of work, which rolls back without recording the key as
    failed: a handler result the key cannot store, or a dead letter the broker did not confirm.

    A BaseException, so that no ``OutboxConfig.permanent_errors`` entry (even ``Exception``) can
    make the unit of work record a failure for such a message.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _store_result(uow: AsyncUnitOfWork, result: Any) -> None:
    """Store the handler's ``result`` with the key, or raise :class:`_Carried` (rolled back)."""
    try:
        uow.result = result
    except SerializationError as exc:
        raise _Carried(
            SerializationError(
                f"the handler's return value cannot be stored as the key's result ({exc}); "
                "return JSON-compatible data (dict, list, str, number, bool or None)"
            )
        ) from exc


async def consume(
    outbox: AsyncOutbox,
    handler: AsyncHandler,
    *,
    install_signal_handlers: bool = True,
    **settings: Any,
) -> None:
    """Run :class:`AsyncConsumerRunner` until SIGTERM or SIGINT (the simple form).

    ``settings`` are the :class:`AsyncConsumerRunner` keywords (``topics``, ``group``,
    ``bootstrap_servers``, ``kafka_config``, ``key_func``...). A signal lets the message in
    hand finish, commits the finished offsets and returns. Signal handlers are installed only
    from the main thread and restored on return.
    """
    runner = AsyncConsumerRunner(outbox, handler, **settings)
    with stop_on_signals(runner.stop, enabled=install_signal_handlers):
        await runner.run()


def is_coroutine_handler(handler: object) -> bool:
    """True when calling ``handler`` returns a coroutine: a coroutine function (also behind
    ``functools.partial`` or as a bound method) or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 -- the method, not callable()
    )


def _describe(partitions: Iterable[tuple[Any, ...]]) -> str:
    parts = [f"{p[0]}[{p[1]}]" for p in partitions]
    return ", ".join(parts) if parts else "nothing"


def _where(message: Message) -> str:
    return f"{message.topic()}[{message.partition()}]@{message.offset()}"
