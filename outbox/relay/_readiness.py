"""What the relay tells /metrics, /healthz and /readyz, and ``outbox-relay --check``: the
backlog and table health, whether the brokers answer, what would stop the relay."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import sqlalchemy as sa

from outbox import migrate
from outbox._core.redact import one_line, redact_url
from outbox._kafka.producer import KafkaProducer
from outbox._pg import health as health_pg
from outbox._pg.relay import OutboxSequence, OutboxStatements, outbox_privileges, outbox_sequence
from outbox.config import RelayConfig
from outbox.errors import PublishError
from outbox.relay._metrics import RelayMetrics

log = logging.getLogger("outbox.relay")

# Seconds a readiness check of the brokers may take (see Readiness.check_broker).
BROKER_CHECK_TIMEOUT = 2.0


class Readiness:
    """The relay's view of its backlog, its table's health and the brokers, for the metrics."""

    def __init__(self, config: RelayConfig, sql: OutboxStatements, metrics: RelayMetrics) -> None:
        self.config, self.sql, self.metrics = config, sql, metrics
        self.confirmed_since_check = False

    def refresh(
        self,
        conn: sa.Connection,
        by_topic: dict[str, tuple[int, int, float]],
        table_name: str | None,
    ) -> None:
        """The metrics from the engine's ``by_topic`` stats, then privileges and table health."""
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
                table_name,
                ",".join(missing) or "none",
            )
            self.metrics.missing_privileges = missing
        tables = health_pg.table_health(conn, self.config.schema)
        holder = health_pg.horizon_holder(conn)
        conn.commit()
        self.metrics.set_health(tables, holder)

    def check_broker(
        self, check: Callable[[float, threading.Event], object], stop: threading.Event
    ) -> None:
        """Ask the brokers for metadata, unless Kafka confirmed a delivery since the last check
        (then it evidently answers). A cut-off broker costs the loop at most
        ``BROKER_CHECK_TIMEOUT`` per stats interval; it could deliver nothing meanwhile."""
        if self.confirmed_since_check:
            self.confirmed_since_check = False
            self.metrics.broker_up = True
            return
        try:
            check(BROKER_CHECK_TIMEOUT, stop)
        except PublishError:
            # The producer's outage log said why (one line, then a summary while it lasts).
            self.metrics.broker_up = False
        else:
            self.metrics.broker_up = True


def problems(
    engine: sa.Engine,
    url: str,
    config: RelayConfig,
    sql: OutboxStatements,
    producer_factory: Callable[[], KafkaProducer],
) -> tuple[list[str], OutboxSequence | None]:
    """Problems that would stop a relay from working (empty when ready), and the outbox table
    as the database resolves it (``None`` when it did not answer)."""
    found: list[str] = []
    resolved = None
    try:
        with engine.connect() as conn:
            current = migrate.current_revision(conn, config.schema)
            table = outbox_sequence(conn, sql)
            missing = outbox_privileges(conn, sql) if table.table is not None else []
    except sa.exc.SQLAlchemyError as exc:
        found.append(
            f"database {redact_url(url)} is not reachable: "
            f"{one_line(exc, urls=[url], with_type=False)}"
        )
    else:
        head = migrate.head_revision()
        if current != head:
            found.append(
                f"database schema is at revision {current or 'none'}, this relay needs "
                f"{head}: run `outbox migrate --database-url URL`"
            )
        resolved = table
        if missing:
            found.append(
                f"the relay's role lacks {', '.join(missing)} on {table.resolved}: "
                "no batch can run (grant them: deploy/sql/relay-role.sql)"
            )
    try:
        producer = producer_factory()
        brokers = producer.check()
        producer.close(0.1)
        log.info("event=kafka_check brokers=%d", brokers)
    except PublishError as exc:
        found.append(str(exc))
    return found, resolved
