"""The relay: move committed outbox rows to Kafka without loss and in per-key order.

One loop: wait for (a wake-up notification | the poll timer | stop); rebalance lanes when due;
claim a batch of the lanes this relay owns (``FOR UPDATE NOWAIT``, or ``SKIP LOCKED`` once
another transaction's lock got in the way); produce it; wait for every delivery report; delete
the confirmed rows in one statement, record failures in another; commit. While a full batch's
records are handed to the producer and Kafka confirms them, the relay's database thread deletes
its rows in a savepoint and claims the next batch, so that the database works while the producer
and the broker do; the transaction commits as it is only when every row was confirmed, else it
rolls back to the savepoint and settles row by row. A row leaves the outbox only with a commit
that follows its delivery report, so a crash at any point re-sends (at least once), never loses.

Per-key order rests on two rules:

1. **Claim rule.** A row is sent only when no earlier row of its key is left in the table
   outside this relay's own claim: not parked, not locked by another relay, not skipped. The
   claim query (:mod:`outbox._pg.relay`) leaves out keys blocked by a parked row and reports the
   rows it skipped; :func:`outbox._core.delivery.drop_blocked` drops every claimed row that has
   a skipped row of its key before it.
2. **Round rule.** Within a batch a key's rows for one topic go out together, in id order (one
   partition: the idempotent producer keeps their order, and the Kafka adapter keeps a failed
   record from being followed by a delivered one); a row for another topic than its key's
   previous row waits until Kafka confirmed the rows before it. A failed row stops its key for
   the rest of the batch (:func:`outbox._core.delivery.deliver_in_rounds`). Most batches are a
   single round, however hot their keys.

Together: whenever a record of a key reaches Kafka for the first time, every earlier record of
that key already reached Kafka. Re-sends can repeat records (a relay killed after the broker
confirmed but before the delete), but for every key the *first occurrences* are in commit order;
a consumer that drops records whose ``X-Idempotency-Key`` it has already seen sees exactly the
commit order. Key-less rows have no order and are sent in the first round.

This module is the loop over those decisions; ``outbox-relay`` (:mod:`outbox.cli.relay`) runs it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import sqlalchemy as sa

from outbox import migrate
from outbox._core.delivery import (
    ATTEMPTS,
    EVENT_ID,
    ID,
    KEY,
    SKIPPED,
    TOPIC,
    ClaimedRow,
    Settlement,
    deliver_in_rounds,
    settle,
    single_round,
    split_claim,
)
from outbox._core.lowwater import Assumptions, LowWater, verify
from outbox._core.outage import Outage
from outbox._core.redact import one_line, redact_url
from outbox._core.retry import Backoff
from outbox._kafka.producer import DeliveryReport, KafkaProducer, RecordTuple
from outbox._kafka.records import build_records, build_records_checked
from outbox._otel import spans
from outbox._pg import health as health_pg, lanes as pg_lanes
from outbox._pg.errors import database_unavailable, is_database_error
from outbox._pg.pooler import sessions_are_pooled
from outbox._pg.relay import (
    OutboxSequence,
    OutboxStatements,
    listen_connector,
    outbox_claim_batch,
    outbox_delete_between_savepoints,
    outbox_delete_confirmed,
    outbox_low_water,
    outbox_privileges,
    outbox_record_failures,
    outbox_rollback_to,
    outbox_sequence,
    outbox_stats,
    relay_engine,
)
from outbox._pg.wakeup import Listener, Wakeups
from outbox.config import RelayConfig as RelayConfig, normalize_database_url
from outbox.errors import ConfigurationError, PublishError
from outbox.relay._lanes import LaneOwnership
from outbox.relay._metrics import RelayMetrics
from outbox.relay._window import WindowEngine

log = logging.getLogger("outbox.relay")


# Seconds a readiness check of the brokers may take (see Relay._check_broker).
BROKER_CHECK_TIMEOUT = 2.0


def relay_max_silence(config: RelayConfig) -> float:
    """Seconds the loop may go without turning before ``/healthz`` reports the relay wedged:
    an idle relay turns at least every ``poll_interval``."""
    return max(30.0, 3 * config.poll_interval)


class RunResult(enum.IntEnum):
    """How :meth:`Relay.run` ended; every other end is an exception."""

    FINISHED = 0  # stopped on request, or (``once``) nothing claimable is left


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
        records: Sequence[RecordTuple | None]
        unsendable: dict[int, DeliveryReport] = {}
        try:
            records = build_records(rows)
        except Exception:
            records, broken = build_records_checked(rows)
            unsendable = {i: DeliveryReport(error=e, permanent=True) for i, e in broken.items()}
        return cls(claimed, rows, records, unsendable)


class Relay:
    """One relay process's worth of work. ``run()`` until ``stop()`` (or drained, with
    ``once=True``).

    ``producer_factory`` exists for the benchmark and tests that need another producer
    configuration; it defaults to :class:`outbox._kafka.producer.KafkaProducer`.
    ``on_session(conn)`` runs on each new database session before it takes lanes;
    ``listen(kick)`` subscribes to wake-ups instead of a listener thread of the relay's own.
    """

    def __init__(
        self,
        config: RelayConfig,
        *,
        producer_factory: Callable[[], KafkaProducer] | None = None,
        on_session: Callable[[sa.Connection], None] | None = None,
        listen: Callable[[threading.Event], Wakeups] | None = None,
    ) -> None:
        self.config = config.validate()
        # Runs on every new database session before it registers for lanes (the fleet takes
        # its serving lock there: outbox.relay._fleet).
        self._on_session = on_session
        # Where wake-ups come from when not from a listener thread of this relay's own.
        self._listen = listen
        self.url = normalize_database_url(config.database_url)
        self.stop_event = threading.Event()
        self.kick = threading.Event()
        # Set while the loop waits for work (tests and benchmarks wait for an idle relay).
        self.idle = threading.Event()
        self.metrics = RelayMetrics(max_silence=relay_max_silence(self.config))
        self.metrics.lanes.set(self.config.lanes)
        self.lanes = LaneOwnership(self.config, self.metrics)
        self.totals = BatchResult()
        self.engine = relay_engine(self.url)
        self.sql = OutboxStatements.for_schema(config.schema)
        # The brokers' state for the logs, kept across the producers an outage makes us rebuild.
        self.kafka_outage = Outage("Kafka")
        self._producer_factory = producer_factory or (
            lambda: KafkaProducer(
                config.bootstrap_servers, config.kafka_config, outage=self.kafka_outage
            )
        )
        self._producer: KafkaProducer | None = None
        self._conn: sa.Connection | None = None
        self._session_checked = False
        self._next_stats = 0.0
        self._kafka_backoff = Backoff(config.backoff_initial, config.backoff_max)
        # Claim without skipping until another transaction's lock gets in the way; then claim
        # the careful way until a claim skips nothing again (outbox._pg.relay).
        self._contended = False
        # The next batch, claimed while Kafka confirmed the previous one (see process_batch).
        self._ahead: _Batch | None = None
        # Runs the database's share of a full batch while this thread produces (process_batch).
        self._database: ThreadPoolExecutor | None = None
        # Waiting for work, announced to writers (see _announce_idle): to announce, announced,
        # draining (to give the announcement back).
        self._announce = self._announced = self._draining = False
        self._db_backoff = Backoff(config.backoff_initial, config.backoff_max)
        self._confirmed_since_check = False
        # Where claims start (outbox._core.lowwater); the mark a claim ahead computed inside
        # the batch transaction counts only once that transaction committed as it is (it saw
        # the batch's own uncommitted delete). What the mark rests on is checked on every
        # claim (`_assumptions`, kept across reconnects: other backends' cached values are).
        self._sequence = OutboxSequence(None, None, None, None)
        # The outbox table as this relay's sessions resolve it (schema-qualified), once known.
        self.table_name: str | None = None
        self._assumptions = Assumptions()
        self._low = LowWater()
        self._low_ahead: LowWater | None = None
        # The window engine, when chosen: where batches come from instead of the claims.
        self._window = WindowEngine(self) if self.config.engine == "window" else None

    @property
    def owned(self) -> set[int]:
        """The lanes this relay owns right now."""
        return self.lanes.owned

    @property
    def pid(self) -> int | None:
        """The backend pid of this relay's database session (None while disconnected)."""
        return self.lanes.pid

    # ------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and return (safe from signal handlers)."""
        self.metrics.stopping = True  # no longer ready
        self.stop_event.set()
        self.kick.set()

    def _sleep(self, seconds: float) -> None:
        self.stop_event.wait(seconds)

    # ---------------------------------------------------------------------------- database

    def _refuse_pooled_sessions(self) -> None:
        """Raise :class:`ConfigurationError` when the database URL goes through a transaction
        pooler: lanes are session advisory locks and wake-ups come through LISTEN, which would
        protect nothing there (outbox._pg.pooler). Checked once, when the database answers."""
        if self._session_checked:
            return
        if sessions_are_pooled(listen_connector(self.engine)):
            raise ConfigurationError(
                f"the database URL {redact_url(self.url)} goes through a connection pooler "
                "in transaction mode, where the relay's lanes (session advisory locks) and "
                "wake-ups (LISTEN) do not hold: point outbox-relay at PostgreSQL directly or "
                "through a pooler in session mode"
            )
        self._session_checked = True

    def _connect(self) -> sa.Connection:
        self._refuse_pooled_sessions()
        conn = self.engine.connect()
        try:
            if self._on_session is not None:
                self._on_session(conn)
            self.lanes.register(conn)
            self._sequence = self._outbox_table(conn)
        except Exception:
            conn.close()
            raise
        self.metrics.database_up = True
        self.metrics.up.set(1)
        return conn

    def _outbox_table(self, conn: sa.Connection) -> OutboxSequence:
        """Resolve the outbox table (through the session's search_path unless a schema is
        configured) and its id sequence; say which when it changes (and at the first
        connection), and what the role may not do to it."""
        sequence = outbox_sequence(conn, self.sql)
        missing = outbox_privileges(conn, self.sql) if sequence.table is not None else []
        conn.commit()
        self.metrics.missing_privileges = missing
        self.table_name = sequence.resolved
        if sequence.resolved != self._sequence.resolved or sequence.table is None:
            if sequence.table is None:
                log.warning(
                    "event=outbox_table_missing table=%s: no such table for this session "
                    "(search_path or --schema?); run `outbox migrate` for it",
                    self.sql.table,
                )
            else:
                log.info(
                    "event=outbox_table table=%s sequence=%s",
                    sequence.resolved,
                    sequence.sequence_name,
                )
        if missing:
            log.warning(
                "event=privilege_missing table=%s missing=%s: batches fail until the relay's "
                "role has them (deploy/sql/relay-role.sql)",
                sequence.resolved,
                ",".join(missing),
            )
        return sequence

    def _drop_connection(self) -> None:
        self._ahead = self._low_ahead = None
        if self._window is not None:
            self._window.reset()
        self._low = LowWater()  # from the low end again once the lanes are back
        self._announce = self._announced = False  # the lock went with the session
        conn, self._conn = self._conn, None
        self.lanes.lost()
        self.metrics.database_up = False
        self.metrics.up.set(0)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def _refresh_stats(self, conn: sa.Connection) -> None:
        # Rows below the mark are gone when this relay owns every lane: count from the mark.
        every_lane = self._low.lanes == frozenset(self.lanes.owned) and (
            len(self._low.lanes) == self.config.lanes
        )
        if self._window is not None:
            # The rows not past the cursors: the table also holds delivered rows.
            by_topic = self._window.stats(conn)
            self.metrics.window_backlog.set(sum(v[0] for v in by_topic.values()))
        else:
            stats = outbox_stats(conn, self.sql, self._low.low if every_lane else 0)
            by_topic = {t: (s.backlog, s.parked, s.oldest_age) for t, s in stats.items()}
        conn.commit()
        values = by_topic.values()
        self.metrics.backlog.set(sum(v[0] for v in values))
        self.metrics.parked_rows.set(sum(v[1] for v in values))
        self.metrics.oldest_age.set(max((v[2] for v in values), default=0.0))
        self.metrics.topics(by_topic)
        missing = outbox_privileges(conn, self.sql)
        if missing != self.metrics.missing_privileges:
            log.warning(
                "event=privilege_missing table=%s missing=%s: batches fail until the relay's "
                "role has them (deploy/sql/relay-role.sql)",
                self.table_name,
                ",".join(missing) or "none",
            )
            self.metrics.missing_privileges = missing
        tables = health_pg.table_health(conn, self.config.schema)
        holder = health_pg.horizon_holder(conn)
        conn.commit()
        self.metrics.set_health(tables, holder)

    def _check_broker(self) -> None:
        """Readiness: ask the brokers for metadata, unless Kafka confirmed a delivery since the
        last check (then it evidently answers). A cut-off broker costs the loop at most
        ``BROKER_CHECK_TIMEOUT`` per stats interval; it could deliver nothing meanwhile."""
        if self._confirmed_since_check:
            self._confirmed_since_check = False
            self.metrics.broker_up = True
            return
        try:
            self._producer_or_new().check(BROKER_CHECK_TIMEOUT, self.stop_event)
        except PublishError:
            # The producer's outage log said why (one line, then a summary while it lasts).
            self.metrics.broker_up = False
        else:
            self.metrics.broker_up = True

    # ------------------------------------------------------------------------------- batch

    def _producer_or_new(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = self._producer_factory()
        return self._producer

    def _claim(
        self, conn: sa.Connection, *, uncontended: bool, savepoint: str | None = None
    ) -> list[ClaimedRow] | None:
        owned = sorted(self.lanes.owned)
        mark = self._low.for_lanes(owned)
        facts, writers, first_live = outbox_low_water(
            conn,
            self.sql,
            self._sequence,
            lanes=self.config.lanes,
            owned=owned,
            low=mark.low,
            watch=self._assumptions.watch,
        )
        verdict = verify(
            self._assumptions,
            facts,
            fresh=savepoint is None,
            sequence=self._sequence.sequence_name or f"{self.sql.table}.id",
        )
        self._assumptions = verdict.state
        if verdict.message is not None:
            (log.info if verdict.usable else log.warning)(verdict.message)
        low = 0
        if verdict.usable and not verdict.restart:
            mark = mark.advance(facts.drawn or 0, writers, first_live)
            low = mark.low
        else:
            # From the low end, and a new mark from there (as after a restart); the mark in
            # force is dropped too, so that a claim ahead rolled back cannot bring it back.
            mark = self._low = LowWater().for_lanes(owned)
        if savepoint is None:
            self._low = mark  # read before this transaction changed anything
        else:
            self._low_ahead = mark
        return outbox_claim_batch(
            conn,
            self.sql,
            lanes=self.config.lanes,
            owned=owned,
            batch_size=self.config.batch_size,
            low=low,
            uncontended=uncontended,
            savepoint=savepoint,
        )

    def _claim_batch(self, conn: sa.Connection) -> _Batch:
        """Claim a batch (the uncontended claim unless a lock got in the way lately)."""
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
        if self._contended or self.stop_event.is_set():
            return None
        fetched = self._claim(conn, uncontended=True, savepoint="outbox_ahead")
        if fetched is None:
            self._contended = True
        return fetched

    def _database_thread(self) -> ThreadPoolExecutor:
        if self._database is None:
            self._database = ThreadPoolExecutor(1, thread_name_prefix="outbox-relay-database")
        return self._database

    def process_batch(self, conn: sa.Connection) -> BatchResult:
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
        result = BatchResult()
        if self._window is not None:
            return self._window.process_batch(conn, result)
        batch, self._ahead = self._ahead, None
        if not self.lanes.owned:
            return result
        started = time.monotonic()
        if batch is None:
            batch = self._claim_batch(conn)
        rows = batch.rows
        if not rows:
            conn.commit()
            return result
        result.claimed = len(batch.claimed)
        keys = [r[KEY] for r in rows]
        topics = [r[TOPIC] for r in rows]
        ids = [r[ID] for r in rows]
        records = batch.records
        producer = self._producer_or_new()
        # Overlap while draining (a full batch, more rows likely waiting); a small batch goes
        # straight to Kafka, its database work after: latency matters more than throughput.
        full = result.claimed >= self.config.batch_size
        overlap = full and not batch.unsendable and single_round(keys, topics)
        ahead: _Batch | None = None
        optimistic = False

        def send(todo: list[int]) -> list[DeliveryReport | None]:
            nonlocal ahead, optimistic
            chosen = records if len(todo) == len(records) else [records[i] for i in todo]
            if not overlap:
                sending = producer.start(chosen)  # type: ignore[arg-type]  # no unsendable
                return producer.finish(sending, self.stop_event, self.config.shutdown_grace)
            # The database deletes this batch (in a savepoint) and claims the next one on the
            # relay's database thread while this thread hands the records to the producer;
            # both wait for each other before Kafka's reports are awaited.
            optimistic = True
            database = self._database_thread().submit(self._delete_and_claim_ahead, conn, ids)
            try:
                sending = producer.start(chosen)  # type: ignore[arg-type]
            finally:
                fetched = database.result()
            if fetched is not None:
                ahead = _Batch.of(fetched)
            return producer.finish(sending, self.stop_event, self.config.shutdown_grace)

        traced = send if spans is None else spans.traced_send(rows, send)
        outcomes, result.sent, gaps = deliver_in_rounds(
            keys, topics, traced, failed=batch.unsendable, stopping=self.stop_event.is_set
        )
        if gaps:
            log.error(
                "event=order_gap rows=%d: Kafka confirmed rows after a failed row of their key "
                "(the producer settings that prevent this were changed?)",
                gaps,
            )
        verdict = settle(ids, [r[ATTEMPTS] for r in rows], outcomes, self.config.max_attempts)
        low_ahead, self._low_ahead = self._low_ahead, None
        if optimistic and len(verdict.delete) == len(ids):
            conn.commit()  # every row confirmed: the delete in the savepoint stands
            if low_ahead is not None:
                self._low = low_ahead
            if not self.stop_event.is_set():
                self._ahead = ahead
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
        result.confirmed = len(verdict.delete)
        result.parked = verdict.parked
        result.failed = verdict.failed
        result.outage = verdict.outage
        if verdict.failed:
            failures = [o for o in outcomes if o is not None and not o.ok]
            result.stale_producer = any(o.stale_producer for o in failures)
            result.error = failures[0].error
        self._report(rows, outcomes, verdict, result, time.monotonic() - started)
        return result

    def _report(
        self,
        rows: Sequence[ClaimedRow],
        outcomes: Sequence[DeliveryReport | None],
        verdict: Settlement,
        result: BatchResult,
        duration: float,
    ) -> None:
        m = self.metrics
        m.batch_duration.observe(duration)
        m.published.inc(result.confirmed)
        m.parked.inc(result.parked)
        if result.failed:
            permanent = sum(1 for o in outcomes if o is not None and not o.ok and o.permanent)
            if permanent:
                m.failed.labels("permanent").inc(permanent)
            if result.failed - permanent:
                m.failed.labels("retriable").inc(result.failed - permanent)
        if result.parked:
            parked_ids = {i for i, p in zip(verdict.fail_ids, verdict.fail_park, strict=True) if p}
            for row, outcome in zip(rows, outcomes, strict=True):
                if row[ID] in parked_ids and outcome is not None:
                    log.warning(
                        "event=row_parked id=%d event_id=%s topic=%r attempts=%d error=%r",
                        row[ID],
                        row[EVENT_ID].decode("ascii"),
                        row[TOPIC],
                        row[ATTEMPTS] + 1,
                        outcome.error,
                    )
        self.totals.claimed += result.claimed
        self.totals.confirmed += result.confirmed
        self.totals.parked += result.parked
        self.totals.failed += result.failed
        log.debug(
            "event=batch claimed=%d sent=%d confirmed=%d failed=%d parked=%d duration_ms=%.1f",
            result.claimed,
            result.sent,
            result.confirmed,
            result.failed,
            result.parked,
            duration * 1000,
        )

    # -------------------------------------------------------------------------------- loop

    def run(self, once: bool = False) -> RunResult:
        """Serve lanes until :meth:`stop` (or, with ``once``, until nothing is claimable)."""
        try:
            self._refuse_pooled_sessions()
        except ConfigurationError:
            raise
        except Exception as exc:
            if not (is_database_error(exc) or isinstance(exc, OSError)):
                raise
            # The database is not reachable yet: checked at the first connection of the loop.
        if self._window is not None:
            self._window.eager_reclaim = once  # a drained outbox is left empty
        listener: Wakeups | None = None
        if not once and self._listen is not None:
            listener = self._listen(self.kick)
        elif not once:
            listener = Listener(
                listen_connector(self.engine), self.config.schema, self.kick, self.stop_event
            ).start()
        log.info(
            "event=relay_started database=%s bootstrap=%s lanes=%d batch_size=%d once=%s engine=%s",
            redact_url(self.url),
            self.config.bootstrap_servers,
            self.config.lanes,
            self.config.batch_size,
            once,
            self.config.engine,
        )
        try:
            # Built up front: its first connection and producer id cost a round trip or two
            # that should not delay the first event.
            self._producer_or_new()
            return self._loop(once)
        finally:
            self._shutdown(listener)

    def _loop(self, once: bool) -> RunResult:
        while not self.stop_event.is_set():
            self.metrics.beat()
            try:
                if self._conn is None:
                    self._conn = self._connect()
                    if self._db_backoff.failures:
                        log.info("event=database_reconnected pid=%s", self.lanes.pid)
                    self._db_backoff.succeeded()
                conn = self._conn
                now = time.monotonic()
                if now >= self.lanes.next_rebalance:
                    if self.lanes.rebalance(conn):
                        # The batch claimed ahead may hold rows of a lane another relay can
                        # take now (they are no longer locked): claim from the lanes kept.
                        self._ahead = None
                    self.lanes.next_rebalance = now + self.config.rebalance_interval
                if not once and now >= self._next_stats:
                    self._refresh_stats(conn)
                    self._check_broker()
                    self._next_stats = now + self.config.stats_interval
                self._announce_idle(conn)
                self.kick.clear()
                result = self.process_batch(conn)
            except ConfigurationError:
                raise
            except Exception as exc:
                if not (is_database_error(exc) or isinstance(exc, OSError)):
                    raise
                self._database_failed(exc)
                continue
            self._db_backoff.succeeded()
            if result.stale_producer or result.outage:
                # A fresh producer after an outage, a purge or a broken idempotence state.
                if result.stale_producer and not result.outage:
                    log.warning("event=producer_rebuilt reason=%r", result.error)
                self._close_producer()
            if result.confirmed:
                self._confirmed_since_check = True
            if result.outage:
                self.metrics.broker_up = False
                delay = self._kafka_backoff.failed()
                # The first failed send of an outage at WARNING; the outage log summarizes the
                # rest while it lasts.
                log.log(
                    logging.WARNING if self._kafka_backoff.failures == 1 else logging.DEBUG,
                    "event=kafka_unavailable failed=%d consecutive=%d retry_in=%.2fs error=%r",
                    result.failed,
                    self._kafka_backoff.failures,
                    delay,
                    result.error,
                )
                self._sleep(delay)
                continue
            if result.confirmed and self._kafka_backoff.failures:
                log.info("event=kafka_recovered after_failures=%d", self._kafka_backoff.failures)
                self._kafka_backoff.succeeded()
            full = result.claimed >= self.config.batch_size and result.sent > 0
            if full:
                self._draining = True  # draining: writers need not wake this relay meanwhile
                continue
            if result.sent and result.failed:
                continue
            if once:
                if not self.lanes.owned and self._conn is not None:
                    self._sleep(0.05)  # waiting for a lane to become free
                    continue
                if result.sent == 0:
                    return RunResult.FINISHED
                continue
            if not self._announced:
                self._announce = True  # then one more claim before waiting
            elif not self.kick.is_set():
                timeout = min(
                    self.config.poll_interval,
                    max(0.0, self.lanes.next_rebalance - time.monotonic()),
                )
                if self._producer is not None:
                    self._producer.serve()  # client errors, and a due outage summary
                self.idle.set()
                self.kick.wait(timeout)
                self.idle.clear()
        return RunResult.FINISHED

    def _announce_idle(self, conn: sa.Connection) -> None:
        """Writers wake relays only while one waits for work (the ``idle`` lock, see
        :func:`outbox._pg.lanes.announce_idle`): take it before the last claim ahead of a
        wait, and keep it while batches stay small (each commit then wakes the relay at once);
        give it back while draining full batches, when wake-ups would only cost the writers."""
        if self._announce:
            pg_lanes.announce_idle(conn, self.config.schema, True)
            self._announce, self._announced = False, True
        elif self._announced and self._draining:
            pg_lanes.announce_idle(conn, self.config.schema, False)
            self._announced = False
        self._draining = False

    def _database_failed(self, exc: Exception) -> None:
        """PostgreSQL unreachable or the session lost: reconnect (the lanes go with the session).
        A statement that failed on a live session: roll back and keep the session and its lanes.
        Either way, back off before the next try."""
        delay = self._db_backoff.failed()
        error = one_line(exc, urls=[self.url], with_type=False)
        if database_unavailable(exc) or not self._rollback():
            log.warning("event=database_lost error=%r retry_in=%.2fs", error, delay)
            self._drop_connection()
        else:
            log.warning("event=batch_failed error=%r retry_in=%.2fs", error, delay)
        self._sleep(delay)

    def _rollback(self) -> bool:
        """Roll back the transaction in hand; false when the session did not survive."""
        self._ahead = self._low_ahead = None
        if self._window is not None:
            self._window.reset()
        if self._conn is None:
            return False
        try:
            self._conn.rollback()
        except sa.exc.SQLAlchemyError:
            self._drop_connection()
            return False
        return True

    def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.purge()

    def _shutdown(self, listener: Wakeups | None) -> None:
        self.stop_event.set()
        self._rollback()
        if self._producer is not None:
            self._producer.close(timeout=1.0)
            self._producer = None
        self._drop_connection()
        if self._database is not None:
            self._database.shutdown(wait=True)
            self._database = None
        if listener is not None:
            listener.join(2.0)
        self.engine.dispose()
        log.info(
            "event=relay_stopped confirmed=%d failed=%d parked=%d",
            self.totals.confirmed,
            self.totals.failed,
            self.totals.parked,
        )

    # ------------------------------------------------------------------------------- check

    def check(self) -> list[str]:
        """Problems that would stop this relay from working (empty when ready)."""
        problems: list[str] = []
        try:
            with self.engine.connect() as conn:
                current = migrate.current_revision(conn, self.config.schema)
                table = outbox_sequence(conn, self.sql)
                missing = outbox_privileges(conn, self.sql) if table.table is not None else []
        except sa.exc.SQLAlchemyError as exc:
            problems.append(
                f"database {redact_url(self.url)} is not reachable: "
                f"{one_line(exc, urls=[self.url], with_type=False)}"
            )
        else:
            head = migrate.head_revision()
            if current != head:
                problems.append(
                    f"database schema is at revision {current or 'none'}, this relay needs "
                    f"{head}: run `outbox migrate --database-url URL`"
                )
            self.table_name = table.resolved
            if missing:
                problems.append(
                    f"the relay's role lacks {', '.join(missing)} on {table.resolved}: "
                    "no batch can run (grant them: deploy/sql/relay-role.sql)"
                )
        try:
            producer = self._producer_factory()
            brokers = producer.check()
            producer.close(0.1)
            log.info("event=kafka_check brokers=%d", brokers)
        except PublishError as exc:
            problems.append(str(exc))
        return problems
