"""What the console reads and keeps between requests (:class:`Readings`): the pending rows'
count within its budget (in the background past it), the consumer groups' lag reused for a few
seconds, the chart's samples taken by a thread, and whether the database answers."""

from __future__ import annotations

import logging
import threading
import time

import sqlalchemy as sa

from outbox import admin
from outbox._core.lag import GroupLags
from outbox._core.outage import Outage
from outbox._core.redact import redact_text
from outbox._kafka.lag import read_group_lags
from outbox._pg import console as console_sql
from outbox.config import normalize_database_url
from outbox.console import chart, data
from outbox.console.settings import ConsoleConfig
from outbox.schema import validate_schema_name

log = logging.getLogger("outbox.console")

SAMPLE_SECONDS = 10.0
# The consumer groups' lag: how long the broker may take, and how long an answer is reused (a
# refreshing page, or many open ones, ask the broker at most this often).
LAG_TIMEOUT = 3.0
LAG_CACHE_SECONDS = 5.0


class Readings:
    """What the console reads and keeps between requests: settings, one small engine, the
    sampled chart, the consumer groups' lag, the pending rows' count, the database's outage."""

    def __init__(self, settings: ConsoleConfig) -> None:
        self.settings = settings.validate()
        self.schema = validate_schema_name(settings.schema)
        self.engine = sa.create_engine(
            normalize_database_url(settings.database_url),
            pool_size=2,
            max_overflow=2,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 5, "application_name": "outbox console"},
        )
        self.samples = chart.Samples()
        self._stop = threading.Event()
        self._lag_lock = threading.Lock()
        self._lag: tuple[float, GroupLags] | None = None
        self.database_outage = Outage("PostgreSQL")
        self._outage_lock = threading.Lock()
        # The last exact count of the pending rows (with the monotonic time it began), and
        # whether one is running in the background.
        self._count_lock = threading.Lock()
        self._count: tuple[float, admin.PendingCount] | None = None
        self._counting = False

    # -- the pending rows' count ---------------------------------------------------------

    def pending_count(self, connection: sa.Connection, lanes: int) -> admin.PendingCount:
        """The pending rows per topic and lane for the overview (data.pending_count_plan):
        counted on ``connection`` (the page's snapshot), or the last count, with a fresh one
        started in the background when it is due."""
        with self._count_lock:
            last = self._count
            now, background = data.pending_count_plan(
                None if last is None else last[1].lanes,
                lanes,
                0.0 if last is None else last[1].seconds,
                0.0 if last is None else time.monotonic() - last[0],
                self.settings.count_budget,
                self._counting,
            )
            if background:
                self._counting = True
        if now or last is None:
            started = time.monotonic()
            count = admin.count_pending(connection, self.schema, lanes)
            self._keep(started, count)
            return count
        if background:
            threading.Thread(
                target=self._count_in_background, args=(lanes,), name="outbox-console-count",
                daemon=True,
            ).start()  # fmt: skip
        return last[1]

    def _keep(self, started: float, count: admin.PendingCount) -> None:
        with self._count_lock:
            if self._count is None or self._count[1].counted_at <= count.counted_at:
                self._count = (started, count)

    def _count_in_background(self, lanes: int) -> None:
        try:
            with self.engine.connect().execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            ) as conn:
                started = time.monotonic()
                count = admin.count_pending(conn, self.schema, lanes)
                conn.rollback()
            self._keep(started, count)
        except sa.exc.DBAPIError as exc:
            self.database_failed(exc)
        finally:
            with self._count_lock:
                self._counting = False

    def group_lags(self) -> GroupLags | None:
        """The consumer groups' lag (``None`` without a broker), at most
        :data:`LAG_CACHE_SECONDS` old; one request at a time reads it from the broker."""
        bootstrap = self.settings.bootstrap_servers
        if bootstrap is None:
            return None
        with self._lag_lock:
            now = time.monotonic()
            if self._lag is None or now - self._lag[0] >= LAG_CACHE_SECONDS:
                lags = read_group_lags(bootstrap, self.settings.kafka_config, LAG_TIMEOUT)
                if lags.error is not None:
                    log.warning("consumer groups' lag: %s", lags.error)
                self._lag = (time.monotonic(), lags)
            return self._lag[1]

    # -- the relayed-per-minute samples --------------------------------------------------

    def sample(self) -> None:
        """Record the outbox table's cumulative deletes (errors are logged, never raised)."""
        try:
            with self.engine.connect() as conn:
                deleted = console_sql.outbox_rows_deleted(conn, self.schema)
                conn.rollback()
        except sa.exc.DBAPIError as exc:
            self.database_failed(exc)
            return
        self.database_answered()
        if deleted is not None:
            self.samples.add(time.time(), deleted)

    def database_failed(self, exc: sa.exc.DBAPIError) -> None:
        """Log an unreachable database once when it goes away and in a summary while it stays
        away (outbox._core.outage), never a traceback per sample or per request."""
        reason = redact_text(str(exc.orig or exc)).strip().splitlines()
        with self._outage_lock:
            line = self.database_outage.failed(
                type(exc.orig or exc).__name__, reason[0] if reason else "", time.monotonic()
            )
        if line:
            log.warning("%s", line)

    def database_answered(self) -> None:
        with self._outage_lock:
            line = self.database_outage.recovered(time.monotonic())
        if line:
            log.info("%s", line)

    def _sampler(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.sample()

    def start_sampling(self) -> None:
        self.sample()
        threading.Thread(target=self._sampler, name="outbox-console-sampler", daemon=True).start()

    def stop_sampling(self) -> None:
        self._stop.set()

    # -- requests ------------------------------------------------------------------------
