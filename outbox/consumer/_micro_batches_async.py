"""Micro-batches: which of a runner's messages share one PostgreSQL transaction.

Invariant: a message is finished -- its offset may be committed -- only once every message
before it in its partition is finished and it was replayed, dead-lettered (confirmed), or
processed in a transaction that committed; a message to be tried again stops its partition's
share of the micro-batch.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from outbox._core import claim
from outbox._core.batching import Abandoned, Entry, Fate, MicroBatch, Slice
from outbox._core.disposition import AttemptVerdict, Failure
from outbox._core.offsets import Assignment, PartitionId, PartitionState, Tries
from outbox._core.redact import one_line
from outbox._kafka.consumer import Message, coordinates
from outbox._otel import spans
from outbox._pg.errors import database_unavailable
from outbox.config import ConsumerConfig
from outbox.consumer._attempt_async import AsyncAttempts, AsyncGuardedAttempts
from outbox.consumer._attempt_base import Carried
from outbox.consumer._lanes import lanes_of, run_lanes_async
from outbox.consumer._metrics import ConsumerMetrics
from outbox.consumer._micro_batches_base import MicroBatchesBase
from outbox.errors import KeyReuseError, PreviouslyFailed
from outbox.uow import AsyncBatch

log = logging.getLogger("outbox.consumer")

# A micro-batch takes no more messages once its events hold this many bytes: they are written in
# its last statement, which must not grow without bound.
_BATCH_BYTES = 4 * 1024 * 1024


class AsyncMicroBatches(MicroBatchesBase):
    """Runs micro-batches over a runner's partitions (:meth:`run`), one at a time."""

    def __init__(
        self,
        attempts: AsyncAttempts | AsyncGuardedAttempts,
        config: ConsumerConfig,
        partitions: Assignment[Message],
        metrics: ConsumerMetrics,
        *,
        stopping: threading.Event,
        beat: Callable[[], None],
    ) -> None:
        super().__init__(config, partitions, metrics, stopping=stopping, beat=beat)
        self._attempts = attempts

    async def run(
        self, plan: list[tuple[PartitionId, PartitionState[Message], list[Message]]]
    ) -> MicroBatch:
        """One micro-batch. ``mb.moved`` is False when nothing moved; ``mb.dead_lettered``
        names the partitions whose offsets the runner should commit at once."""
        mb = MicroBatch(time.perf_counter())
        self._attempts.traced = spans is not None and spans.recording()
        if self.config.concurrency > 1:
            await self._run_lanes(mb, plan)
            self._record(mb)
            return mb
        slices = []
        for tp, state, messages in plan:
            sl = await self._read(mb, Slice(tp, state, []), messages)
            if sl.entries:
                slices.append(sl)
        cache = self._attempts.cache
        looked_up = [e for sl in slices for e in sl.entries if e.fate is Fate.OPEN]
        if cache is not None and looked_up:
            stored = await cache.get_many(self._scope, [e.key for e in looked_up])
            for entry, cached in zip(looked_up, stored, strict=True):
                entry.cached = cached
        for sl in slices:
            await self._answer_from_cache(mb, sl)
        attempts = self._attempts
        # Only units of work share a transaction: under the guard (batch_size=1) every message
        # ran alone, in _read.
        if isinstance(attempts, AsyncAttempts) and any(
            e.fate is Fate.OPEN for sl in slices for e in sl.entries
        ):
            await self._run_batch(mb, slices, attempts)
        for sl in slices:
            self._settle(mb, sl)
        self._record(mb)
        return mb

    async def _read(
        self, mb: MicroBatch, sl: Slice[Message], messages: list[Message]
    ) -> Slice[Message]:
        """A partition's messages for the micro-batch, keys read, in order. Messages that need
        no unit of work (no usable key, a dead letter decided before) are decided here; a head
        that must run alone (no batches, or a batch of its failed as a whole) runs here."""
        state = sl.state
        for message in messages:
            if self._stopping.is_set() or self._partitions.get(sl.tp) is not state:
                break  # stopping, or revoked while a dead-letter commit served a rebalance
            entry = Entry(message, coordinates(message)[2])
            head = sl.is_head(entry)
            tries = state.tries(entry.offset, head)
            if not head and tries.retry_at > time.monotonic():
                break  # tried before in a batch that did not commit: it waits its turn
            alone = entry.offset <= state.isolated_to or entry.offset == state.alone_at
            if head and (self.config.batch_size == 1 or alone):
                if await self._alone(mb, sl, entry):
                    continue
                break
            if entry.offset == state.alone_at:
                break  # its failure cost its chunk once: it runs alone once it is the head
            read = await self._attempts.read(message, tries, validate=True)
            if isinstance(read, AttemptVerdict):
                if not self._place(mb, sl, entry, read):
                    break
            else:
                entry.key, entry.fingerprint = read
            sl.entries.append(entry)
        return sl

    async def _alone(self, mb: MicroBatch, sl: Slice[Message], entry: Entry[Message]) -> bool:
        """Try the head by itself, in a unit of its own; True when it finished."""
        self._beat()
        started = time.perf_counter()
        outcome = None
        try:
            outcome = await self._attempts.apply(entry.message, sl.state)
        finally:
            seconds = time.perf_counter() - started
            mb.alone_seconds += seconds
            self._metrics.attempted(self.config.group, sl.tp[0], outcome, seconds)
        mb.moved = True
        if outcome is AttemptVerdict.RETRY:
            return False
        mb.alone += 1
        self._pop(sl, entry)
        if outcome is AttemptVerdict.DEAD_LETTERED:
            mb.dead_lettered.add(sl.tp)
        return True

    async def _run_lanes(
        self, mb: MicroBatch, plan: list[tuple[PartitionId, PartitionState[Message], list[Message]]]
    ) -> None:
        """Key-ordered concurrency: every message in a unit of work of its own (as with
        ``batch_size=1``), up to ``concurrency`` at once; a partition's messages of one Kafka
        key in offset order, a lane stopping at its first message to be tried again. Then each
        partition's messages are finished in offset order up to the first that is not: its
        offset is the watermark below which every message is done."""
        slices: list[Slice[Message]] = []
        lanes: list[list[tuple[Slice[Message], Entry[Message], Tries]]] = []
        for tp, state, messages in plan:
            sl = Slice(tp, state, [Entry(m, coordinates(m)[2]) for m in messages])
            slices.append(sl)
            # Tries are taken here, before any lane runs: the lanes never change the dict.
            queued = [(sl, e, state.tries(e.offset, sl.is_head(e))) for e in sl.entries]
            lanes += lanes_of(queued, lambda q: q[1].message.key())

        async def lane(queued: list[tuple[Slice[Message], Entry[Message], Tries]]) -> None:
            for sl, entry, tries in queued:
                if (
                    self._stopping.is_set()
                    or self._partitions.get(sl.tp) is not sl.state
                    or tries.retry_at > time.monotonic()
                ):
                    return  # stopping, revoked, or waiting for its retry: the lane stops
                self._beat()
                started = time.perf_counter()
                try:
                    entry.outcome = await self._attempts.apply(entry.message, tries)
                finally:
                    self._metrics.attempted(
                        self.config.group, sl.tp[0], entry.outcome, time.perf_counter() - started
                    )
                mb.moved = True
                if entry.outcome is AttemptVerdict.RETRY:
                    return  # the key's later messages wait for it

        await run_lanes_async([functools.partial(lane, q) for q in lanes], self.config.concurrency)
        for sl in slices:
            if self._partitions.get(sl.tp) is not sl.state:
                continue  # revoked meanwhile: the new owner replays whatever committed
            for entry in sl.entries:
                if entry.outcome is None or entry.outcome is AttemptVerdict.RETRY:
                    break  # the messages after it that finished are replays when they come again
                mb.alone += 1
                self._pop(sl, entry)
                if entry.outcome is AttemptVerdict.DEAD_LETTERED:
                    mb.dead_lettered.add(sl.tp)

    async def _answer_from_cache(self, mb: MicroBatch, sl: Slice[Message]) -> None:
        """Duplicates the Redis fast path knows: no transaction for them."""
        for i, entry in enumerate(sl.entries):
            if entry.fate is not Fate.OPEN or entry.cached is None:
                continue
            tries = sl.state.tries(entry.offset, sl.is_head(entry))
            try:
                claim.verdict(self._scope, entry.key, entry.fingerprint, entry.cached, False)
                outcome = await self._attempts.dispose(
                    entry.message,
                    tries,
                    None,
                    key=entry.key,
                    replayed=True,
                    answered_by="redis",
                )
            except (KeyReuseError, PreviouslyFailed) as exc:
                self._beat()
                outcome = await self._attempts.dispose(entry.message, tries, exc, key=entry.key)
            if not self._place(mb, sl, entry, outcome):
                del sl.entries[i:]
                return

    async def _run_batch(
        self, mb: MicroBatch, slices: list[Slice[Message]], attempts: AsyncAttempts
    ) -> None:
        """The messages that need the database, in one transaction."""
        seen: set[str] = set()
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if entry.key in seen:  # a duplicate within the batch: decided in the next one
                    del sl.entries[i:]
                    break
                seen.add(entry.key)
        todo = [e for sl in slices for e in sl.entries if e.fate is Fate.OPEN]
        if not todo:
            return
        mb.moved = True
        # Optimistic: no savepoints, statements pipelined -- unless a message of the batch is
        # one an optimistic batch failed for, which must learn whose failure it was.
        optimistic = (
            self.config.optimistic
            and not attempts.batch_form
            and all(e.offset > sl.state.careful_to for sl in slices for e in sl.entries)
        )
        try:
            batch = await AsyncBatch.open(
                attempts.outbox, self._scope, [e.key for e in todo],
                chunk=self.config.savepoint_chunk, optimistic=optimistic,
            )  # fmt: skip
        except Exception as exc:
            await self._batch_failed(slices, exc)
            return
        try:
            if attempts.batch_form:
                await self._run_group(mb, attempts, batch, slices)
            else:
                await self._run_each(mb, attempts, batch, slices)
            if batch.abandoned:
                self._abandon(slices)
            elif batch.usable():
                try:
                    await batch.commit()
                except Exception as exc:
                    if optimistic and not database_unavailable(exc):
                        self._abandon(slices)
                    else:
                        await self._batch_failed(slices, exc)
        finally:
            await batch.close()
        mb.committed = batch.committed

    async def _run_each(
        self,
        mb: MicroBatch,
        attempts: AsyncAttempts,
        batch: AsyncBatch,
        slices: list[Slice[Message]],
    ) -> None:
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if (
                    not batch.usable()
                    or batch.staged_bytes >= _BATCH_BYTES
                    or batch.full()
                    or self._stopping.is_set()
                    or self._partitions.get(sl.tp) is not sl.state
                ):
                    del sl.entries[i:]
                    break
                self._beat()
                placed = await self._run_one(mb, attempts, batch, sl, entry)
                if batch.abandoned:
                    return  # every partition's share runs again: see _abandon
                lost = batch.take_lost()
                if lost:
                    # It failed in the savepoint it shared with them: they run again in the
                    # next batch, and it alone.
                    sl.state.alone_at = entry.offset
                    if self._cut(slices, set(lost), sl):
                        break
                if not placed:
                    del sl.entries[i:]
                    break

    async def _run_one(
        self,
        mb: MicroBatch,
        attempts: AsyncAttempts,
        batch: AsyncBatch,
        sl: Slice[Message],
        entry: Entry[Message],
    ) -> bool:
        """Run one message in a savepoint of ``batch`` and place it; False when its partition
        stops there."""
        tries = sl.state.tries(entry.offset, sl.is_head(entry))
        runnable = batch.lookup(entry.key).runnable
        if not runnable:  # a replay, or a key held elsewhere: no unit of work to run
            decided = await attempts.decided(
                entry.message, tries, entry.key, entry.fingerprint, batch
            )
            if decided is not None:
                return self._place(mb, sl, entry, decided)
        try:
            # Only a key whose work runs can fail for a reason not known without the database.
            if batch.optimistic and runnable:
                outcome = await attempts.run_optimistic(
                    entry.message, tries, entry.key, entry.fingerprint, batch
                )
            else:
                outcome = await attempts.run(entry.message, tries, entry.key, entry.fingerprint,
                                             batch)  # fmt: skip
        except Abandoned:
            return False  # the batch is given up: see _abandon
        return self._place(mb, sl, entry, outcome)

    async def _run_group(
        self,
        mb: MicroBatch,
        attempts: AsyncAttempts,
        batch: AsyncBatch,
        slices: list[Slice[Message]],
    ) -> None:
        """A batch handler: the messages whose work must run go to it together, in one
        savepoint; the others (duplicates, keys held elsewhere...) are decided one by one."""
        group: list[tuple[Slice[Message], Entry[Message]]] = []
        for sl in slices:
            for i, entry in enumerate(sl.entries):
                if entry.fate is not Fate.OPEN:
                    continue
                if batch.lookup(entry.key).runnable:
                    group.append((sl, entry))
                    entry.fate = Fate.PENDING
                    continue
                if not await self._run_one(mb, attempts, batch, sl, entry):
                    del sl.entries[i:]
                    break
        if len(group) == 1:  # alone, a failure is its own
            sl, entry = group[0]
            entry.fate = Fate.OPEN
            if not await self._run_one(mb, attempts, batch, sl, entry):
                del sl.entries[sl.entries.index(entry) :]
            return
        if not group:
            return
        self._beat()
        try:
            async with batch.units_of_work([(e.key, e.fingerprint) for _, e in group]) as units:
                await attempts.run_group(units, [e.message for _, e in group])
        except (Exception, Carried) as exc:
            # One failure for them all: which message caused it is not known. Each is tried
            # alone next, where a failure is its own (counted, dead-lettered as usual).
            error = exc.error if isinstance(exc, Carried) else exc
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
                    await self._attempts.dispose(entry.message, tries, error, key=entry.key)
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
