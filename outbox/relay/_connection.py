"""The relay's database session: refused through a transaction pooler, registered for lanes,
the outbox table resolved on it, and dropped whole when it fails."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import sqlalchemy as sa

from outbox._core.redact import redact_url
from outbox._pg.pooler import sessions_are_pooled
from outbox._pg.relay import (
    OutboxSequence,
    OutboxStatements,
    listen_connector,
    outbox_privileges,
    outbox_sequence,
)
from outbox.errors import ConfigurationError
from outbox.relay._lanes import LaneOwnership
from outbox.relay._metrics import RelayMetrics

log = logging.getLogger("outbox.relay")


class Session:
    """The relay's one session connection (``conn``, ``None`` while disconnected)."""

    def __init__(
        self,
        engine: sa.Engine,
        url: str,
        sql: OutboxStatements,
        lanes: LaneOwnership,
        metrics: RelayMetrics,
        on_session: Callable[[sa.Connection], None] | None = None,
    ) -> None:
        self.engine, self.url, self.sql = engine, url, sql
        # Runs on every new session before it registers for lanes (the fleet takes its
        # serving lock there: outbox.relay._fleet).
        self.on_session = on_session
        self.lanes, self.metrics = lanes, metrics
        self.conn: sa.Connection | None = None
        self._session_checked = False
        # The outbox table and its id sequence as this session resolves them, once known.
        self.sequence = OutboxSequence(None, None, None, None)
        self.table_name: str | None = None

    def refuse_pooled_sessions(self) -> None:
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

    def connect(self) -> sa.Connection:
        self.refuse_pooled_sessions()
        conn = self.engine.connect()
        try:
            if self.on_session is not None:
                self.on_session(conn)
            self.lanes.register(conn)
            self.sequence = self._outbox_table(conn)
        except Exception:
            conn.close()
            raise
        self.metrics.database_up = True
        self.metrics.up.set(1)
        self.conn = conn
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
        if sequence.resolved != self.sequence.resolved or sequence.table is None:
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

    def drop(self) -> None:
        """Forget the session (its lanes go with it)."""
        conn, self.conn = self.conn, None
        self.lanes.lost()
        self.metrics.database_up = False
        self.metrics.up.set(0)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def rollback(self) -> bool:
        """Roll back the transaction in hand; false when there is no session or it did not
        survive (the caller then drops it)."""
        if self.conn is None:
            return False
        try:
            self.conn.rollback()
        except sa.exc.SQLAlchemyError:
            return False
        return True
