"""The consumer runner's partitions: messages in hand and the offsets it may commit.

Messages of a partition are worked on strictly in offset order; the head of a partition's backlog
is the message in hand. An offset is committed only behind a *finished* message (last finished +
1), so a commit never passes an unfinished one, and only when it moves past what the broker
already confirmed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from outbox._core.deadletter import DeadLetter

M = TypeVar("M")

TP = tuple[str, int]
"""A partition: ``(topic, partition)``."""


@dataclass
class Partition(Generic[M]):
    """What the runner holds for one assigned partition.

    ``backlog`` keeps received messages in offset order; its head is the message being worked
    on. ``next_offset`` is the offset to commit; ``committed`` the last one the broker confirmed.
    ``attempts`` counts the head's failures against ``max_attempts``; ``waits`` paces retries
    that are not the message's fault and do not count. ``dead_letter`` is the head's dead letter
    once decided, so that a retry only sends it.
    """

    backlog: deque[M] = field(default_factory=deque)
    next_offset: int | None = None
    committed: int | None = None
    attempts: int = 0
    waits: int = 0
    retry_at: float = 0.0
    dead_letter: DeadLetter | None = None

    def finish(self, offset: int) -> None:
        """The head (at ``offset``) is finished: its successor may be committed."""
        self.backlog.popleft()
        self.next_offset = offset + 1
        self.attempts = 0
        self.waits = 0
        self.retry_at = 0.0
        self.dead_letter = None


class Assignment(Generic[M]):
    """The partitions assigned to the runner, by ``(topic, partition)``."""

    def __init__(self) -> None:
        self._partitions: dict[TP, Partition[M]] = {}

    def get(self, tp: TP) -> Partition[M] | None:
        return self._partitions.get(tp)

    def __contains__(self, tp: object) -> bool:
        return tp in self._partitions

    def items(self) -> Iterator[tuple[TP, Partition[M]]]:
        """A snapshot of the partitions: a rebalance may change the assignment meanwhile."""
        return iter(list(self._partitions.items()))

    def assign(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._partitions.setdefault(tp, Partition())

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop ``tps`` with the messages they held (revoked or lost)."""
        for tp in tps:
            self._partitions.pop(tp, None)

    def clear(self) -> None:
        self._partitions.clear()

    def to_commit(self, only: Iterable[TP] | None = None) -> list[tuple[str, int, int]]:
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

    def confirm(self, tp: TP, offset: int) -> None:
        """The broker confirmed a commit of ``offset`` for ``tp``."""
        state = self._partitions.get(tp)
        if state is not None and offset >= 0:
            state.committed = max(state.committed or 0, offset)

    def next_retry(self, now: float, longest: float) -> float:
        """Seconds until a message in hand is due again, at most ``longest``."""
        timeout = longest
        for state in self._partitions.values():
            if state.backlog:
                timeout = min(timeout, max(0.0, state.retry_at - now))
        return timeout
