"""Where the messages of a consumer micro-batch stand, and which of them are finished.

Invariant: a partition's offset never passes an unfinished message -- :meth:`Slice.finishable`
yields a partition's finished messages in offset order and stops at the first that is not.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from outbox._core.claim import StoredOutcome
from outbox._core.disposition import AttemptVerdict
from outbox._core.offsets import PartitionId, PartitionState

M = TypeVar("M")


class Fate(enum.Enum):
    """Where a message of a micro-batch stands."""

    OPEN = "open"
    """Not decided yet."""
    PENDING = "pending"
    """Its unit of work is in the batch: finished once the batch commits."""
    SETTLED = "settled"
    """Decided without the batch (a replay) but behind a message that waits for it."""
    FINISHED = "finished"
    """Finished and taken off its partition's backlog."""


class Abandoned(Exception):
    """A unit of work of an optimistic batch (no savepoints, statements pipelined) failed: the
    batch is given up as a whole -- nothing of it is recorded or committed, no dead letter is
    sent -- and its messages run again with a savepoint each, where a failure is its own."""


@dataclass(slots=True)
class Entry(Generic[M]):
    """A message of a micro-batch, with its offset and, once read, its key."""

    message: M
    offset: int
    key: str = ""
    fingerprint: str | None = None
    cached: StoredOutcome | None = None  # what Redis holds for the key, if anything
    fate: Fate = Fate.OPEN
    outcome: AttemptVerdict | None = None  # a SETTLED message's outcome


@dataclass(slots=True)
class Slice(Generic[M]):
    """A partition's messages in a micro-batch, in offset order."""

    tp: PartitionId
    state: PartitionState[M]
    entries: list[Entry[M]]

    def is_head(self, entry: Entry[M]) -> bool:
        """True when ``entry`` is its partition's head: every message before it finished."""
        return bool(self.state.backlog) and self.state.backlog[0] is entry.message

    def finishable(self, committed: bool) -> Iterator[tuple[Entry[M], AttemptVerdict]]:
        """The messages finished after the batch (``committed``: its transaction committed),
        with their outcomes, in order and up to the first one that is not."""
        for entry in self.entries:
            if entry.fate is Fate.FINISHED:
                continue
            if entry.fate is Fate.PENDING and committed:
                yield entry, AttemptVerdict.PROCESSED
            elif entry.fate is Fate.SETTLED and entry.outcome is not None:
                yield entry, entry.outcome
            else:
                return


@dataclass(slots=True)
class MicroBatch:
    """What one micro-batch did: whether anything moved, whether its transaction committed, the
    messages it finished (topic and outcome; heads tried alone are only counted) and the
    partitions it dead-lettered in."""

    started: float
    moved: bool = False
    committed: bool = False
    finished: list[tuple[str, AttemptVerdict]] = field(default_factory=list)
    dead_lettered: set[PartitionId] = field(default_factory=set)
    # Heads tried alone (each timed by itself): how many finished, and the time they all took.
    alone: int = 0
    alone_seconds: float = 0.0
