"""The relay's Prometheus metrics, and its liveness and readiness verdicts.

Invariant: each relay has its own registry, so several relays can live in one process (tests)
without clashing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from outbox._core.health import HorizonHolder, TableHealth


class RelayMetrics:
    """The relay's metrics (names are documented in docs/relay.md)."""

    def __init__(self, max_silence: float = 30.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published", "Records confirmed by Kafka and removed", registry=r
        )
        self.failed = Counter(
            "outbox_relay_failed",
            "Records whose delivery failed (kind: retriable or permanent)",
            ["kind"],
            registry=r,
        )
        self.parked = Counter("outbox_relay_parked", "Rows parked by this relay", registry=r)
        self.backlog = Gauge(
            "outbox_relay_backlog_rows", "Rows waiting in the outbox (not parked)", registry=r
        )
        self.parked_rows = Gauge(
            "outbox_relay_parked_rows", "Parked rows in the outbox", registry=r
        )
        self.oldest_age = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest row waiting in the outbox",
            registry=r,
        )
        self.batch_duration = Histogram(
            "outbox_relay_batch_duration_seconds",
            "Claim, produce, confirm and delete of one batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.lanes_owned = Gauge("outbox_relay_lanes_owned", "Lanes this relay owns", registry=r)
        self.lanes = Gauge(
            "outbox_relay_lanes", "Lanes of the outbox (--lanes), shared by its relays", registry=r
        )
        self.up = Gauge(
            "outbox_relay_database_up", "1 while the database session is up", registry=r
        )
        topic = ("topic",)
        self.topic_backlog = Gauge(
            "outbox_relay_topic_backlog_rows", "Rows waiting in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self.topic_parked = Gauge(
            "outbox_relay_topic_parked_rows", "Parked rows in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self.topic_oldest_age = Gauge(
            "outbox_relay_topic_oldest_pending_age_seconds",
            "Age of the oldest row waiting in the outbox, per topic",
            topic, registry=r,
        )  # fmt: skip
        self._topics: set[str] = set()
        # Table health (outbox._core.health), refreshed with the backlog.
        self.table_live = Gauge(
            "outbox_table_live_tuples", "Live tuples of a toolkit table (estimate)", ["table"],
            registry=r,
        )  # fmt: skip
        self.table_dead = Gauge(
            "outbox_table_dead_tuples",
            "Dead tuples of a toolkit table: deleted rows VACUUM has not removed (yet)",
            ["table"],
            registry=r,
        )
        self.table_size = Gauge(
            "outbox_table_size_bytes", "A toolkit table with its indexes and TOAST", ["table"],
            registry=r,
        )  # fmt: skip
        self.table_vacuumed = Gauge(
            "outbox_table_last_vacuum_timestamp_seconds",
            "When a toolkit table was last vacuumed (by hand or autovacuum); 0 if never",
            ["table"],
            registry=r,
        )
        self.horizon_age = Gauge(
            "outbox_horizon_age_seconds",
            "How long the oldest transaction holding the xmin horizon back has been open "
            "(0 when nothing holds it or the holder is a replication slot)",
            registry=r,
        )
        self.horizon_xids = Gauge(
            "outbox_horizon_xid_age",
            "Transaction ids between the xmin horizon and now",
            registry=r,
        )
        self.horizon_holder = Gauge(
            "outbox_horizon_holder_info",
            "The oldest holder of the xmin horizon (1; never its query)",
            ["kind", "pid", "application_name", "state"],
            registry=r,
        )
        # The window engine (outbox-relay --engine window).
        self.window_backlog = Gauge(
            "outbox_relay_window_backlog",
            "Rows of this relay's lanes not yet past their window cursors (window engine)",
            registry=r,
        )
        self.window_truncates = Counter(
            "outbox_relay_window_truncates",
            "Times the window engine gave the delivered rows' space back by TRUNCATE",
            registry=r,
        )
        self.window_reclaimed = Counter(
            "outbox_relay_window_reclaimed_rows",
            "Delivered rows the window engine deleted because TRUNCATE could not be had",
            registry=r,
        )
        self.window_reclaim_age = Gauge(
            "outbox_relay_window_reclaim_age_seconds",
            "Seconds since the window engine last gave space back (0 with the claim engine)",
            registry=r,
        )
        self._window_reclaimed_at: float | None = None  # None: not the window engine
        self.window_reclaim_age.set_function(
            lambda: (
                0.0
                if self._window_reclaimed_at is None
                else time.monotonic() - self._window_reclaimed_at
            )
        )
        self.heartbeat = time.monotonic()
        self.database_up = False
        # Set by the relay: false after a delivery outage or a failed broker check; stopping once
        # it was asked to stop.
        self.broker_up = False
        self.stopping = False
        # Privileges on the outbox a batch needs that the relay's role lacks (not ready).
        self.missing_privileges: list[str] = []
        self.max_silence = max_silence
        Gauge(
            "outbox_relay_ready",
            "1 while /readyz answers 200: the loop turns, the database session is up, the relay "
            "is registered for lanes (owning some or waiting) and the broker answered",
            registry=r,
        ).set_function(lambda: float(self.ready(self.max_silence)))

    def set_health(self, tables: Sequence[TableHealth], holder: HorizonHolder | None) -> None:
        """Publish the tables' health and the horizon's holder."""
        for t in tables:
            self.table_live.labels(t.table).set(t.live_tuples)
            self.table_dead.labels(t.table).set(t.dead_tuples)
            self.table_size.labels(t.table).set(t.size_bytes)
            vacuumed = t.last_vacuum.timestamp() if t.last_vacuum is not None else 0.0
            self.table_vacuumed.labels(t.table).set(vacuumed)
        self.horizon_holder.clear()
        if holder is None:
            self.horizon_age.set(0)
            self.horizon_xids.set(0)
            return
        self.horizon_age.set(holder.age_seconds or 0.0)
        self.horizon_xids.set(holder.xid_age)
        self.horizon_holder.labels(
            holder.kind,
            "" if holder.pid is None else str(holder.pid),
            holder.application_name or holder.name or "",
            holder.state or "",
        ).set(1)

    def window_engine(self) -> None:
        """This relay runs the window engine: its reclaim age counts from now."""
        self._window_reclaimed_at = time.monotonic()

    def window_reclaims(self, truncated: bool, deleted: int) -> None:
        """The window engine gave space back (by TRUNCATE, or by deleting ``deleted`` rows)."""
        if truncated:
            self.window_truncates.inc()
        self.window_reclaimed.inc(deleted)
        self._window_reclaimed_at = time.monotonic()

    def beat(self) -> None:
        """Record that the loop is alive (called every iteration)."""
        self.heartbeat = time.monotonic()

    def healthy(self, max_silence: float) -> bool:
        """``/healthz``: the loop is turning and the database session is up (otherwise an
        orchestrator restarts the wedged relay)."""
        return self.database_up and time.monotonic() - self.heartbeat <= max_silence

    def ready(self, max_silence: float) -> bool:
        """``/readyz``: also registered for lanes (owning some or waiting for them), the broker
        answered its last check, the relay's role may claim and delete (no
        ``missing_privileges``), and not stopping."""
        # The database session is registered among the relays before database_up is set.
        return (
            self.broker_up
            and not self.stopping
            and not self.missing_privileges
            and self.healthy(max_silence)
        )

    def topics(self, stats: dict[str, tuple[int, int, float]]) -> None:
        """``(backlog, parked, oldest pending age)`` per topic; topics gone from the outbox
        lose their series."""
        gauges = (self.topic_backlog, self.topic_parked, self.topic_oldest_age)
        for topic in self._topics - stats.keys():
            for gauge in gauges:
                gauge.remove(topic)
        for topic, values in stats.items():
            for gauge, value in zip(gauges, values, strict=True):
                gauge.labels(topic).set(value)
        self._topics = set(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
