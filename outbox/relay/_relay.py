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
Its rooms: where batches come from (the engine, :mod:`outbox.relay._engine`: the claims of
:mod:`outbox.relay._claims` or the windows of :mod:`outbox.relay._window`), the session
(:mod:`outbox.relay._connection`), the idle announcement (:mod:`outbox.relay._idle`),
readiness (:mod:`outbox.relay._readiness`) and the producer (:mod:`outbox.relay._producing`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa

from outbox._core.delivery import ATTEMPTS, EVENT_ID, ID, TOPIC, ClaimedRow, Settlement
from outbox._core.redact import one_line, redact_url
from outbox._core.retry import Backoff
from outbox._kafka.producer import DeliveryReport, KafkaProducer
from outbox._pg import lanes as pg_lanes
from outbox._pg.errors import database_unavailable, is_database_error
from outbox._pg.relay import OutboxSequence, OutboxStatements, listen_connector, relay_engine
from outbox._pg.wakeup import Listener, Wakeups
from outbox.config import RelayConfig as RelayConfig, normalize_database_url
from outbox.errors import ConfigurationError
from outbox.relay._claims import ClaimEngine
from outbox.relay._connection import Session
from outbox.relay._engine import BatchResult as BatchResult, Engine, Reset
from outbox.relay._idle import Action, Event, IdleAnnouncement
from outbox.relay._lanes import LaneOwnership
from outbox.relay._metrics import RelayMetrics
from outbox.relay._producers import ProducerPool
from outbox.relay._producing import Producing
from outbox.relay._readiness import Readiness, problems
from outbox.relay._window import WindowEngine

log = logging.getLogger("outbox.relay")


def relay_max_silence(config: RelayConfig) -> float:
    """Seconds the loop may go without turning before ``/healthz`` reports the relay wedged:
    an idle relay turns at least every ``poll_interval``."""
    return max(30.0, 3 * config.poll_interval)


class RunResult(enum.IntEnum):
    """How :meth:`Relay.run` ended; every other end is an exception."""

    FINISHED = 0  # stopped on request, or (``once``) nothing claimable is left


class Relay:
    """One relay process's worth of work. ``run()`` until ``stop()`` (or drained, with
    ``once=True``).

    ``producer_factory`` exists for the benchmark and tests that need another producer
    configuration; it defaults to :class:`outbox._kafka.producer.KafkaProducer`.
    ``on_session(conn)`` runs on each new database session before it takes lanes;
    ``listen(kick)`` subscribes to wake-ups instead of a listener thread of the relay's own
    (the fleet's, on the relay's own session: :class:`outbox._pg.fleet.Watch`);
    ``producer_pool`` lends the producer while the relay sends (a fleet's relays share a few:
    :mod:`outbox.relay._producers`).
    """

    def __init__(
        self,
        config: RelayConfig,
        *,
        producer_factory: Callable[[], KafkaProducer] | None = None,
        on_session: Callable[[sa.Connection], None] | None = None,
        listen: Callable[[threading.Event], Wakeups] | None = None,
        producer_pool: ProducerPool | None = None,
    ) -> None:
        self.config = config.validate()
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
        self.producing = Producing(
            self.config, self.stop_event, producer_factory, pool=producer_pool
        )
        self.session = Session(
            self.engine, self.url, self.sql, self.lanes, self.metrics, on_session=on_session
        )
        # Where wake-ups come from when not from a listener thread of this relay's own.
        self._listen = listen
        self._wakeups: Wakeups | None = None
        self.readiness = Readiness(self.config, self.sql, self.metrics)
        self.announcement = IdleAnnouncement(self._announce)
        self._next_stats = 0.0
        self._db_backoff = Backoff(config.backoff_initial, config.backoff_max)
        # Runs the database's share of a full batch while this thread produces.
        self._database: ThreadPoolExecutor | None = None
        # Where batches come from: the claims, or the windows (``--engine window``).
        self.batches: Engine = (
            WindowEngine(self) if self.config.engine == "window" else ClaimEngine(self)
        )

    @property
    def owned(self) -> set[int]:
        """The lanes this relay owns right now."""
        return self.lanes.owned

    @property
    def pid(self) -> int | None:
        """The backend pid of this relay's database session (None while disconnected)."""
        return self.lanes.pid

    @property
    def table_name(self) -> str | None:
        """The outbox table as this relay's sessions resolve it (schema-qualified), once known."""
        return self.session.table_name

    @property
    def sequence(self) -> OutboxSequence:
        """The outbox table and its id sequence as the session resolved them."""
        return self.session.sequence

    # ------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and return (safe from signal handlers)."""
        self.metrics.stopping = True  # no longer ready
        self.stop_event.set()
        self.kick.set()

    def _sleep(self, seconds: float) -> None:
        self.stop_event.wait(seconds)

    def _announce(self, idle: bool) -> None:
        assert self.session.conn is not None
        pg_lanes.announce_idle(self.session.conn, self.config.schema, idle)

    def database_thread(self) -> ThreadPoolExecutor:
        """The thread that runs a batch's database work while this one produces."""
        if self._database is None:
            self._database = ThreadPoolExecutor(1, thread_name_prefix="outbox-relay-database")
        return self._database

    # ------------------------------------------------------------------------------- batch

    def process_batch(self, conn: sa.Connection) -> BatchResult:
        """Produce, confirm and settle one batch of the owned lanes (see the engine's own)."""
        return self.batches.process_batch(conn, BatchResult())

    def report(
        self,
        rows: Sequence[ClaimedRow],
        reports: Sequence[DeliveryReport | None],
        verdict: Settlement,
        result: BatchResult,
        duration: float,
    ) -> None:
        """A settled batch's metrics, logs and totals (both engines end a batch with it)."""
        m = self.metrics
        m.batch_duration.observe(duration)
        m.published.inc(result.confirmed)
        m.parked.inc(result.parked)
        if result.failed:
            permanent = sum(1 for o in reports if o is not None and not o.ok and o.permanent)
            if permanent:
                m.failed.labels("permanent").inc(permanent)
            if result.failed - permanent:
                m.failed.labels("retriable").inc(result.failed - permanent)
        if result.parked:
            parked_ids = {i for i, p in zip(verdict.fail_ids, verdict.fail_park, strict=True) if p}
            for row, report in zip(rows, reports, strict=True):
                if row[ID] in parked_ids and report is not None:
                    log.warning(
                        "event=row_parked id=%d event_id=%s topic=%r attempts=%d error=%r",
                        row[ID],
                        row[EVENT_ID].decode("ascii"),
                        row[TOPIC],
                        row[ATTEMPTS] + 1,
                        report.error,
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
            self.session.refuse_pooled_sessions()
        except ConfigurationError:
            raise
        except Exception as exc:
            if not (is_database_error(exc) or isinstance(exc, OSError)):
                raise
            # The database is not reachable yet: checked at the first connection of the loop.
        self.batches.start(once)
        listener: Wakeups | None = None
        if not once and self._listen is not None:
            listener = self._listen(self.kick)
        elif not once:
            listener = Listener(
                listen_connector(self.engine), self.config.schema, self.kick, self.stop_event
            ).start()
        self._wakeups = listener
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
            # that should not delay the first event (a fleet's pool keeps producers warm).
            if self.producing.pool is None:
                self.producing.get()
            return self._loop(once)
        finally:
            self._shutdown(listener)

    def _turn(self, once: bool) -> BatchResult:
        """The database's share of one turn of the loop: (re)connect, rebalance when due,
        refresh the metrics when due, the idle announcement, one batch."""
        conn = self.session.conn
        if conn is None:
            conn = self.session.connect()
            if self._db_backoff.failures:
                log.info("event=database_reconnected pid=%s", self.lanes.pid)
            self._db_backoff.succeeded()
        now = time.monotonic()
        if now >= self.lanes.next_rebalance:
            if self.lanes.rebalance(conn):
                # What was claimed ahead may hold rows of a lane another relay can take now
                # (they are no longer locked): claim from the lanes kept.
                self.batches.reset(Reset.REBALANCE)
            self.lanes.next_rebalance = now + self.config.rebalance_interval
        if not once and now >= self._next_stats:
            self.readiness.refresh(conn, self.batches.stats(conn), self.table_name)
            self.readiness.check_broker(self.producing.check, self.stop_event)
            self._next_stats = now + self.config.stats_interval
        self.announcement.on(Event.CLAIM)
        if self.kick.is_set():
            self.batches.reset(Reset.WAKEUP)
        self.kick.clear()
        return self.process_batch(conn)

    def _loop(self, once: bool) -> RunResult:
        kafka = self.producing.backoff
        while not self.stop_event.is_set():
            self.metrics.beat()
            try:
                result = self._turn(once)
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
                self.producing.drop()
            if result.confirmed:
                self.readiness.confirmed_since_check = True
            if result.outage:
                self.metrics.broker_up = False
                delay = kafka.failed()
                # The first failed send of an outage at WARNING; the outage log summarizes the
                # rest while it lasts.
                log.log(
                    logging.WARNING if kafka.failures == 1 else logging.DEBUG,
                    "event=kafka_unavailable failed=%d consecutive=%d retry_in=%.2fs error=%r",
                    result.failed,
                    kafka.failures,
                    delay,
                    result.error,
                )
                self._sleep(delay)
                continue
            if result.confirmed and kafka.failures:
                log.info("event=kafka_recovered after_failures=%d", kafka.failures)
                kafka.succeeded()
            if result.claimed >= self.config.batch_size and result.sent > 0:
                # Draining: writers need not wake this relay meanwhile.
                self.announcement.on(Event.FULL)
                continue
            if result.sent and result.failed:
                continue
            if once:
                if not self.lanes.owned and self.session.conn is not None:
                    self._sleep(0.05)  # waiting for a lane to become free
                    continue
                if result.sent == 0:
                    return RunResult.FINISHED
                continue
            # Nothing to do: announce it first (and claim once more), then wait for work.
            if self.announcement.on(Event.IDLE) is Action.WAIT and not self.kick.is_set():
                timeout = min(
                    self.config.poll_interval,
                    max(0.0, self.lanes.next_rebalance - time.monotonic()),
                )
                self.producing.serve()  # client errors, and a due outage summary
                self.idle.set()
                if self._wakeups is None:
                    self.kick.wait(timeout)
                else:
                    self._wakeups.wait(timeout)
                self.idle.clear()
        return RunResult.FINISHED

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
        self.batches.reset(Reset.ROLLBACK)
        if self.session.conn is None:
            return False
        if not self.session.rollback():
            self._drop_connection()
            return False
        return True

    def _drop_connection(self) -> None:
        self.batches.reset(Reset.RECONNECT)
        self.announcement.on(Event.LOST)  # the lock went with the session
        self.session.drop()

    def _shutdown(self, listener: Wakeups | None) -> None:
        self.stop_event.set()
        self._rollback()
        self.producing.close()
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
        found, table = problems(
            self.engine, self.url, self.config, self.sql, self.producing.factory
        )
        if table is not None:
            self.session.table_name = table.resolved
        return found
