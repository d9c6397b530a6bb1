"""Lanes: how relays split the outbox between them without a coordinator of their own.

Every outbox row belongs to lane ``key_hash % lanes``; all rows of one message key therefore
share a lane. Each lane is served by at most one relay at a time: a relay owns a lane while its
database session holds the PostgreSQL advisory lock ``(LANE namespace, lane)``. A relay that
dies loses its session, PostgreSQL frees its locks, and the survivors pick the lanes up at their
next rebalance.

Four advisory-lock namespaces exist per outbox schema (two-key form ``pg_try_advisory_lock(int,
int)``, which ``pg_locks`` shows as ``classid = namespace, objid = second key, objsubid = 2``):

* ``member`` -- every running relay holds ``(member, its backend pid)``; counting these locks
  counts the live relays;
* ``lanes`` -- held in shared mode as ``(lanes, configured lane count)``; a relay refuses to start
  when another one runs with a different count (both would serve the same key at once);
* ``lane`` -- ``(lane, n)`` is ownership of lane ``n``;
* ``idle`` -- held in shared mode as ``(idle, 0)`` by every relay that waits for work. Writers
  probe it after their commit (:func:`outbox._pg.lanes.idle_probe_sql`): only when some relay
  holds it is a wake-up worth sending (:mod:`outbox._pg.wakeup`).

Lane ownership is an efficiency device, not the order guarantee: the claim query itself refuses
to send a row while an earlier row of its key is still in the table (see ``outbox.relay``), so
even two relays briefly serving one lane cannot reorder a key.

This module is the arithmetic (fair share, which lanes to take or give back, ownership read from
lock rows), tested without a database; :mod:`outbox._pg.lanes` takes and reads the locks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_LANES = 32
MAX_LANES = 4096
APPLICATION_NAME = "outbox-relay"  # of every relay session: pg_stat_activity tells them apart

KIND_MEMBER = "member"
KIND_LANES = "lanes"
KIND_LANE = "lane"
KIND_IDLE = "idle"


def lane_of(key_hash: int, lanes: int) -> int:
    """The lane of a row: ``key_hash % lanes`` (the same expression the claim query uses)."""
    return key_hash % lanes


def namespace(schema: str | None, kind: str) -> int:
    """First advisory-lock key for ``kind`` locks of the outbox in ``schema``.

    A 31-bit CRC of ``outbox-relay:<schema>:<kind>``, so relays of different schemas in one
    database never contend, and the value reads the same in ``pg_locks.classid`` (an unsigned
    ``oid``) as in Python.
    """
    label = f"outbox-relay:{schema or 'public'}:{kind}"
    return zlib.crc32(label.encode("utf-8")) & 0x7FFFFFFF


def fair_share(lanes: int, relays: int) -> int:
    """How many lanes one relay should own: ``ceil(lanes / relays)`` (every lane gets an owner
    because ``relays * fair_share >= lanes``)."""
    return math.ceil(lanes / max(1, relays))


def preferred_order(lanes: int, seed: int) -> list[int]:
    """All lanes, rotated by ``seed``: relays starting together try different lanes first, which
    keeps ``pg_try_advisory_lock`` contention low while they converge."""
    start = seed % lanes
    return [(start + i) % lanes for i in range(lanes)]


@dataclass(frozen=True)
class Rebalance:
    """What one relay should do at a rebalance: lanes to try to take and lanes to give back."""

    acquire: tuple[int, ...]
    release: tuple[int, ...]
    target: int


def plan_rebalance(
    lanes: int,
    relays: int,
    mine: Iterable[int],
    held_by_others: Iterable[int],
    seed: int,
) -> Rebalance:
    """Decide how a relay moves towards its fair share.

    ``mine`` are the lanes this relay holds, ``held_by_others`` the lanes other live relays
    hold. A relay above its share gives back its surplus (the lanes latest in its preferred
    order, so it keeps the same lanes across rebalances); a relay below its share tries the free
    lanes in its preferred order.
    """
    owned = set(mine)
    others = set(held_by_others) - owned
    target = fair_share(lanes, relays)
    order = preferred_order(lanes, seed)
    if len(owned) > target:
        surplus = len(owned) - target
        keep_order = [lane for lane in order if lane in owned]
        return Rebalance(acquire=(), release=tuple(sorted(keep_order[-surplus:])), target=target)
    if len(owned) < target:
        free = [lane for lane in order if lane not in owned and lane not in others]
        return Rebalance(acquire=tuple(free[: target - len(owned)]), release=(), target=target)
    return Rebalance(acquire=(), release=(), target=target)


@dataclass(frozen=True)
class LockRow:
    """One advisory lock as ``pg_locks`` reports it (two-key form)."""

    pid: int
    classid: int
    objid: int


@dataclass(frozen=True)
class RelayInfo:
    """A live relay as seen from PostgreSQL."""

    pid: int
    application_name: str
    client_addr: str | None
    lanes: tuple[int, ...]


def ownership_from_locks(rows: Iterable[LockRow], schema: str | None) -> dict[int, tuple[int, ...]]:
    """Lanes held per relay (backend pid) from ``pg_locks`` rows: the pure half of
    :func:`outbox._pg.lanes.relay_ownership`, for ``outbox status`` and tests.

    Relays with no lane (registered members waiting for a share) appear with an empty tuple.
    """
    rows = list(rows)
    member_ns = namespace(schema, KIND_MEMBER)
    lane_ns = namespace(schema, KIND_LANE)
    held: dict[int, list[int]] = {}
    for row in rows:
        if row.classid == member_ns:
            held.setdefault(row.pid, [])
    for row in rows:
        if row.classid == lane_ns:
            held.setdefault(row.pid, []).append(row.objid)
    return {pid: tuple(sorted(lanes)) for pid, lanes in sorted(held.items())}


def configured_lane_counts(rows: Iterable[LockRow], schema: str | None) -> set[int]:
    """The ``--lanes`` values announced by live relays (normally exactly one)."""
    lanes_ns = namespace(schema, KIND_LANES)
    return {row.objid for row in rows if row.classid == lanes_ns}
