"""The claim engine (the default): batches claimed with row locks, deleted once confirmed.

A batch of the owned lanes is claimed ``FOR UPDATE NOWAIT``, or ``SKIP LOCKED`` once another
transaction's lock got in the way (:mod:`outbox._pg.relay`); it is produced, every delivery
report awaited, the confirmed rows deleted in one statement and the failures recorded in
another, then committed. While a full batch's records are handed to the producer and Kafka
confirms them, the relay's database thread deletes its rows in a savepoint and claims the next
batch, so that the database works while the producer and the broker do; the transaction commits
as it is only when every row was confirmed, else it rolls back to the savepoint and settles row
by row. A row leaves the outbox only with a commit that follows its delivery report.

Claims start at the low-water mark (:mod:`outbox._core.lowwater`), whose assumptions are
checked on every claim. Once a claim found nothing, the polls that follow (the fallback timer's,
while no wake-up came) first ask in one statement whether anything is pending at the mark, with
the mark's facts checked in the same statement, and claim only if so: an idle database's poll
is that one statement instead of the readings' three and the claim. All that a claim carries
from one batch to the next -- the batch claimed ahead, whether locks got in the way lately, the
mark, whether the last claim found nothing -- goes back in :meth:`reset`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import sqlalchemy as sa

from outbox._core.delivery import (
    ATTEMPTS,
    ID,
    KEY,
    SKIPPED,
    TOPIC,
    ClaimedRow,
    settle,
    single_round,
    split_claim,
)
from outbox._core.lowwater import Assumptions, Facts, LowWater, Verdict, verify
from outbox._kafka.producer import DeliveryReport, RecordTuple
from outbox._pg.relay import (
    outbox_claim_batch,
    outbox_delete_between_savepoints,
    outbox_delete_confirmed,
    outbox_low_water,
    outbox_low_water_facts,
    outbox_pending,
    outbox_record_failures,
    outbox_rollback_to,
    outbox_stats,
)
from outbox.relay._engine import BatchResult, Host, Reset, records_of

log = logging.getLogger("outbox.relay")

# Rows claimed between two moves of the low-water mark, at most (a claim's walk from the mark
# passes the index entries of the rows deleted since it moved: so many, while the readings
# that move it cost the server a copy of every lock it holds).
ADVANCE_ROWS = 64


@dataclass
class _Batch:
    """A claimed batch: the rows it locked, those it may send now (the claim rule), their
    records, and the rows that cannot become records (by index into ``rows``)."""

    claimed: list[ClaimedRow]
    rows: list[ClaimedRow]
    records: Sequence[RecordTuple | None]
    unsendable: dict[int, DeliveryReport]

    @classmethod
    def of(cls, fetched: Sequence[ClaimedRow]) -> _Batch:
        claimed, rows = split_claim(fetched)
        records, unsendable = records_of(rows)
        return cls(claimed, rows, records, unsendable)


class ClaimEngine:
    """Where a claim relay's batches come from, and their delete after delivery."""

    def __init__(self, relay: Host) -> None:
        self.relay = relay
        self.config = relay.config
        self.sql = relay.sql
        # Claim without skipping until another transaction's lock gets in the way; then claim
        # the careful way until a claim skips nothing again (outbox._pg.relay).
        self._contended = False
        # What the mark rests on, checked on every claim (kept across reconnects: other
        # backends' cached sequence values are).
        self._assumptions = Assumptions()
        # Where claims start; the mark a claim ahead computed inside the batch transaction
        # counts only once that transaction committed as it is (it saw the batch's own
        # uncommitted delete).
        self._low = LowWater()
        self._low_ahead: LowWater | None = None
        # Rows claimed since the mark last moved (see _claim).
        self._since_advance = 0
        # The next batch, claimed while Kafka confirmed the previous one (see process_batch).
        self._ahead: _Batch | None = None
        # The last claim found nothing, from a mark it moved: until a wake-up, a rollback or
        # other lanes, a poll asks whether anything is pending at that mark before it claims.
        self._idle = False

    def start(self, once: bool) -> None:
        pass

    def reset(self, reason: Reset) -> None:
        """Drop the batch claimed ahead (its rows may be another relay's after a rebalance, its
        claim is gone after a rollback) with the mark it computed; with the session, the mark
        in force too: claims start from the low end again once the lanes are back. A wake-up
        only ends the cheap polls of an idle relay: the next poll claims."""
        self._idle = False
        if reason is Reset.WAKEUP:
            return
        self._ahead = self._low_ahead = None
        if reason is Reset.RECONNECT:
            self._low = LowWater()

    def stats(self, conn: sa.Connection) -> dict[str, tuple[int, int, float]]:
        # Rows below the mark are gone when this relay owns every lane: count from the mark.
        owned = self.relay.lanes.owned
        every_lane = (
            self._low.lanes == frozenset(owned) and len(self._low.lanes) == self.config.lanes
        )
        stats = outbox_stats(conn, self.sql, self._low.low if every_lane else 0)
        return {t: (s.backlog, s.parked, s.oldest_age) for t, s in stats.items()}

    # ------------------------------------------------------------------------------- claim

    def _claim(
        self, conn: sa.Connection, *, uncontended: bool, savepoint: str | None = None
    ) -> list[ClaimedRow] | None:
        owned = sorted(self.relay.lanes.owned)
        sequence = self.relay.sequence
        mark = self._low.for_lanes(owned)
        # Move the mark on a claim ahead, on the first claim of these lanes, and once the
        # claims since it last moved took ADVANCE_ROWS rows; in between, start from the mark
        # in force, with only its facts read and checked (every row that may still be sent
        # lies at or above it while they hold): the readings that move it copy every lock of
        # the server, and the rows deleted since it moved are few.
        advance = (
            savepoint is not None
            or mark is not self._low
            or mark.drawn is None
            or self._since_advance >= ADVANCE_ROWS
        )
        writers: list[str] = []
        first_live: int | None = None
        if advance:
            facts, writers, first_live = outbox_low_water(
                conn,
                self.sql,
                sequence,
                lanes=self.config.lanes,
                owned=owned,
                low=mark.low,
                watch=self._assumptions.watch,
            )
        else:
            facts = outbox_low_water_facts(conn, self.sql, sequence, watch=self._assumptions.watch)
        verdict = self._verified(facts, fresh=savepoint is None)
        low = 0
        if verdict.usable and not verdict.restart:
            if advance:
                mark = mark.advance(facts.drawn or 0, writers, first_live)
                if savepoint is None:
                    self._since_advance = 0
            low = mark.low
        else:
            # From the low end, and a new mark from there (as after a restart); the mark in
            # force is dropped too, so that a claim ahead rolled back cannot bring it back.
            mark = self._low = LowWater().for_lanes(owned)
        if savepoint is None:
            self._low = mark  # read before this transaction changed anything
        else:
            self._low_ahead = mark
        fetched = outbox_claim_batch(
            conn,
            self.sql,
            lanes=self.config.lanes,
            owned=owned,
            batch_size=self.config.batch_size,
            low=low,
            uncontended=uncontended,
            savepoint=savepoint,
        )
        if fetched is not None:
            self._since_advance += len(fetched)
        return fetched

    def _verified(self, facts: Facts, *, fresh: bool) -> Verdict:
        """Check the facts a claim or a poll read (:func:`outbox._core.lowwater.verify`),
        remember what the next check needs, and log what changed."""
        sequence = self.relay.sequence
        verdict = verify(
            self._assumptions,
            facts,
            fresh=fresh,
            sequence=sequence.sequence_name or f"{self.sql.table}.id",
        )
        self._assumptions = verdict.state
        if verdict.message is not None:
            (log.info if verdict.usable else log.warning)(verdict.message)
        return verdict

    def _nothing_pending(self, conn: sa.Connection) -> bool:
        """After a claim that found nothing: true when a claim from the mark in force would find
        nothing either (and the facts the mark rests on still hold, checked as a claim checks
        them); the transaction stays open for the claim otherwise."""
        owned = sorted(self.relay.lanes.owned)
        mark = self._low
        if mark.drawn is None or mark.lanes != frozenset(owned):
            return False  # no mark moved by a reading for these lanes: claim
        sequence = self.relay.sequence
        facts, pending = outbox_pending(
            conn,
            self.sql,
            sequence,
            lanes=self.config.lanes,
            owned=owned,
            low=mark.low,
            watch=self._assumptions.watch,
        )
        verdict = self._verified(facts, fresh=True)
        if verdict.usable and not verdict.restart:
            return not pending
        # The mark may not be used (or starts from zero): dropped here, as a claim drops it,
        # since the claim that follows reads facts this verdict already took in.
        self._low = LowWater().for_lanes(owned)
        return False

    def _claim_batch(self, conn: sa.Connection) -> _Batch:
        """Claim a batch (the uncontended claim unless a lock got in the way lately), or find
        that nothing is pending (after a claim that found nothing)."""
        if self._idle and self._nothing_pending(conn):
            return _Batch.of([])
        batch = self._claim_full(conn)
        self._idle = not batch.claimed
        return batch

    def _claim_full(self, conn: sa.Connection) -> _Batch:
        fetched = None
        if not self._contended:
            fetched = self._claim(conn, uncontended=True)
            self._contended = fetched is None
        if fetched is None:
            fetched = self._claim(conn, uncontended=False)
            assert fetched is not None
            self._contended = any(r[SKIPPED] for r in fetched)
        return _Batch.of(fetched)

    def _delete_and_claim_ahead(
        self, conn: sa.Connection, ids: Sequence[int]
    ) -> list[ClaimedRow] | None:
        """While Kafka confirms the batch in hand: delete its rows in a savepoint and claim the
        next batch in the same transaction (the batch in hand is already deleted there, so the
        claim passes over it); no claim while the relay claims the careful way (a lock got in
        the way lately) or when it stops. Returns the claimed rows, or ``None``."""
        outbox_delete_between_savepoints(conn, self.sql, ids)
        if self._contended or self.relay.stop_event.is_set():
            return None
        fetched = self._claim(conn, uncontended=True, savepoint="outbox_ahead")
        if fetched is None:
            self._contended = True
        return fetched

    # ------------------------------------------------------------------------------- batch

    def process_batch(self, conn: sa.Connection, result: BatchResult) -> BatchResult:
        """Claim (or take the batch claimed ahead), produce, confirm, delete and commit one
        batch of the owned lanes.

        A full batch that goes out in one round (the usual case while draining) overlaps its
        database work with Kafka's: while this thread hands its records to the producer, the
        database thread deletes its rows in a savepoint and claims the next batch; the broker
        confirms meanwhile.
        Only if Kafka confirmed every row does the transaction commit as it is; otherwise it
        rolls back to the savepoint and settles row by row. Either way a row leaves the outbox
        with the COMMIT that follows its delivery report (docs/concepts.md I6). The batch claimed
        ahead is sent next; its rows are locked again by that batch's own delete.
        """
        relay = self.relay
        batch, self._ahead = self._ahead, None
        if not relay.lanes.owned:
            return result
        started = time.monotonic()
        if batch is None:
            batch = self._claim_batch(conn)
        rows = batch.rows
        if not rows:
            conn.commit()
            return result
        result.claimed = len(batch.claimed)
        ids = [r[ID] for r in rows]
        # Overlap while draining (a full batch, more rows likely waiting); a small batch goes
        # straight to Kafka, its database work after: latency matters more than throughput.
        full = result.claimed >= self.config.batch_size
        overlap = (
            full
            and not batch.unsendable
            and single_round([r[KEY] for r in rows], [r[TOPIC] for r in rows])
        )
        # The database deletes this batch (in a savepoint) and claims the next one on the
        # relay's database thread while this thread hands the records to the producer; both
        # wait for each other, and the next batch's records are built, before Kafka's reports
        # are awaited.
        ahead: list[_Batch] = []

        def delete_and_claim_ahead() -> Future[list[ClaimedRow] | None]:
            return relay.database_thread().submit(self._delete_and_claim_ahead, conn, ids)

        def claimed_ahead(fetched: list[ClaimedRow] | None) -> None:
            if fetched is not None:
                ahead.append(_Batch.of(fetched))

        reports, result.sent, database = relay.producing.send(
            rows,
            batch.records,
            batch.unsendable,
            alongside=delete_and_claim_ahead if overlap else None,
            joined=claimed_ahead,
        )
        optimistic = database is not None
        verdict = settle(ids, [r[ATTEMPTS] for r in rows], reports, self.config.max_attempts)
        low_ahead, self._low_ahead = self._low_ahead, None
        if optimistic and len(verdict.delete) == len(ids):
            conn.commit()  # every row confirmed: the delete in the savepoint stands
            if low_ahead is not None:
                self._low = low_ahead
            if not relay.stop_event.is_set() and ahead:
                self._ahead = ahead[0]
        else:
            if optimistic:
                outbox_rollback_to(conn, "outbox_sent")  # and the claim ahead with it
            if verdict.delete:
                outbox_delete_confirmed(conn, self.sql, verdict.delete)
            if verdict.fail_ids:
                outbox_record_failures(
                    conn, self.sql, verdict.fail_ids, verdict.fail_errors, verdict.fail_park
                )
            conn.commit()
        result.settled(verdict, reports)
        relay.report(rows, reports, verdict, result, time.monotonic() - started)
        return result
