"""Where the relay's claim may start: the lowest outbox id that can still matter.

The claim walks the outbox's primary key in id order. Deleted rows stay behind as dead index
entries until VACUUM removes them, and VACUUM may not remove them while any snapshot older than
the delete is alive (a long transaction, ``pg_dump``, a replication slot or a standby holding
the xmin horizon back). A walk from the index's low end then passes every row the relay ever
deleted since that horizon, and a claim costs more with every row sent. Started from a
*low-water mark* instead, the walk passes only the rows deleted since the last claim.

The mark must never pass a row that can still be sent: a row committed and not yet deleted, or
a row drawn by a transaction that has not committed yet (ids are drawn at INSERT and become
visible at COMMIT, so a smaller id can appear after a larger one). Each claim first reads, in
this order and in separate statements (each with a fresh snapshot):

1. ``drawn``: the last id the outbox's sequence handed out (every id up to it was drawn
   already; the sequence must not cache values per session, ``CACHE 1``);
2. ``writers``: the transactions (by virtual transaction id) holding a write lock on the outbox
   table. A transaction draws an outbox id inside an INSERT into the table, so it holds that lock
   from before it drew the id until it ends; a transaction not in the list has committed (its
   rows are visible to every later snapshot) or rolled back;
3. ``first_live``: the lowest id at or above the current mark of a row of the relay's lanes.

A writer first seen now may hold ids above the previous claim's ``drawn`` only (it took its lock
after that claim read its list, hence after it read ``drawn``); a writer seen before keeps the
bound it got when first seen. Every id below the smallest of ``drawn + 1``, those bounds and
``first_live`` therefore belongs to a row that is gone for good or to another relay's lane. A
long transaction that never wrote to the outbox (a report, ``pg_dump``) does not hold the mark;
one that did holds it at its first id, as it must.

The mark belongs to a set of lanes: when the relay's lanes change it starts again from zero
(one walk from the low end), as it does after a restart.

Checked, not assumed (docs/concepts.md I15). The argument above rests on facts about the session and
the sequence that a DBA, a database setting or a role can change under a running relay, so the
first of the readings (in the same message, no extra round trip) also reports them, and
:func:`verify` decides on every claim whether the mark may be used at all:

* the transaction is READ COMMITTED: under REPEATABLE READ or SERIALIZABLE the three statements
  share the snapshot of the first one and ``first_live`` misses rows that writers committed
  meanwhile. The relay pins ``default_transaction_isolation`` in its session options (they
  outrank ``ALTER DATABASE/ROLE ... SET``), and checks anyway;
* the relay's role may read the sequence's last value (SELECT or USAGE on it);
* the sequence hands out values one at a time (``CACHE 1``), upwards (increment > 0), without
  ``CYCLE``, and never backwards: a ``setval`` or ``ALTER SEQUENCE ... RESTART`` to a lower
  value (the relfilenode changes with a RESTART, ``drawn`` falls with either) makes ids below
  the mark new again, so the mark starts from zero;
* no backend still holds values it cached. ``ALTER SEQUENCE ... CACHE 1`` does not take back
  the values other backends preallocated while the cache was larger (PostgreSQL's docs on ALTER
  SEQUENCE: they use them up first), and such a backend may insert an id far below ``drawn``
  with no lock on the outbox while the relay reads. Values are cached in a backend's memory
  only, and only by a ``nextval`` while the cache is above 1, so every backend that can hold
  one was connected when the cache went back to 1, hence when the relay first reads ``CACHE 1``
  again, or since it saw the sequence's settings change at all (the transaction id that last
  wrote its row of ``pg_sequence`` moved: a cache raised and lowered between two claims leaves
  that trace, and counts as a cache until shown otherwise). The relay then lists the database's
  backends (pids, in that reading: pg_stat_activity
  is read once per transaction, so the list counts only in a claim that begins one) and keeps
  the mark off until none of them is connected. A pid reused by a new backend only keeps the
  mark off longer. What a relay cannot see is a cache that went up and back down while no relay
  ran: docs/operations.md tells operators to restart writers' sessions after such a change.

Where a fact does not hold, that claim (and every claim until it holds again) starts at zero, a
walk from the table's low end that strands nothing; the relay logs the change once each way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LowWater:
    """The mark (``low``) for ``lanes``, and what the next claim needs to move it."""

    low: int = 0
    lanes: frozenset[int] = frozenset()
    # The sequence's last id at the previous claim (None before the first one).
    drawn: int | None = None
    # Writer (virtual transaction id) -> lowest outbox id it may hold.
    writers: Mapping[str, int] = field(default_factory=dict)

    def for_lanes(self, lanes: Iterable[int]) -> LowWater:
        """This state for the relay's ``lanes`` now: from zero if they changed."""
        owned = frozenset(lanes)
        if owned == self.lanes:
            return self
        return LowWater(0, owned, self.drawn, self.writers)

    def advance(self, drawn: int, writers: Iterable[str], first_live: int | None) -> LowWater:
        """The state after a claim read ``drawn``, ``writers`` and ``first_live`` (in that
        order, see the module); its ``low`` is where that claim starts."""
        fresh = self.low if self.drawn is None else self.drawn + 1
        bounds = {w: self.writers.get(w, fresh) for w in writers}
        low = min([drawn + 1, *bounds.values()])
        if first_live is not None:
            low = min(low, first_live)
        # Never below the previous mark: everything under it is settled already.
        return LowWater(max(low, self.low), self.lanes, drawn, bounds)


READ_COMMITTED = "read committed"


