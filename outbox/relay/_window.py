"""The window engine (``outbox-relay --engine window``): batches without a row lock or a DELETE.

A lane's batch is a page of its *window*: the rows of the transactions that committed between
two snapshots, the one up to which the lane's rows were delivered and the one taken when the
window opened (:mod:`outbox._pg.window`). A window is read whole, in id order, page by page
(each page's last id is persisted with the page's results, so a crash re-sends at most a page);
only when its last page is settled does the delivered snapshot move to the window's.

Per-key order (docs/concepts.md I7) rests on two facts. The unit of work takes its keys' order
locks before it draws outbox ids, so for one key id order is commit order. And a window is never
cut by anything but id: if B (same key) committed after A, A was no longer running when B
committed, so A falls in B's window or an earlier one, and within a window A's smaller id goes
first. (Ordering by transaction id would not do: B may have drawn its xid before waiting for
A's lock.) Transactions that run long do not hold a window back: they are in the snapshot's
list of running transactions, and their rows join the window in which they commit.

No loss (docs/concepts.md I6): the cursor moves only in the transaction that records the page's
reports, after Kafka's reports. A row that failed, or that could not go out (its key stopped, the
relay stopping), is *held*: its id is kept in ``outbox_relay_held`` and its key's later rows wait
behind it, whatever window they are in; the rows a held key owes are sent first in the next batches,
until they are all confirmed (or one is parked: the key then waits for ``outbox parked retry`` or
``discard``, as with the claim engine). Rows a lane delivered stay in the table until every lane
delivered past them; they are given back by TRUNCATE when nothing else is left, else by a bulk
DELETE once many have piled up (:func:`outbox._pg.window.reclaim`).

What the window rests on is checked on every window (docs/concepts.md I15): the session's isolation,
and that transaction ids did not go backwards (a restore into another cluster): the relay then stops
with a message instead of waiting for transactions that will never come.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import sqlalchemy as sa

from outbox._core import codec
from outbox._core.delivery import ATTEMPTS, EVENT_ID, ID, KEY, ClaimedRow, settle
from outbox._kafka.producer import DeliveryReport
from outbox._pg import window as pg_window
from outbox._pg.relay import outbox_record_failures
from outbox._pg.window import Cursor, HeldRow, WindowStatements
from outbox.errors import ConfigurationError
from outbox.relay._engine import BatchResult, Host, Reset, records_of

log = logging.getLogger("outbox.relay")

# ClaimedRow's last column, as the window's queries fill it: the row is parked.
PARKED = 7

# Seconds between reclaims while rows flow, and how many delivered rows make a DELETE worth it
# when TRUNCATE cannot be had (each deleted row is a dead tuple; TRUNCATE leaves none).
RECLAIM_INTERVAL = 2.0
RECLAIM_DELETE_AFTER = 200_000
RECLAIM_DELETE_LIMIT = 200_000
# Seconds between writes of an idle lane's cursor (it moves in memory meanwhile).
IDLE_PERSIST = 1.0


def snapshot_xmax(snapshot: str) -> int:
    """The ``xmax`` of a ``pg_snapshot`` in its text form (``xmin:xmax:xip,...``)."""
    return int(snapshot.split(":")[1])


class WindowEngine:
    """Where a window relay's batches come from and what happens after their delivery."""

    # The next page of the window in progress, read ahead, with the cursor it follows.
    _ahead: tuple[Cursor, list[ClaimedRow]] | None

    def __init__(self, relay: Host) -> None:
        self.relay = relay
        self.config = relay.config
        self.sql = WindowStatements.for_schema(relay.config.schema)
        relay.metrics.window_engine()
        # Reclaim whenever idle (``Relay.run(once=True)``: a drained outbox is left empty).
        self.eager_reclaim = False
        self._forget()
        self._next_reclaim = 0.0

    def start(self, once: bool) -> None:
        self.eager_reclaim = once

    def reset(self, reason: Reset) -> None:
        """After a rollback or with a new session: forget what is known of the cursors (they
        are read again). A rebalance keeps them (the owned lanes' cursors are read again when
        the lanes changed, ``_load``) but drops the page read ahead: it was read for the lanes
        owned before, and may hold rows of a lane another relay delivers now from the same
        cursor (sent again here, they would arrive after that lane's later rows)."""
        if reason is Reset.WAKEUP:
            return
        if reason is Reset.REBALANCE:
            self._ahead = None
        else:
            self._forget()

    def _forget(self) -> None:
        self._cursors: dict[int, Cursor] = {}
        self._loaded: frozenset[int] = frozenset()
        self._held: dict[int, HeldRow] = {}
        self._persisted: dict[int, float] = {}
        self._turn = 0
        self._ahead = None

    # ------------------------------------------------------------------------------- state

    def _load(self, conn: sa.Connection, owned: Sequence[int]) -> None:
        if self._loaded == frozenset(owned):
            return
        lanes = self.config.lanes
        cursors = pg_window.cursors_read(conn, self.sql, lanes)
        other = sorted({n for n, _ in cursors.values() if n != lanes})
        if other or len(cursors) != lanes:
            raise ConfigurationError(
                f"the window relay's cursors were made for {other[0] if other else len(cursors)} "
                f"lanes, this relay serves {lanes}: run every relay with the same --lanes (or "
                "switch to the claim engine and back, which makes new cursors: docs/relay.md)"
            )
        self._cursors = {lane: c for lane, (_, c) in cursors.items()}
        self._held = {h.id: h for h in pg_window.held_read(conn, self.sql, lanes, owned)}
        conn.commit()
        self._loaded = frozenset(owned)

    def _group(self, owned: Sequence[int]) -> list[int]:
        """The owned lanes that share a cursor with the lane whose turn it is (one relay moves
        the lanes it owns together, so usually all of them)."""
        groups: dict[Cursor, list[int]] = {}
        for lane in owned:
            groups.setdefault(self._cursors[lane], []).append(lane)
        ordered = list(groups.values())
        self._turn = (self._turn + 1) % len(ordered)
        return ordered[self._turn]

    def _check(self, cursor: Cursor, opened: pg_window.Opened) -> None:
        """What a window rests on (docs/concepts.md I15); a ``ConfigurationError`` stops the
        relay."""
        if opened.isolation != "read committed":
            raise ConfigurationError(
                f"the relay's session runs at {opened.isolation}, the window engine needs read "
                "committed (remove default_transaction_isolation from the database URL, "
                "ALTER ROLE or ALTER DATABASE settings)"
            )
        xmax = snapshot_xmax(opened.window)
        if cursor.delivered is not None and xmax < snapshot_xmax(cursor.delivered):
            raise ConfigurationError(
                f"transaction ids went backwards: the window relay's cursor is at transaction "
                f"{snapshot_xmax(cursor.delivered)}, the server at {xmax} (a restore into "
                "another cluster?); no row committed after the restore would be sent: resync the "
                "cursors (docs/relay.md, 'After a restore') before starting the relay again"
            )
        if opened.max_txid is not None and opened.max_txid >= xmax:
            raise ConfigurationError(
                f"outbox rows carry transaction ids up to {opened.max_txid}, beyond the server's "
                f"{xmax} (restored from another cluster?): the window engine would never see them; "
                "resync them (docs/relay.md, 'After a restore') before starting the relay again"
            )

    # ------------------------------------------------------------------------------- batch

    def process_batch(self, conn: sa.Connection, result: BatchResult) -> BatchResult:
        relay = self.relay
        owned = sorted(relay.lanes.owned)
        if not owned:
            return result
        started = time.monotonic()
        self._load(conn, owned)
        group = self._group(owned)
        cursor = self._cursors[group[0]]
        lanes = self.config.lanes
        if cursor.opened is None:
            opened = pg_window.window_open(conn, self.sql, lanes, group, cursor)
            self._check(cursor, opened)
            if opened.rows:
                assert opened.low is not None and opened.high is not None
                cursor = Cursor(cursor.delivered, opened.window, opened.low - 1, opened.high)
            else:
                cursor = Cursor(opened.window, None, 0, 0)
        page: list[ClaimedRow] = []
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == cursor:
            page = ahead[1]  # read while Kafka confirmed the page before
        elif cursor.opened is not None:
            page = pg_window.window_page(
                conn, self.sql, lanes, group, cursor, self.config.batch_size
            )
        held = {h.id: h for h in self._held.values() if h.key_hash % lanes in group}
        owed = pg_window.held_owed(conn, self.sql, lanes, group, cursor) if held else []
        if cursor.opened is not None and (
            len(page) < self.config.batch_size or page[-1][ID] >= cursor.high
        ):
            after = Cursor(cursor.opened, None, 0, 0)  # the window's last page
        elif page:
            after = Cursor(cursor.delivered, cursor.opened, page[-1][ID], cursor.high)
        else:
            after = cursor
        rows, exclude = self._sendable(owed, page, held)
        if not rows and not exclude and not owed and not page:
            self._idle(conn, group, after)
            return result
        result.claimed = len(page) + len(owed)
        # More of the window to come, and nothing held: its next page is read while Kafka
        # confirms this one (reads take no lock, so nothing waits for the batch's reports).
        ahead_of = after if after.opened is not None and not held and not exclude else None
        return self._deliver(
            conn, group, after, rows, [*owed, *page], exclude, held, result, started, ahead_of
        )

    def _sendable(
        self, owed: list[ClaimedRow], page: list[ClaimedRow], held: dict[int, HeldRow]
    ) -> tuple[list[ClaimedRow], dict[bytes | int, int]]:
        """The rows to send now, in id order: the owed rows of held keys up to the first parked
        one, then the window's rows of keys not held; and per key (a key-less row: its id), the
        first row that must wait (held from there after this batch)."""
        wait: dict[bytes | int, int] = {}
        if not owed and not held and not any(row[PARKED] for row in page):
            return page, wait  # the usual batch: the window's rows, in id order, all sendable
        held_keys = {h.key for h in held.values() if h.key is not None}
        rows: list[ClaimedRow] = []
        for row in owed:
            key = row[KEY]
            name: bytes | int = key if key is not None else row[ID]
            if name in wait:
                continue
            if row[PARKED]:
                wait[name] = row[ID]
            else:
                rows.append(row)
        for row in page:
            key = row[KEY]
            name = key if key is not None else row[ID]
            if name in wait or (key is not None and key in held_keys):
                wait.setdefault(name, row[ID])
            elif row[PARKED]:
                wait[name] = row[ID]
            else:
                rows.append(row)
        rows.sort(key=lambda r: r[ID])
        return rows, wait

    def _idle(self, conn: sa.Connection, group: list[int], after: Cursor) -> None:
        now = time.monotonic()
        before = self._cursors[group[0]]
        # A window's end is written at once (the rows it held are delivered); a snapshot that
        # only moves on while nothing is committed, at most every IDLE_PERSIST seconds.
        if before.opened is not None or (
            after != before and now >= self._persisted.get(group[0], 0.0)
        ):
            pg_window.cursor_write(conn, self.sql, group, after)
            for lane in group:
                self._persisted[lane] = now + IDLE_PERSIST
        conn.commit()
        for lane in group:
            self._cursors[lane] = after
        if self.eager_reclaim or now >= self._next_reclaim:
            self.reclaim(conn, delete_after=1 if self.eager_reclaim else RECLAIM_DELETE_AFTER)

    def stats(self, conn: sa.Connection) -> dict[str, tuple[int, int, float]]:
        """Per topic, for /metrics: rows of the owned lanes not yet past their cursors, parked
        rows, and the oldest pending row's age."""
        owned = sorted(self.relay.lanes.owned)
        by_topic: dict[str, tuple[int, int, float]] = {}
        if owned:
            self._load(conn, owned)
            delivered = [self._cursors[lane].delivered for lane in owned]
            floor = None
            if all(d is not None for d in delivered):
                floor = min(int(d.split(":")[0]) for d in delivered if d is not None)
            by_topic = pg_window.window_stats(conn, self.sql, self.config.lanes, owned, floor)
        # The rows not past the cursors: the table also holds delivered rows.
        self.relay.metrics.window_backlog.set(sum(v[0] for v in by_topic.values()))
        return by_topic

    def reclaim(self, conn: sa.Connection, delete_after: int = RECLAIM_DELETE_AFTER) -> None:
        """Give back the delivered rows' space (see :func:`outbox._pg.window.reclaim`)."""
        self._next_reclaim = time.monotonic() + RECLAIM_INTERVAL
        done = pg_window.reclaim(
            conn, self.sql, self.config.lanes, delete_after, RECLAIM_DELETE_LIMIT
        )
        if done.truncated or done.deleted:
            self.relay.metrics.window_reclaims(done.truncated, done.deleted)
            log.debug("event=window_reclaim truncated=%s deleted=%d", done.truncated, done.deleted)

    def _deliver(
        self,
        conn: sa.Connection,
        group: list[int],
        after: Cursor,
        rows: list[ClaimedRow],
        fetched: list[ClaimedRow],
        wait: dict[bytes | int, int],
        held: dict[int, HeldRow],
        result: BatchResult,
        started: float,
        ahead_of: Cursor | None = None,
    ) -> BatchResult:
        relay = self.relay
        records, unsendable = records_of(rows)
        ids = [r[ID] for r in rows]

        def read_ahead_page() -> Future[list[ClaimedRow]]:
            assert ahead_of is not None
            return relay.database_thread().submit(
                pg_window.window_page,
                conn,
                self.sql,
                self.config.lanes,
                group,
                ahead_of,
                self.config.batch_size,
            )

        reading: Future[list[ClaimedRow]] | None = None
        reports: Sequence[DeliveryReport | None] = []
        if rows:
            reports, result.sent, reading = relay.producing.send(
                rows,
                records,
                unsendable,
                alongside=read_ahead_page if ahead_of is not None and not unsendable else None,
            )
        verdict = settle(ids, [r[ATTEMPTS] for r in rows], reports, self.config.max_attempts)
        read_ahead = None
        # The connection is this thread's again once the page read ahead is in (or failed: the
        # statements below then fail the batch as any database error does).
        if reading is not None and reading.exception() is None:
            read_ahead = reading.result()
        if verdict.outage:
            # Nothing got through: the broker is the problem. The cursor stays; the page is
            # read again after the back-off (its confirmed rows, if any, are sent again).
            conn.rollback()
            result.outage = True
            result.failed = verdict.failed
            failures = [o for o in reports if o is not None and not o.ok]
            result.error = failures[0].error if failures else None
            return result
        if len(verdict.delete) < len(rows):  # some row not confirmed: its key waits
            for row, report in zip(rows, reports, strict=True):
                if report is None or report.error is not None:
                    key = row[KEY]
                    name: bytes | int = key if key is not None else row[ID]
                    wait[name] = min(wait.get(name, row[ID]), row[ID])
        drop, add = self._held_changes(held, fetched, wait)
        if verdict.fail_ids:
            outbox_record_failures(
                conn, relay.sql, verdict.fail_ids, verdict.fail_errors, verdict.fail_park
            )
        pg_window.held_write(conn, self.sql, drop, add)
        pg_window.cursor_write(conn, self.sql, group, after)
        conn.commit()
        if ahead_of is not None and read_ahead is not None and not relay.stop_event.is_set():
            self._ahead = (ahead_of, read_ahead)
        for held_id in drop:
            self._held.pop(held_id, None)
        self._held.update({h.id: h for h in add})
        now = time.monotonic()
        for lane in group:
            self._cursors[lane] = after
            self._persisted[lane] = now + IDLE_PERSIST
        result.settled(verdict, reports)
        relay.report(rows, reports, verdict, result, time.monotonic() - started)
        if self.eager_reclaim and not result.sent:
            self.reclaim(conn, delete_after=1)
        elif after.opened is None and now >= self._next_reclaim:
            self.reclaim(conn)
        return result

    def _held_changes(
        self,
        held: dict[int, HeldRow],
        fetched: list[ClaimedRow],
        wait: dict[bytes | int, int],
    ) -> tuple[list[int], list[HeldRow]]:
        """The held rows to forget and those to hold after this batch: a key (a key-less row)
        is held from its first row that must wait, and no longer once nothing waits."""
        by_name: dict[bytes | int, HeldRow] = {
            (h.key if h.key is not None else h.id): h for h in held.values()
        }
        drop: list[int] = []
        add: list[HeldRow] = []
        for name, old in by_name.items():
            new = wait.get(name)
            if new != old.id:
                drop.append(old.id)
                if new is not None:
                    add.append(HeldRow(new, old.key_hash, old.key))
        fresh = [name for name in wait if name not in by_name]
        if fresh:
            rows = {r[ID]: r for r in fetched}
            for name in fresh:
                first = wait[name]
                if isinstance(name, bytes):
                    add.append(HeldRow(first, codec.key_hash(name, b""), name))
                else:
                    event_id = uuid.UUID(rows[first][EVENT_ID].decode("ascii"))
                    add.append(HeldRow(first, codec.key_hash(None, event_id.bytes), None))
        return drop, add
