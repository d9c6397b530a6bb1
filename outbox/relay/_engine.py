"""The seam between the relay's loop and where its batches come from: the engine.

An engine (:class:`Engine`) turns the lanes a relay owns into batches and settles them after
Kafka's reports: the claim engine (:mod:`outbox.relay._claims`, the default) claims rows with
row locks and deletes them; the window engine (:mod:`outbox.relay._window`, ``--engine
window``) reads the rows between two snapshots and moves a cursor. The loop
(:mod:`outbox.relay._relay`) does the rest the same way for both: connection, lanes, the idle
announcement, readiness and the producer. What an engine may use of the relay is :class:`Host`.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import sqlalchemy as sa

from outbox._core.delivery import ClaimedRow, Settlement
from outbox._kafka.producer import DeliveryReport, RecordTuple
from outbox._kafka.records import build_records, build_records_checked
from outbox._pg.relay import OutboxSequence, OutboxStatements
from outbox.config import RelayConfig
from outbox.relay._lanes import LaneOwnership
from outbox.relay._metrics import RelayMetrics
from outbox.relay._producing import Producing


@dataclass
class BatchResult:
    """What one batch did (and, summed up, what the relay did: ``Relay.totals``)."""

    claimed: int = 0
    sent: int = 0
    confirmed: int = 0
    parked: int = 0
    failed: int = 0
    outage: bool = False
    stale_producer: bool = False
    error: str | None = None

    def settled(self, verdict: Settlement, reports: Sequence[DeliveryReport | None]) -> None:
        """Take the counts of a batch's settlement, and the first failure's error."""
        self.confirmed = len(verdict.delete)
        self.parked = verdict.parked
        self.failed = verdict.failed
        self.outage = verdict.outage
        if verdict.failed:
            failures = [o for o in reports if o is not None and not o.ok]
            self.stale_producer = any(o.stale_producer for o in failures)
            self.error = failures[0].error if failures else None


class Reset(enum.Enum):
    """Why an engine forgets what it read ahead (:meth:`Engine.reset`)."""

    REBALANCE = "rebalance"  # the owned lanes changed; the session and its transaction stand
    ROLLBACK = "rollback"  # the transaction in hand was rolled back; the session stands
    RECONNECT = "reconnect"  # the session is gone (and the lanes with it)
    WAKEUP = "wakeup"  # a wake-up came: something may be pending; all else stands


class Host(Protocol):
    """What an engine uses of the relay it feeds: its settings, lanes, metrics and stop signal,
    the outbox table as its session resolved it, its producer, its database thread, and its
    report of a batch."""

    config: RelayConfig
    lanes: LaneOwnership
    metrics: RelayMetrics
    stop_event: threading.Event
    sql: OutboxStatements
    producing: Producing

    @property
    def sequence(self) -> OutboxSequence: ...

    def database_thread(self) -> ThreadPoolExecutor: ...

    def report(
        self,
        rows: Sequence[ClaimedRow],
        reports: Sequence[DeliveryReport | None],
        verdict: Settlement,
        result: BatchResult,
        duration: float,
    ) -> None: ...


class Engine(Protocol):
    """Where a relay's batches come from, and what happens to them after Kafka's reports."""

    def start(self, once: bool) -> None:
        """Called once before the loop (``once``: the relay drains and returns)."""

    def process_batch(self, conn: sa.Connection, result: BatchResult) -> BatchResult:
        """One batch of the owned lanes: produced, settled, committed; ``result`` filled in."""

    def reset(self, reason: Reset) -> None:
        """Forget what was read or claimed ahead (and, per ``reason``, what a new session must
        learn again); the one place an engine's state goes back."""

    def stats(self, conn: sa.Connection) -> dict[str, tuple[int, int, float]]:
        """Per topic, for /metrics: pending rows, parked rows, the oldest pending row's age."""


def records_of(
    rows: Sequence[ClaimedRow],
) -> tuple[Sequence[RecordTuple | None], dict[int, DeliveryReport]]:
    """The rows' records, and the reports of those that cannot become one (by index)."""
    try:
        return build_records(rows), {}
    except Exception:
        records, broken = build_records_checked(rows)
        return records, {i: DeliveryReport(error=e, permanent=True) for i, e in broken.items()}
