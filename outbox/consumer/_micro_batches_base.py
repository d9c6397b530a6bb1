"""What both flavours of the micro-batches (:mod:`outbox.consumer._micro_batches_async` and its
sync twin) share: the bookkeeping of a batch's messages -- where each one stands, which
partition's share is cut, what is finished and counted. Nothing here waits, so it is written
once, not generated."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from outbox._core.batching import Entry, Fate, MicroBatch, Slice
from outbox._core.disposition import AttemptVerdict
from outbox._core.offsets import Assignment
from outbox._kafka.consumer import Message, coordinates
from outbox.config import ConsumerConfig
from outbox.consumer._metrics import ConsumerMetrics

log = logging.getLogger("outbox.consumer")


class MicroBatchesBase:
    """A runner's partitions and settings, and the decisions on a micro-batch's messages."""

    def __init__(
        self,
        config: ConsumerConfig,
        partitions: Assignment[Message],
        metrics: ConsumerMetrics,
        *,
        stopping: threading.Event,
        beat: Callable[[], None],
    ) -> None:
        self.config = config
        self._scope = config.effective_scope
        self._partitions = partitions
        self._metrics = metrics
        self._stopping = stopping
        self._beat = beat

    def _abandon(self, slices: list[Slice[Message]]) -> None:
        """An optimistic batch failed (a handler, or a pipelined statement whose message is not
        known): nothing of it was recorded or sent. Each partition's share runs again from its
        first message the batch held, with a savepoint per message; no attempt is counted."""
        held = 0
        for sl in slices:
            first = next(
                (i for i, e in enumerate(sl.entries) if e.fate in (Fate.OPEN, Fate.PENDING)),
                None,
            )
            if first is None:
                continue
            held += len(sl.entries) - first
            sl.state.careful_to = max(sl.state.careful_to, sl.entries[-1].offset)
            del sl.entries[first:]
        log.info(
            "an optimistic batch failed; its %d messages run again with a savepoint each", held
        )

    @staticmethod
    def _cut(slices: list[Slice[Message]], lost: set[str], current: Slice[Message]) -> bool:
        """Cut every partition's share of the batch at its first message whose unit of work was
        lost, so that its order holds; True when ``current`` was cut."""
        cut = False
        for sl in slices:
            first = next(
                (i for i, e in enumerate(sl.entries) if e.fate is Fate.PENDING and e.key in lost),
                None,
            )
            if first is not None:
                del sl.entries[first:]
                cut = cut or sl is current
        return cut

    def _place(
        self, mb: MicroBatch, sl: Slice[Message], entry: Entry[Message], outcome: AttemptVerdict
    ) -> bool:
        """Note what became of a message of the micro-batch; False when its partition stops
        there."""
        mb.moved = True
        if outcome is AttemptVerdict.RETRY:
            return False
        if outcome is AttemptVerdict.PROCESSED:
            entry.fate = Fate.PENDING  # finished once the batch commits
            return True
        if sl.is_head(entry):
            self._finish(mb, sl, entry, outcome)
            entry.fate = Fate.FINISHED
        else:  # finished whatever becomes of the batch, once the messages before it are
            entry.fate = Fate.SETTLED
            entry.outcome = outcome
        return True

    def _settle(self, mb: MicroBatch, sl: Slice[Message]) -> None:
        """After the batch: finish the partition's messages in order, up to the first one that
        is not finished (its batch did not commit, it must be tried again, or it was not
        reached)."""
        if self._partitions.get(sl.tp) is not sl.state:
            return  # revoked meanwhile: the new owner replays whatever committed
        for entry, outcome in list(sl.finishable(mb.committed)):
            self._finish(mb, sl, entry, outcome)
            entry.fate = Fate.FINISHED

    def _finish(
        self, mb: MicroBatch, sl: Slice[Message], entry: Entry[Message], outcome: AttemptVerdict
    ) -> None:
        """The head ``entry`` finished with ``outcome``."""
        self._pop(sl, entry)
        mb.finished.append((sl.tp[0], outcome))
        if outcome is AttemptVerdict.DEAD_LETTERED:
            mb.dead_lettered.add(sl.tp)

    @staticmethod
    def _pop(sl: Slice[Message], entry: Entry[Message]) -> None:
        """Take the finished head off its partition; the message behind it becomes the head."""
        backlog = sl.state.backlog
        assert backlog and backlog[0] is entry.message, f"{sl.tp} finishes out of order"
        following = coordinates(backlog[1])[2] if len(backlog) > 1 else None
        sl.state.finish(entry.offset, following)

    def _record(self, mb: MicroBatch) -> None:
        """Metrics of the micro-batch: its size and time; each message finished in it (but those
        tried alone, timed by themselves) gets an equal share of the rest of its time."""
        total = time.perf_counter() - mb.started
        if mb.finished or mb.alone:
            self._metrics.batch(self.config.group, len(mb.finished) + mb.alone, total)
        if not mb.finished:
            return
        seconds = max(0.0, total - mb.alone_seconds) / len(mb.finished)
        for (topic, outcome), count in collections.Counter(mb.finished).items():
            self._metrics.attempted_many(self.config.group, topic, outcome, seconds, count)
