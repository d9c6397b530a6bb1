"""The lanes a relay owns: registration among the running relays, and rebalancing.

Invariant: a relay claims rows of the lanes whose advisory lock its session holds, and every
relay of an outbox registers with the same lane count, so two relays never send the same key.
Every relay of an outbox runs the same engine: a claim relay would send again the rows a window
relay delivered and did not give back yet.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa

from outbox._core.durations import format_ranges
from outbox._core.lanes import (
    configured_lane_counts,
    other_engines,
    ownership_from_locks,
    plan_rebalance,
)
from outbox._pg import lanes as pg_lanes
from outbox.config import RelayConfig
from outbox.errors import ConfigurationError
from outbox.relay._metrics import RelayMetrics

log = logging.getLogger("outbox.relay")


class LaneOwnership:
    """The lanes one relay owns (``owned``), on its current database session (``pid``)."""

    def __init__(self, config: RelayConfig, metrics: RelayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.owned: set[int] = set()
        self.pid: int | None = None
        self.next_rebalance = 0.0  # monotonic time of the next rebalance

    def register(self, conn: sa.Connection) -> None:
        """Register a new session ``conn`` as a relay of this outbox (it owns no lane yet).

        Raises :class:`ConfigurationError` when the running relays use another lane count or
        another engine.
        """
        schema = self.config.schema
        engine = self.config.engine
        pid = pg_lanes.register(conn, schema, self.config.lanes, engine)
        locks = pg_lanes.read_locks(conn, schema)
        counts = configured_lane_counts(locks, schema)
        conn.commit()
        self._refuse_other_engines(other_engines(locks, schema, engine, pid, serving=False))
        others = counts - {self.config.lanes}
        if others:
            raise ConfigurationError(
                f"other relays of this outbox run with --lanes {sorted(others)}, this one with "
                f"--lanes {self.config.lanes}: every relay must use the same lane count (stop "
                "them all and restart with one value)"
            )
        self.pid = pid
        self.owned = set()
        self.next_rebalance = 0.0

    def _refuse_other_engines(self, others: dict[int, str]) -> None:
        if not others:
            return
        engines = sorted(set(others.values()))
        raise ConfigurationError(
            f"relays of this outbox run --engine {', '.join(engines)} (backend pid "
            f"{', '.join(str(p) for p in others)}), this one --engine {self.config.engine}: "
            "both would send the same rows; stop every relay of one engine before starting the "
            "other's (docs/relay.md, 'Switching engines')"
        )

    def lost(self) -> None:
        """The session is gone, and its lane locks with it."""
        self.owned = set()
        self.pid = None
        self.metrics.lanes_owned.set(0)

    def rebalance(self, conn: sa.Connection) -> bool:
        """Take or give back lanes towards an even share (and commit); true when this relay
        no longer owns a lane it owned before (given back, or its lock found gone)."""
        before = set(self.owned)
        schema = self.config.schema
        locks = pg_lanes.read_locks(conn, schema)
        # A relay of another engine that serves lanes (one of a release that does not check
        # engines at its start): this one stops rather than send the same rows.
        engines = other_engines(locks, schema, self.config.engine, self.pid, serving=True)
        if engines:
            conn.rollback()
            self._refuse_other_engines(engines)
        owners = ownership_from_locks(locks, schema)
        mine = set(owners.get(self.pid or -1, ()))
        if mine != self.owned:
            log.warning(
                "event=lanes_mismatch expected=%s actual=%s",
                format_ranges(self.owned),
                format_ranges(mine),
            )
            self.owned = mine
        others = {lane for pid, held in owners.items() if pid != self.pid for lane in held}
        plan = plan_rebalance(
            self.config.lanes, len(owners), self.owned, others, seed=self.pid or 0
        )
        if plan.release:
            pg_lanes.release(conn, schema, plan.release)
            self.owned -= set(plan.release)
        got: list[int] = []
        if plan.acquire:
            got = pg_lanes.try_acquire(conn, schema, plan.acquire)
            self.owned |= set(got)
        conn.commit()
        self.metrics.lanes_owned.set(len(self.owned))
        if plan.release or got:
            log.info(
                "event=lanes_changed relays=%d owned=%d target=%d took=%s gave_back=%s",
                len(owners),
                len(self.owned),
                plan.target,
                format_ranges(got),
                format_ranges(plan.release),
            )
        return not before <= self.owned
