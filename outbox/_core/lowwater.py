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
