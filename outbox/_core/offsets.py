"""The consumer runner's partitions: messages in hand and the offsets it may commit.

Messages of a partition are worked on strictly in offset order; the head of a partition's backlog
is the message in hand. An offset is committed only behind a *finished* message (last finished +
1), so a commit never passes an unfinished one, and only when it moves past what the broker
already confirmed.

A micro-batch takes messages from the heads of the partitions that are not waiting for a retry
(:meth:`Assignment.take`), shared out evenly (:func:`fair_shares`) so that one busy partition
cannot crowd out the others.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from outbox._core.deadletter import DeadLetter
from outbox._core.disposition import AttemptVerdict

M = TypeVar("M")

PartitionId = tuple[str, int]
"""Which partition: ``(topic, partition)`` (:class:`PartitionState` is what the runner holds for
one)."""


@dataclass
class Tries:
    """What the attempts at one unfinished message came to so far.

    ``attempts`` counts its failures against ``max_attempts``; ``waits`` paces retries that are
    not the message's fault and do not count; ``retry_at`` is when it may be tried again.
    ``dead_letter`` is its dead letter once decided, so that a retry only sends it. ``done`` is
    set once the message is dead-lettered (the broker confirmed) while a message before it is
    not finished yet: it is never tried again, and finishes when its turn comes.
    """

    attempts: int = 0
    waits: int = 0
    retry_at: float = 0.0
    dead_letter: DeadLetter | None = None
    done: AttemptVerdict | None = None


@dataclass
class PartitionState(Tries, Generic[M]):
    """What the runner holds for one assigned partition; its own :class:`Tries` are the head's.

    ``backlog`` keeps received messages in offset order; its head is the message being worked
    on, and the partition waits while the head's ``retry_at`` lies ahead. A micro-batch also
    tries messages behind the head: what their attempts came to is kept in ``ahead``, by
    offset, until they become the head. ``next_offset`` is the offset to commit; ``committed``
    the last one the broker confirmed. Messages up to offset ``isolated_to`` run one per
    transaction: a batch of theirs failed as a whole, and alone each failure is its own. The
    message at ``alone_at`` runs by itself too: its failure rolled back the others of its
    savepoint once, and must not do so again. Messages up to offset ``careful_to`` run with a
    savepoint each: an optimistic batch of theirs (no savepoints, statements pipelined) failed,
    and which of them failed is learnt only that way.
    """

    backlog: deque[M] = field(default_factory=deque)
    next_offset: int | None = None
    committed: int | None = None
    isolated_to: int = -1
    alone_at: int = -1
    careful_to: int = -1
    ahead: dict[int, Tries] = field(default_factory=dict)

    def finish(self, offset: int, next_head: int | None = None) -> None:
        """The head (at ``offset``) is finished: its successor may be committed. The tries of
        the message behind it (at ``next_head``), if any were kept, become the head's."""
        self.backlog.popleft()
        self.next_offset = offset + 1
        tries = self.ahead.pop(next_head, None) if next_head is not None else None
        if tries is None:
            tries = Tries()
        self.attempts = tries.attempts
        self.waits = tries.waits
        self.retry_at = tries.retry_at
        self.dead_letter = tries.dead_letter
        self.done = tries.done

    def tries(self, offset: int, head: bool) -> Tries:
        """The tries of the message at ``offset``: the partition's own for the head."""
        return self if head else self.ahead.setdefault(offset, Tries())


class Assignment(Generic[M]):
    """The partitions assigned to the runner, by ``(topic, partition)``."""

    def __init__(self) -> None:
        self._partitions: dict[PartitionId, PartitionState[M]] = {}

    def get(self, tp: PartitionId) -> PartitionState[M] | None:
        return self._partitions.get(tp)

    def __contains__(self, tp: object) -> bool:
        return tp in self._partitions

    def items(self) -> Iterator[tuple[PartitionId, PartitionState[M]]]:
        """A snapshot of the partitions: a rebalance may change the assignment meanwhile."""
        return iter(list(self._partitions.items()))

    def assign(self, tps: Iterable[PartitionId]) -> None:
        for tp in tps:
            self._partitions.setdefault(tp, PartitionState())

    def forget(self, tps: Iterable[PartitionId]) -> None:
        """Drop ``tps`` with the messages they held (revoked or lost)."""
        for tp in tps:
            self._partitions.pop(tp, None)

    def clear(self) -> None:
        self._partitions.clear()

    def to_commit(self, only: Iterable[PartitionId] | None = None) -> list[tuple[str, int, int]]:
        """``(topic, partition, offset)`` for each partition (of ``only``) whose finished
        messages are not all committed yet."""
        tps = list(only) if only is not None else list(self._partitions)
        offsets = []
        for tp in tps:
            state = self._partitions.get(tp)
            if (
                state is not None
                and state.next_offset is not None
                and (state.committed is None or state.next_offset > state.committed)
            ):
                offsets.append((tp[0], tp[1], state.next_offset))
        return offsets

    def lags(
        self, highs: Mapping[PartitionId, int], offset_of: Callable[[M], int]
    ) -> list[tuple[str, int, int]]:
        """``(topic, partition, lag)`` for each assigned partition with a known high watermark
        (``highs``) and a known position: the next offset to commit, else the last one the
        broker confirmed, else the offset (``offset_of``) of the message in hand -- a partition
        stuck on its first message since it was assigned lags too. The lag is how many messages
        from there on are not finished (never negative)."""
        lags = []
        for tp, state in self._partitions.items():
            high = highs.get(tp)
            if high is None or high < 0:
                continue
            position = state.next_offset if state.next_offset is not None else state.committed
            if position is None and state.backlog:
                position = offset_of(state.backlog[0])
            if position is None:  # nothing received, finished or committed here yet
                continue
            lags.append((tp[0], tp[1], max(0, high - position)))
        return lags

    def confirm(self, tp: PartitionId, offset: int) -> None:
        """The broker confirmed a commit of ``offset`` for ``tp``."""
        state = self._partitions.get(tp)
        if state is not None and offset >= 0:
            state.committed = max(state.committed or 0, offset)

    def take(self, limit: int, now: float) -> list[tuple[PartitionId, PartitionState[M], list[M]]]:
        """Up to ``limit`` messages from the heads of the partitions not waiting for a retry,
        each partition's in offset order, shared out by :func:`fair_shares`."""
        ready = [(tp, s) for tp, s in self._partitions.items() if s.backlog and s.retry_at <= now]
        shares = fair_shares([len(s.backlog) for _, s in ready], limit)
        return [
            (tp, s, list(itertools.islice(s.backlog, n)))
            for (tp, s), n in zip(ready, shares, strict=True)
            if n
        ]

    def next_retry(self, now: float, longest: float) -> float:
        """Seconds until a message in hand is due again, at most ``longest``."""
        timeout = longest
        for state in self._partitions.values():
            if state.backlog:
                timeout = min(timeout, max(0.0, state.retry_at - now))
        return timeout


def fair_shares(sizes: list[int], limit: int) -> list[int]:
    """How many of ``sizes[i]`` waiting messages to take from each partition, ``limit`` in all:
    as even as can be -- a partition gets less than another only when it has no more -- and
    the remainder of an uneven split goes to the partitions with the most waiting."""
    shares = [0] * len(sizes)
    left = limit
    by_size = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for rank, i in enumerate(by_size):
        shares[i] = min(sizes[i], left // (len(by_size) - rank))
        left -= shares[i]
    return shares
