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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from outbox._core import claim, validate as _validate
from outbox._core.batching import Entry, Fate, Round, Slice
from outbox._core.deadletter import DeadLetter, DeadLetterInfo, Reason
from outbox._core.disposition import Action, Disposition, Failure, Key, Outcome, Schedule, classify
from outbox._core.failures import is_permanent
from outbox._core.offsets import TP, Assignment, Partition, Tries
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
    KeyReuseError,
    PreviouslyFailed,
    SerializationError,
)
from outbox.uow_batch_async import AsyncBatch, AsyncMessageBatch

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from outbox.uow_async import AsyncOutbox, AsyncUnitOfWork

__all__ = [
    "ENV_GROUP",
    "ENV_KAFKA_CONFIG",
    "ENV_METRICS_PORT",
    "AsyncConsumerRunner",
    "AsyncHandler",
    "AsyncMessageBatch",
    "ConsumerConfig",
    "ConsumerError",
    "DeadLetterInfo",
    "FingerprintFunc",
    "KeyFunc",
    "Outcome",
    "Reason",
    "backoff_delay",
    "batch_handler",
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
        self._handler: Callable[..., Any] = handler
        self._batch_form = bool(getattr(handler, BATCH_HANDLER, False))
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
                received = await self._consumer.consume(
                    self.config.batch_size, timeout, self.config.batch_wait
                )
                for message in received:
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
        self._metrics.received(self.config.group, topic)

    # -- the work ------------------------------------------------------------------------------
    #
    # A round is one micro-batch: up to batch_size messages from the heads of the partitions
    # that are not waiting (each partition's in offset order). Duplicates the Redis fast path
    # knows are answered without a transaction; the others run in ONE transaction, each in a
    # savepoint (uow_batch_async). A message is *finished* -- its offset may be committed --
    # once everything before it in its partition is finished and it is: replayed, dead-lettered
    # (confirmed), or processed in a batch that committed. A message that must be tried again
    # stops its partition's share of the round; what its attempts came to is kept (its Tries)
    # until it is the head. With batch_size=1 every message is the head and runs in a unit of
    # work of its own.

    async def _work(self) -> None:
        """Work through what was received, a micro-batch at a time, until every partition's
        backlog is empty or waiting for a retry."""
        consumer = self._consumer
        assert consumer is not None
        while not self._stopping.is_set():
            plan = self._partitions.take(self.config.batch_size, time.monotonic())
            if not plan or not await self._round(plan):
                break
            await self._commit_if_due()
        now = time.monotonic()
        for key, state in self._partitions.items():
            if not state.backlog:
                consumer.resume(key)
            elif state.retry_at > now:
                # Its partition waits; the backlog keeps what was received after the head.
                consumer.pause(key)

    async def _round(self, plan: list[tuple[TP, Partition[Message], list[Message]]]) -> bool:
        """One micro-batch; False when nothing moved."""
        rnd = Round(time.perf_counter())
        slices = []
        for tp, state, messages in plan:
            entries = await self._read(rnd, tp, state, messages)
            if entries:
                slices.append(Slice(tp, state, entries))
        cache = self.outbox.cache
        looked_up = [e for sl in slices for e in sl.entries if e.fate is Fate.OPEN]
        if cache is not None and looked_up:
            stored = await cache.get_many(self._scope, [e.key for e in looked_up])
            for entry, outcome in zip(looked_up, stored, strict=True):
                entry.cached = outcome
        for sl in slices:
            await self._answer_from_cache(rnd, sl)
        if any(e.fate is Fate.OPEN for sl in slices for e in sl.entries):
            await self._run_batch(rnd, slices)
        for sl in slices:
            self._settle(rnd, sl)
        self._record(rnd)
        if rnd.dead_lettered:
            # Shrinks the window in which a crash would dead-letter a message a second time.
            await self._commit(sync=True, only=sorted(rnd.dead_lettered))
        return rnd.moved

    async def _read(
        self, rnd: Round, tp: TP, state: Partition[Message], messages: list[Message]
    ) -> list[Entry[Message]]:
        """A partition's messages for the round, keys read, in order. Messages that need no
        unit of work (no usable key, a dead letter decided before) are decided here; a head
        that must run alone (no batches, or a batch of its failed as a whole) runs here."""
        sl = Slice(tp, state, [])
        entries = sl.entries
        for message in messages:
            if self._stopping.is_set() or self._partitions.get(tp) is not state:
                break  # stopping, or revoked while a dead-letter commit served a rebalance
            offset = coordinates(message)[2]
            head = sl.at_head(message)
            tries = state.tries(offset, head)
            if not head and tries.retry_at > time.monotonic():
                break  # tried before in a batch that did not commit: it waits its turn
            if head and (self.config.batch_size == 1 or offset <= state.isolated_to):
                if await self._alone(rnd, tp, state, message):
                    continue
                break
            entry = Entry(message, offset, "", None)
            outcome = await self._decided(message, tries)
            if outcome is None:
                try:
                    key, fingerprint = self._read_key(message)
                    if key is not None:
                        _validate.check_key(key)
                        _validate.check_fingerprint(fingerprint)
                except Exception as exc:
                    outcome = await self._dispose(message, tries, exc, reading=Key.UNREADABLE)
                else:
                    if key is None:
                        outcome = await self._dispose(message, tries, None, reading=Key.MISSING)
                    else:
                        entry.key, entry.fingerprint = key, fingerprint
            if outcome is None:
                entries.append(entry)
            elif not self._place(rnd, sl, entry, outcome):
                break
            else:
                entries.append(entry)
        return entries

    async def _decided(self, message: Message, tries: Tries) -> Outcome | None:
        """The outcome of a message decided before (a dead letter confirmed, or one to send
        now), or None."""
        if tries.done is not None:
            return tries.done
        if tries.dead_letter is not None:  # only the dead letter itself is left to send
            self._heartbeat = time.monotonic()
            return await self._send_dead_letter(message, tries, tries.dead_letter)
        return None

    async def _alone(self, rnd: Round, tp: TP, state: Partition[Message], message: Message) -> bool:
        """Try the head by itself, in a unit of work of its own; True when it finished."""
        self._heartbeat = time.monotonic()
        started = time.perf_counter()
        outcome = None
        try:
            outcome = await self._apply(message, state)
        finally:
            seconds = time.perf_counter() - started
            self._metrics.attempted(self.config.group, tp[0], outcome, seconds)
        rnd.moved = True
        if outcome is Outcome.RETRY:
            return False
        self._pop(tp, state, message)
        if outcome is Outcome.DEAD_LETTERED:
            rnd.dead_lettered.add(tp)
        return True

    async def _answer_from_cache(self, rnd: Round, sl: Slice[Message]) -> None:
        """Duplicates the Redis fast path knows: no transaction for them."""
        for i, entry in enumerate(sl.entries):
            if entry.fate is not Fate.OPEN or entry.cached is None:
                continue
            tries = sl.state.tries(entry.offset, sl.is_head(entry))
            try:
                claim.verdict(self._scope, entry.key, entry.fingerprint, entry.cached, False)
                outcome = await self._dispose(
                    entry.message, tries, None, key=entry.key, replayed=True
                )
            except (KeyReuseError, PreviouslyFailed) as exc:
                self._heartbeat = time.monotonic()
                outcome = await self._dispose(entry.message, tries, exc, key=entry.key)
            if not self._place(rnd, sl, entry, outcome):
                del sl.entries[i:]
                return

    async def _run_batch(self, rnd: Round, slices: list[Slice[Message]]) -> None:
        """The messages that need the database, in one transaction."""
        seen: set[str] = set()
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if entry.key in seen:  # a duplicate within the batch: decided next round
                    del sl.entries[i:]
                    break
                seen.add(entry.key)
        todo = [e for sl in slices for e in sl.entries if e.fate is Fate.OPEN]
        if not todo:
            return
        rnd.moved = True
        try:
            batch = await AsyncBatch.open(self.outbox, self._scope, [e.key for e in todo])
        except Exception as exc:
            await self._batch_failed(slices, exc)
            return
        try:
            if self._batch_form:
                await self._run_group(rnd, batch, slices)
            else:
                await self._run_each(rnd, batch, slices)
            if batch.usable():
                try:
                    await batch.commit()
                except Exception as exc:
                    await self._batch_failed(slices, exc)
        finally:
            await batch.close()
        rnd.committed = batch.committed

    async def _run_each(self, rnd: Round, batch: AsyncBatch, slices: list[Slice[Message]]) -> None:
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if (
                    not batch.usable()
                    or batch.staged_bytes >= _BATCH_BYTES
                    or self._stopping.is_set()
                    or self._partitions.get(sl.tp) is not sl.state
                ):
                    del sl.entries[i:]
                    break
                self._heartbeat = time.monotonic()
                tries = sl.state.tries(entry.offset, sl.is_head(entry))
                outcome = await self._run(entry.message, tries, entry.key, entry.fingerprint, batch)
                if not self._place(rnd, sl, entry, outcome):
                    del sl.entries[i:]
                    break

    async def _run_group(self, rnd: Round, batch: AsyncBatch, slices: list[Slice[Message]]) -> None:
        """A batch handler: the messages whose work must run go to it together, in one
        savepoint; the others (duplicates, keys held elsewhere...) are decided one by one."""
        group: list[tuple[Slice[Message], Entry[Message]]] = []
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if batch.claim(entry.key).runnable:
                    group.append((sl, entry))
                    entry.fate = Fate.PENDING
                    continue
                tries = sl.state.tries(entry.offset, sl.is_head(entry))
                outcome = await self._run(entry.message, tries, entry.key, entry.fingerprint, batch)
                if not self._place(rnd, sl, entry, outcome):
                    del sl.entries[i:]
                    break
        if len(group) == 1:  # alone, a failure is its own
            sl, entry = group[0]
            entry.fate = Fate.OPEN
            tries = sl.state.tries(entry.offset, sl.is_head(entry))
            outcome = await self._run(entry.message, tries, entry.key, entry.fingerprint, batch)
            if not self._place(rnd, sl, entry, outcome):
                del sl.entries[sl.entries.index(entry) :]
            return
        if not group:
            return
        self._heartbeat = time.monotonic()
        try:
            async with batch.units_of_work([(e.key, e.fingerprint) for _, e in group]) as units:
                handed = AsyncMessageBatch(
                    [(u, e.message) for u, (_, e) in zip(units, group, strict=True)]
                )
                results = _batch_results(await self._handler(handed), units)
                for uow, result in zip(units, results, strict=True):
                    _store_result(uow, result)
        except (Exception, _Carried) as exc:
            # One failure for them all: which message caused it is not known. Each is tried
            # alone next, where a failure is its own (counted, dead-lettered as usual).
            error = exc.error if isinstance(exc, _Carried) else exc
            for sl, _entry in group:
                self._metrics.failed.labels(self.config.group, sl.tp[0], Failure.ERROR).inc()
            for sl in {id(sl): sl for sl, _ in group}.values():
                first = next(i for i, e in enumerate(sl.entries) if e.fate is Fate.PENDING)
                del sl.entries[first:]
            if not batch.usable() and database_unavailable(error):
                return  # tried again, in order, once PostgreSQL answers
            for sl, entry in group:
                sl.state.isolated_to = max(sl.state.isolated_to, entry.offset)
            log.warning(
                "a batch handler failed for %d messages; trying them one at a time: %s",
                len(group), one_line(error),
            )  # fmt: skip

    async def _batch_failed(self, slices: list[Slice[Message]], error: Exception) -> None:
        """The batch's transaction failed as a whole (its claim or its commit): nothing of it
        was committed. An outage is waited out by each partition's first message that needs
        it; any other failure cannot be laid at one message's door, so those messages are tried
        one at a time."""
        if database_unavailable(error):
            for sl in slices:
                entry = next((e for e in sl.entries if e.fate is not Fate.FINISHED), None)
                if entry is not None and entry.fate in (Fate.OPEN, Fate.PENDING):
                    tries = sl.state.tries(entry.offset, sl.is_head(entry))
                    await self._dispose(entry.message, tries, error, key=entry.key)
                    del sl.entries[sl.entries.index(entry) + 1 :]
            return
        for sl in slices:
            pending = [e.offset for e in sl.entries if e.fate in (Fate.OPEN, Fate.PENDING)]
            if pending:
                sl.state.isolated_to = max(sl.state.isolated_to, pending[-1])
        log.warning(
            "a batch of %d messages failed as a whole; trying them one at a time: %s",
            sum(len(sl.entries) for sl in slices), one_line(error),
        )  # fmt: skip

    def _place(
        self, rnd: Round, sl: Slice[Message], entry: Entry[Message], outcome: Outcome
    ) -> bool:
        """Note what became of a message of the round; False when its partition stops there."""
        rnd.moved = True
        if outcome is Outcome.RETRY:
            return False
        if outcome is Outcome.PROCESSED:
            entry.fate = Fate.PENDING  # finished once the batch commits
            return True
        if sl.is_head(entry):
            self._finish(rnd, sl.tp, sl.state, entry.message, outcome)
            entry.fate = Fate.FINISHED
        else:  # finished whatever becomes of the batch, once the messages before it are
            entry.fate = Fate.SETTLED
            entry.outcome = outcome
        return True

    def _settle(self, rnd: Round, sl: Slice[Message]) -> None:
        """After the batch: finish the partition's messages in order, up to the first one that
        is not finished (its batch did not commit, it must be tried again, or it was not
        reached)."""
        if self._partitions.get(sl.tp) is not sl.state:
            return  # revoked meanwhile: the new owner replays whatever committed
        for entry, outcome in list(sl.finishable(rnd.committed)):
            self._finish(rnd, sl.tp, sl.state, entry.message, outcome)
            entry.fate = Fate.FINISHED

    def _finish(
        self, rnd: Round, tp: TP, state: Partition[Message], message: Message, outcome: Outcome
    ) -> None:
        """The head ``message`` finished with ``outcome``."""
        self._pop(tp, state, message)
        rnd.finished.append((tp[0], outcome))
        if outcome is Outcome.DEAD_LETTERED:
            rnd.dead_lettered.add(tp)

    @staticmethod
    def _pop(tp: TP, state: Partition[Message], message: Message) -> None:
        """Take the finished head off its partition; the message behind it becomes the head."""
        assert state.backlog and state.backlog[0] is message, f"{tp} finishes out of order"
        following = state.backlog[1] if len(state.backlog) > 1 else None
        state.finish(
            coordinates(message)[2],
            coordinates(following)[2] if following is not None else None,
        )

    def _record(self, rnd: Round) -> None:
        """Metrics of the round's messages: each gets an equal share of the round's time."""
        if not rnd.finished:
            return
        seconds = (time.perf_counter() - rnd.started) / len(rnd.finished)
        for topic, outcome in rnd.finished:
            self._metrics.attempted(self.config.group, topic, outcome, seconds)

    def _read_key(self, message: Message) -> tuple[str | None, str | None]:
        if self._key_func is not None:
            key = self._key_func(message)
        else:
            key = header_key(message, self.config.key_header)
        fingerprint = self._fingerprint_func(message) if self._fingerprint_func else None
        return key, fingerprint

    async def _apply(self, message: Message, tries: Tries) -> Outcome:
        """One attempt at ``message`` in a unit of work of its own: read its key, run the unit
        of work, carry out the verdict."""
        decided = await self._decided(message, tries)
        if decided is not None:
            return decided
        try:
            key, fingerprint = self._read_key(message)
        except Exception as exc:
            return await self._dispose(message, tries, exc, reading=Key.UNREADABLE)
        if key is None:
            return await self._dispose(message, tries, None, reading=Key.MISSING)
        return await self._run(message, tries, key, fingerprint, self.outbox)

    async def _run(
        self,
        message: Message,
        tries: Tries,
        key: str,
        fingerprint: str | None,
        units: AsyncOutbox | AsyncBatch,
    ) -> Outcome:
        """Run ``message``'s unit of work (its own, or one of a batch) and carry out the
        verdict."""
        sent = replayed = False
        try:
            async with units.unit_of_work(key, scope=self._scope, fingerprint=fingerprint) as uow:
                replayed = uow.replayed
                if not replayed:
                    try:
                        result = await self._call(uow, message)
                    except BaseException as exc:
                        if not is_permanent(exc, self._permanent_errors):
                            raise
                        # Dead-letter while the key is still held, before the unit of work
                        # records the failure by the same rule: a key recorded as failed has
                        # always been dead-lettered, so its redeliveries need no second one.
                        await self._dead_letter_permanent(message, tries, exc)
                        sent = True
                        raise
                    _store_result(uow, result)
        except _Carried as exc:
            return await self._dispose(message, tries, exc.error, key=key)
        except Exception as exc:
            return await self._dispose(message, tries, exc, key=key, dead_lettered=sent)
        return await self._dispose(message, tries, None, key=key, replayed=replayed)

    async def _call(self, uow: AsyncUnitOfWork, message: Message) -> Any:
        """The handler's result for ``message`` (a batch handler gets a batch of one)."""
        if not self._batch_form:
            return await self._handler(uow, message)
        return _batch_results(await self._handler(AsyncMessageBatch([(uow, message)])), [uow])[0]

    async def _dispose(
        self,
        message: Message,
        tries: Tries,
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
            attempts=tries.attempts,
            max_attempts=self.config.max_attempts,
            key=reading,
            replayed=replayed,
            dead_lettered=dead_lettered,
            database_unavailable=error is not None and database_unavailable(error),
        )
        if verdict.counts:
            tries.attempts += 1
        if verdict.failure is not None:
            self._metrics.failed.labels(self.config.group, message.topic(), verdict.failure).inc()
        if verdict.action is Action.RETRY:
            assert error is not None
            return self._retry(message, tries, verdict, error, key)
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
                    _where(message), tries.attempts, one_line(error), exc_info=error,
                )  # fmt: skip
            tries.dead_letter = DeadLetter.from_exception(
                verdict.reason, error, max(1, tries.attempts)
            )
            return await self._send_dead_letter(message, tries, tries.dead_letter)
        if verdict.outcome is Outcome.PREVIOUSLY_FAILED:
            log.info(
                "%s: key %r failed permanently earlier and was dead-lettered then; "
                "acknowledged without a second dead letter", _where(message), key,
            )  # fmt: skip
        elif verdict.outcome is Outcome.DEAD_LETTERED:  # confirmed inside the unit of work
            assert error is not None and verdict.reason is not None
            tries.done = Outcome.DEAD_LETTERED
            self._count_dead_letter(message, verdict.reason)
            log.warning("dead-lettered %s (key %r): %s", _where(message), key, one_line(error))
        return verdict.outcome

    def _retry(
        self,
        message: Message,
        tries: Tries,
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
        elif verdict.failure is Failure.DEAD_LETTER_UNAVAILABLE:
            log.error("%s: %s; retrying in %.2fs", where, error, delay)
        else:
            log.warning(
                "%s failed (attempt %d of %d), retrying in %.2fs: %s",
                where, tries.attempts, self.config.max_attempts, delay, one_line(error),
            )  # fmt: skip
        return Outcome.RETRY

    async def _dead_letter_permanent(
        self, message: Message, tries: Tries, exc: BaseException
    ) -> None:
        letter = DeadLetter.from_exception(Reason.PERMANENT_ERROR, exc, tries.attempts + 1)
        self._metrics.failed.labels(self.config.group, message.topic(), Failure.PERMANENT).inc()
        assert self._dlq is not None
        try:
            await self._dlq.send_message(message, letter)
        except DeadLetterError as unconfirmed:
            raise _Carried(unconfirmed) from unconfirmed

    async def _send_dead_letter(
        self, message: Message, tries: Tries, letter: DeadLetter
    ) -> Outcome:
        assert self._dlq is not None
        try:
            await self._dlq.send_message(message, letter)
        except DeadLetterError as exc:
            return await self._dispose(message, tries, exc)
        tries.done = Outcome.DEAD_LETTERED
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


BATCH_HANDLER = "__outbox_batch_handler__"

# A micro-batch takes no more messages once its events hold this many bytes: they are written in
# its last statement, which must not grow without bound.
_BATCH_BYTES = 4 * 1024 * 1024


def batch_handler(handler: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``handler`` as taking a whole micro-batch: ``handler(batch)`` instead of
    ``handler(uow, message)``.

    ``batch`` (:class:`AsyncMessageBatch`) iterates ``(uow, message)`` pairs in partition-offset
    order, each message with its own unit of work; ``batch.connection`` / ``batch.session`` are
    the batch's one transaction, for bulk statements. Set each ``uow.result`` (or return a list
    with one result per message) and publish with ``uow.publish``. Only messages whose work must
    run are in it: duplicates are replayed without it. When it raises, none of its messages is
    committed, and each is then given to it alone (a batch of one), so that the failure lands on
    the message that causes it.
    """
    setattr(handler, BATCH_HANDLER, True)
    return handler


def _batch_results(results: Any, units: Sequence[AsyncUnitOfWork]) -> list[Any]:
    """What a batch handler returned, as one result per unit of work: ``None`` keeps each
    ``uow.result``; a list gives them in order."""
    if results is None:
        return [uow.result for uow in units]
    if isinstance(results, list | tuple) and len(results) == len(units):
        return list(results)
    raise _Carried(
        SerializationError(
            f"a batch handler returns None or a list of {len(units)} result(s), one per "
            f"message, got {type(results).__name__}"
        )
    )


class _MissingKey(Exception):
    """Stands for the error of a message that carries no idempotency key."""


class _Carried(BaseException):
    """Carries ``error`` out of a unit of work, which rolls back without recording the key as
    failed: a handler result the key cannot store, or a dead letter the broker did not confirm.

    A BaseException, so that no ``OutboxConfig.permanent_errors`` entry (even ``Exception``) can
    make the unit of work record a failure for such a message.
    """

    def __init__(self, error: BaseException) -> None:
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
