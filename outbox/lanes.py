"""Lanes, as a public module: who relays the outbox in ``schema``, and with which lanes.

:func:`relay_ownership` lists the live relays with the lanes each holds;
:func:`ownership_from_locks` is its pure half, for tools that read ``pg_locks`` themselves.
The lock layout and the arithmetic live in :mod:`outbox._core.lanes`, the SQL in
:mod:`outbox._pg.lanes`; this module names them for callers outside the package.
"""

from outbox._core.lanes import (
    APPLICATION_NAME,
    DEFAULT_LANES,
    KIND_LANE,
    KIND_LANES,
    KIND_MEMBER,
    MAX_LANES,
    LockRow,
    Rebalance,
    RelayInfo,
    configured_lane_counts,
    fair_share,
    lane_of,
    namespace,
    ownership_from_locks,
    plan_rebalance,
    preferred_order,
)
from outbox._pg.lanes import read_locks, register, relay_ownership, release, try_acquire

__all__ = [
    "APPLICATION_NAME",
    "DEFAULT_LANES",
    "KIND_LANE",
    "KIND_LANES",
    "KIND_MEMBER",
    "MAX_LANES",
    "LockRow",
    "Rebalance",
    "RelayInfo",
    "configured_lane_counts",
    "fair_share",
    "lane_of",
    "namespace",
    "ownership_from_locks",
    "plan_rebalance",
    "preferred_order",
    "read_locks",
    "register",
    "relay_ownership",
    "release",
    "try_acquire",
]