@dataclass(frozen=True)
class Facts:
    """What the first reading of a claim reports besides ``drawn`` (see the module)."""

    isolation: str
    # The sequence's per-session cache, increment and CYCLE (None: no such sequence).
    cache: int | None
    increment: int | None
    cycle: bool | None
    readable: bool  # the relay's role may read the sequence's last value
    drawn: int | None  # None when not readable
    # The sequence's relfilenode: ALTER SEQUENCE ... RESTART gives it a new one.
    filenode: int | None
    # Pids of the database's other backends, when asked for (``Assumptions.watch``).
    backends: frozenset[int] | None = None
    # The transaction that last wrote the sequence's settings (ALTER SEQUENCE).
    altered: int | None = None


@dataclass(frozen=True)
class Assumptions:
    """What :func:`verify` remembers between claims."""

    # Why the mark is off right now (None: it is in use).
    off: str | None = None
    drawn: int | None = None
    filenode: int | None = None
    altered: int | None = None
    # The cache was above 1 since the relay last saw no backend that could hold cached values.
    cached: bool = False
    # Backends connected when the cache was first read as 1 again (they may hold values).
    suspects: frozenset[int] | None = None

    @property
    def watch(self) -> bool:
        """Whether the next reading must list the database's backends."""
        return self.cached


@dataclass(frozen=True)
class Verdict:
    """Whether this claim may use the mark, the state for the next claim, and a line to log
    when the answer changed (``restart``: the mark starts from zero now)."""

    usable: bool
    state: Assumptions
    message: str | None = None
    restart: bool = False


def verify(state: Assumptions, facts: Facts, *, fresh: bool, sequence: str) -> Verdict:
    """Decide whether a claim whose first reading reported ``facts`` may use the mark.

    ``fresh``: the reading began its transaction (its list of backends is current);
    ``sequence`` names the sequence in the advice logged."""
    broken = _broken(facts, sequence)
    # Settings changed since the last claim: the cache may have been above 1 meanwhile.
    altered = state.altered is not None and facts.altered not in (None, state.altered)
    cached = state.cached or altered or (facts.cache is not None and facts.cache != 1)
    suspects = None if facts.cache != 1 else state.suspects
    if broken is None and cached:
        if suspects is None and fresh and facts.backends is not None:
            suspects = facts.backends
        if suspects is None:
            broken = ("cache", f"the sequence {sequence} cached values per session until lately")
        else:
            alive = suspects if facts.backends is None else suspects & facts.backends
            suspects = frozenset(alive)
            if alive:
                broken = (
                    "cached_values",
                    f"{len(alive)} backend(s) connected when {sequence} went back to CACHE 1 "
                    "may still hand out values they cached (PostgreSQL lets them use those "
                    "up); the mark stays off until they disconnect (pids "
                    f"{', '.join(map(str, sorted(alive)[:10]))}): restart the writers' "
                    "connection pools to end it sooner",
                )
            else:
                cached, suspects = False, None
    after = Assumptions(
        off=None if broken is None else broken[0],
        drawn=facts.drawn if facts.drawn is not None else state.drawn,
        filenode=facts.filenode if facts.filenode is not None else state.filenode,
        altered=facts.altered if facts.altered is not None else state.altered,
        cached=cached,
        suspects=suspects,
    )
    if broken is not None:
        message = None
        if state.off != broken[0]:
            message = (
                f"event=low_water_off reason={broken[0]}: {broken[1]}; until then claims walk "
                "the outbox from its low end"
            )
        return Verdict(False, after, message)
    if state.off is not None:
        return Verdict(
            True, after, "event=low_water_on: claims start at the low-water mark again", True
        )
    moved = _moved_back(state, facts)
    if moved is not None:
        message = f"event=low_water_restart reason={moved}: the mark starts from zero"
        return Verdict(False, after, message, True)
    return Verdict(True, after)


def _broken(facts: Facts, sequence: str) -> tuple[str, str] | None:
    """The first assumption ``facts`` break, as (code, what to do), or None."""
    if facts.isolation != READ_COMMITTED:
        return (
            "isolation",
            f"the transaction isolation is {facts.isolation}, not read committed (something "
            "overrides the relay's session options: a pooler, the driver?); give the relay "
            "sessions default_transaction_isolation = 'read committed'",
        )
    if facts.cache is None:
        return ("no_sequence", f"the outbox's id column has no sequence ({sequence})")
    if not facts.readable or facts.drawn is None:
        return (
            "privilege",
            f"the relay's role may not read {sequence}: GRANT SELECT ON SEQUENCE {sequence} "
            "TO it (deploy/sql/relay-role.sql)",
        )
    if facts.cache != 1:
        return (
            "cache",
            f"the sequence {sequence} caches {facts.cache} values per session: "
            f"ALTER SEQUENCE {sequence} CACHE 1",
        )
    if facts.increment is None or facts.increment <= 0:
        return ("increment", f"the sequence {sequence} counts down (INCREMENT {facts.increment})")
    if facts.cycle:
        return ("cycle", f"the sequence {sequence} may cycle: ALTER SEQUENCE {sequence} NO CYCLE")
    return None


def _moved_back(state: Assumptions, facts: Facts) -> str | None:
    if state.filenode is not None and facts.filenode not in (None, state.filenode):
        return "restarted (ALTER SEQUENCE ... RESTART)"
    if state.drawn is not None and facts.drawn is not None and facts.drawn < state.drawn:
        return f"moved_back (from {state.drawn} to {facts.drawn}: setval)"
    return None
