"""The window relay's PostgreSQL side: its SQL, written once (see :mod:`outbox.relay._window`).

A lane's *window* is the set of its outbox rows whose transactions committed after the lane's
``delivered`` snapshot and by the ``window`` snapshot taken when the window opened
(``pg_current_snapshot()``): ``pg_visible_in_snapshot(txid, window) AND NOT
pg_visible_in_snapshot(txid, delivered)``. Both snapshots are fixed once the window opens, so the
set is too, and the relay can walk it by id in pages, persisting the last id sent. Reading it
takes no row lock and changes no row; nothing is deleted per row.

The index on ``txid`` finds a window's rows the way PgQ does: the ids at or above the
delivered snapshot's ``xmax`` (assigned after it), plus the ids that were still running in it
(its ``xip`` list); everything below its ``xmin`` had finished and is visible to it. Snapshots
travel as their text form (``xmin:xmax:xip,...``) and are cast to ``pg_snapshot`` in SQL; every
value is a bound parameter, table names are allow-listed and quoted
(:func:`outbox._pg.statements.qualified`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox._core.delivery import ClaimedRow
from outbox._pg.statements import qualified
from outbox.schema import OUTBOX, RELAY_HELD, RELAY_WINDOWS, validate_schema_name

_LANE = "(o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])"

# The rows a window holds (the delivered snapshot NULL: a lane's first window holds every row
# committed by the window snapshot, and those written before migration 0007, without a txid).
_IN_WINDOW = """
  CASE WHEN %(delivered)s::text IS NULL
       THEN (o.txid IS NULL OR pg_visible_in_snapshot(o.txid, %(opened)s::pg_snapshot))
       ELSE (o.txid >= pg_snapshot_xmin(%(delivered)s::pg_snapshot)
             AND pg_visible_in_snapshot(o.txid, %(opened)s::pg_snapshot)
             AND NOT pg_visible_in_snapshot(o.txid, %(delivered)s::pg_snapshot))
  END"""

# The same rows for a page, with nothing the planner can use an index of `txid` for: a page walks
# the primary key (below). Given `o.txid >= ...`, the planner, whose statistics end before the
# transactions of the window, took the window's rows through `txid` and filtered them by id, for
# every page. (The comparison adds nothing: a txid below a snapshot's xmin is visible in it.)
_IN_WINDOW_BY_ID = """
  CASE WHEN %(delivered)s::text IS NULL
       THEN (o.txid IS NULL OR pg_visible_in_snapshot(o.txid, %(opened)s::pg_snapshot))
       ELSE (pg_visible_in_snapshot(o.txid, %(opened)s::pg_snapshot)
             AND NOT pg_visible_in_snapshot(o.txid, %(delivered)s::pg_snapshot))
  END"""

# Opens a window: the current snapshot, and the lowest id, highest id and number of rows of the
# window it closes (from the delivered snapshot to it), with what the window rests on
# (docs/concepts.md I15): the session's isolation, and the highest txid in the table (beyond the
# snapshot's xmax only when the rows came from another cluster, a restore from a dump). In one
# statement, so that the snapshot returned is the one the rows were counted in. Two index range
# scans of `txid`: the ids assigned after the delivered snapshot, and those running in it.
WINDOW_OPEN = f"""
SELECT pg_current_snapshot()::text, current_setting('transaction_isolation'),
       (SELECT max(txid) FROM {{outbox}})::text,
       w.n, w.low, w.high
FROM (
    SELECT count(*) AS n, min(id) AS low, max(id) AS high FROM (
        SELECT o.id FROM {{outbox}} o
        WHERE %(delivered)s::text IS NOT NULL
          AND o.txid >= pg_snapshot_xmax(%(delivered)s::pg_snapshot)
          AND o.txid < pg_snapshot_xmax(pg_current_snapshot())
          AND pg_visible_in_snapshot(o.txid, pg_current_snapshot())
          AND {_LANE}
        UNION ALL
        SELECT o.id FROM {{outbox}} o
        WHERE %(delivered)s::text IS NOT NULL
          AND o.txid = ANY(ARRAY(SELECT pg_snapshot_xip(%(delivered)s::pg_snapshot)))
          AND pg_visible_in_snapshot(o.txid, pg_current_snapshot())
          AND {_LANE}
        UNION ALL
        SELECT o.id FROM {{outbox}} o
        WHERE %(delivered)s::text IS NULL
          AND (o.txid IS NULL OR pg_visible_in_snapshot(o.txid, pg_current_snapshot()))
          AND {_LANE}
    ) r
) w
"""

# The next rows of a window in a range of ids after the last id sent, in id order (a walk of the
# primary key; the window's set is fixed, so a LIMIT here cuts no window). The range is bounded
# above as well as the LIMIT: without the bound the planner, which cannot tell how many rows the
# snapshot tests keep, scanned and sorted the whole window for every page (200 ms a page of 5,000
# out of 60,000, against 5 ms for the range). Columns as the claim returns them
# (outbox._core.delivery.ClaimedRow), the last one saying whether the row is parked (a row the
# claim relay parked before the switch to windows).
WINDOW_PAGE = f"""
SELECT o.id, o.attempts, o.topic, o.key, o.value, o.headers::text,
       convert_to(o.event_id::text, 'UTF8'), o.parked_at IS NOT NULL
FROM {{outbox}} o
WHERE o.id > %(done)s AND o.id <= %(end)s
  AND {_LANE}
  AND {_IN_WINDOW_BY_ID}
ORDER BY o.id
LIMIT %(batch_size)s
"""

# The rows owed for the held keys of the owned lanes: a held key's rows from its held row on
# that are behind the cursor (delivered by the windows, or sent from the window in progress),
# in id order; a key-less held row is owed alone.
HELD_OWED = f"""
SELECT o.id, o.attempts, o.topic, o.key, o.value, o.headers::text,
       convert_to(o.event_id::text, 'UTF8'), o.parked_at IS NOT NULL
FROM {{held}} h
JOIN {{outbox}} o ON o.key_hash = h.key_hash AND o.id >= h.id
     AND ((h.key IS NULL AND o.id = h.id) OR (h.key IS NOT NULL AND o.key = h.key))
WHERE (h.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND (
    (%(delivered)s::text IS NOT NULL
     AND (o.txid IS NULL OR pg_visible_in_snapshot(o.txid, %(delivered)s::pg_snapshot)))
    OR (%(opened)s::text IS NOT NULL AND o.id <= %(done)s AND {_IN_WINDOW})
  )
ORDER BY o.id
"""

HELD_READ = """
SELECT h.id, h.key_hash, h.key FROM {held} h
WHERE (h.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
"""

# Parked rows no held key covers (parked by the claim engine before a switch to windows, behind
# the cursor): held from the first of each key, so that the key's later rows wait behind it and
# `outbox parked retry` sends it again.
HELD_ADOPT = """
INSERT INTO {held} (id, key_hash, key)
SELECT DISTINCT ON (o.key_hash, o.key, CASE WHEN o.key IS NULL THEN o.id END)
       o.id, o.key_hash, o.key
FROM {outbox} o
WHERE o.parked_at IS NOT NULL
  AND (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND NOT EXISTS (SELECT 1 FROM {held} h
                  WHERE h.key_hash = o.key_hash
                    AND ((h.key IS NULL AND h.id = o.id) OR h.key = o.key))
ORDER BY o.key_hash, o.key, CASE WHEN o.key IS NULL THEN o.id END, o.id
ON CONFLICT DO NOTHING
"""

CURSORS_ENSURE = """
INSERT INTO {windows} (lane, lanes)
SELECT g, %(lanes)s FROM generate_series(0, %(lanes)s - 1) g
WHERE NOT EXISTS (SELECT 1 FROM {windows})
ON CONFLICT DO NOTHING
"""

CURSORS_READ = (
    "SELECT lane, lanes, delivered, opened, done_id, high_id FROM {windows} ORDER BY lane"
)

CURSORS_WRITE = """
UPDATE {windows}
SET delivered = %(delivered)s, opened = %(opened)s, done_id = %(done)s, high_id = %(high)s,
    updated_at = now()
WHERE lane = ANY(%(owned)s::integer[])
"""

# Space back (outside the batches): the rows their lane delivered -- visible in the lane's
# delivered snapshot; below the oldest delivered snapshot's xmin every row is -- that no held key
# still owes. By TRUNCATE when nothing else is left (no dead tuple at all): only under a lock
# taken with NOWAIT, so that neither writers nor a pg_dump ever wait for it (a writer with rows
# in flight holds the table's ROW EXCLUSIVE lock, which makes the NOWAIT fail); and only when,
# under that lock (no row can commit meanwhile), no row is left that a lane has yet to deliver.
# Else by a bounded DELETE of the delivered rows, once enough have piled up.
RECLAIM_HORIZON = """
SELECT CASE WHEN count(*) = %(lanes)s AND count(delivered) = count(*)
            THEN min(pg_snapshot_xmin(delivered::pg_snapshot))::text END
FROM {windows}
"""

_DELIVERED = """(o.txid IS NULL OR o.txid < %(horizon)s::xid8
     OR pg_visible_in_snapshot(o.txid, (SELECT w.delivered::pg_snapshot FROM {windows} w
                                         WHERE w.lane = o.key_hash %% %(lanes)s)))"""

RECLAIM_LOCK = "LOCK TABLE {outbox} IN ACCESS EXCLUSIVE MODE NOWAIT"

RECLAIM_ALL_DELIVERED = f"""
SELECT NOT EXISTS (SELECT 1 FROM {{outbox}} o
                   WHERE o.txid >= %(horizon)s::xid8 AND NOT {_DELIVERED})
   AND NOT EXISTS (SELECT 1 FROM {{outbox}} WHERE parked_at IS NOT NULL)
   AND NOT EXISTS (SELECT 1 FROM {{held}})
"""

RECLAIM_TRUNCATE = "TRUNCATE {outbox}"

_RECLAIMABLE = f"""
    SELECT o.id FROM {{outbox}} o
    WHERE {_DELIVERED}
      AND o.parked_at IS NULL
      AND NOT EXISTS (
          SELECT 1 FROM {{held}} h
          WHERE h.key_hash = o.key_hash AND h.id <= o.id
            AND ((h.key IS NULL AND h.id = o.id) OR h.key = o.key))"""

# The oldest transaction id VACUUM must still keep rows for (the xmin horizon: open snapshots,
# transactions, prepared transactions, replication slots), as xid8. Rows deleted above it would
# stay behind as dead tuples VACUUM cannot remove (and cost a DELETE for no space): the DELETE
# reclaim leaves those for TRUNCATE, or for when the horizon moved on.
VACUUM_HORIZON = """
SELECT (SELECT min(CASE WHEN h.x <= (c.x & 4294967295)
                        THEN ((c.x >> 32) << 32) + h.x
                        ELSE (((c.x >> 32) - 1) << 32) + h.x END)
        FROM (SELECT backend_xmin::text::bigint AS x FROM pg_stat_activity
              WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
                AND datname = current_database()
              UNION ALL SELECT backend_xid::text::bigint FROM pg_stat_activity
              WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
                AND datname = current_database()
              UNION ALL SELECT transaction::text::bigint FROM pg_prepared_xacts
              WHERE database = current_database()
              UNION ALL SELECT xmin::text::bigint FROM pg_replication_slots
              WHERE xmin IS NOT NULL) h)::text
FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS x) c
"""

RECLAIM_DELETE = f"""DELETE FROM {{outbox}} d WHERE d.id IN ({_RECLAIMABLE}
      AND (%(vacuum)s::xid8 IS NULL OR o.txid < %(vacuum)s::xid8)
    LIMIT %(limit)s)"""

# Rows a DELETE reclaim would take (counted up to the number that makes it worth it).
RECLAIM_COUNT = f"""SELECT count(*) FROM ({_RECLAIMABLE}
      AND (%(vacuum)s::xid8 IS NULL OR o.txid < %(vacuum)s::xid8)
    LIMIT %(limit)s) r"""


# Per topic: rows of the owned lanes not yet past their cursors, with the oldest one's age (from
# the lowest xmin of their delivered snapshots on: below it every row is delivered), and the
# parked rows (through the small partial index ix_outbox_parked). Never a scan of the rows
# delivered and not given back yet, which a held horizon can make millions. The cursors are
# joined once (a hash of 32 rows), not looked up per row: under a held horizon every cursor
# write leaves a version of its row behind, and a lookup per row walked them all (a 300,000-row
# backlog took minutes, and held the relay's loop that long).
WINDOW_STATS = """
SELECT o.topic, count(*), 0, EXTRACT(EPOCH FROM now() - min(o.created_at))
FROM {outbox} o
LEFT JOIN (SELECT w.lane, w.delivered::pg_snapshot AS delivered FROM {windows} w) w
       ON w.lane = o.key_hash %% %(lanes)s
WHERE (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND o.parked_at IS NULL
  AND (%(floor)s::xid8 IS NULL OR o.txid >= %(floor)s::xid8)
  AND NOT coalesce(pg_visible_in_snapshot(o.txid, w.delivered), false)
GROUP BY o.topic
UNION ALL
SELECT p.topic, 0, count(*), 0 FROM {outbox} p WHERE p.parked_at IS NOT NULL GROUP BY p.topic
"""


@dataclass(frozen=True)
class WindowStatements:
    """The window relay's SQL for one schema."""

    open: str
    page: str
    owed: str
    held: str
    adopt: str
    ensure: str
    cursors: str
    write: str
    horizon: str
    lock: str
    all_delivered: str
    truncate: str
    delete: str
    count: str
    vacuum: str
    stats: str
    outbox: str
    held_table: str

    @classmethod
    def for_schema(cls, schema: str | None) -> WindowStatements:
        schema = validate_schema_name(schema)
        names = {
            "outbox": qualified(schema, OUTBOX),
            "held": qualified(schema, RELAY_HELD),
            "windows": qualified(schema, RELAY_WINDOWS),
        }
        return cls(
            open=WINDOW_OPEN.format(**names),
            page=WINDOW_PAGE.format(**names),
            owed=HELD_OWED.format(**names),
            held=HELD_READ.format(**names),
            adopt=HELD_ADOPT.format(**names),
            ensure=CURSORS_ENSURE.format(**names),
            cursors=CURSORS_READ.format(**names),
            write=CURSORS_WRITE.format(**names),
            horizon=RECLAIM_HORIZON.format(**names),
            lock=RECLAIM_LOCK.format(**names),
            all_delivered=RECLAIM_ALL_DELIVERED.format(**names),
            truncate=RECLAIM_TRUNCATE.format(**names),
            delete=RECLAIM_DELETE.format(**names),
            count=RECLAIM_COUNT.format(**names),
            vacuum=VACUUM_HORIZON,
            stats=WINDOW_STATS.format(**names),
            outbox=names["outbox"],
            held_table=names["held"],
        )


@dataclass(frozen=True)
class Cursor:
    """A lane's cursor: the snapshot up to which its rows are delivered (``None``: none yet),
    the window in progress (``None``: none), the last id sent of it and its highest id."""

    delivered: str | None
    opened: str | None
    done: int
    high: int


@dataclass(frozen=True)
class Opened:
    """A window just opened: its snapshot, the facts it rests on, and its rows' id range."""

    window: str
    isolation: str
    max_txid: int | None
    rows: int
    low: int | None
    high: int | None


@dataclass(frozen=True)
class HeldRow:
    id: int
    key_hash: int
    key: bytes | None


def _driver(conn: sa.Connection) -> psycopg.Connection[Any]:
    driver: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    return driver


def _begin(conn: sa.Connection) -> psycopg.Connection[Any]:
    if not conn.in_transaction():
        conn.begin()
    return _driver(conn)


def _lane_params(lanes: int, owned: Sequence[int], cursor: Cursor) -> dict[str, Any]:
    return {
        "lanes": lanes,
        "owned": list(owned),
        "delivered": cursor.delivered,
        "opened": cursor.opened,
        "done": cursor.done,
    }


def cursors_read(
    conn: sa.Connection, sql: WindowStatements, lanes: int
) -> dict[int, tuple[int, Cursor]]:
    """Every lane's cursor (created for ``lanes`` lanes where there are none yet), with the lane
    count it was made for."""
    driver = _begin(conn)
    with driver.cursor() as cur:
        cur.execute(sql.ensure, {"lanes": lanes})
        cur.execute(sql.cursors)
        rows = cur.fetchall()
    conn.commit()
    return {int(r[0]): (int(r[1]), Cursor(r[2], r[3], int(r[4]), int(r[5]))) for r in rows}


def window_open(
    conn: sa.Connection, sql: WindowStatements, lanes: int, owned: Sequence[int], cursor: Cursor
) -> Opened:
    """Take a snapshot and describe the window from ``cursor.delivered`` to it."""
    params = _lane_params(lanes, owned, cursor)
    with _begin(conn).cursor() as cur:
        cur.execute(sql.open, params)
        row = cur.fetchone()
    assert row is not None
    window, isolation, max_txid, rows, low, high = row
    return Opened(
        window, isolation, None if max_txid is None else int(max_txid), int(rows), low, high
    )


def window_page(
    conn: sa.Connection,
    sql: WindowStatements,
    lanes: int,
    owned: Sequence[int],
    cursor: Cursor,
    batch_size: int,
) -> list[ClaimedRow]:
    """The window's next rows after ``cursor.done`` (at most ``batch_size``), in id order.

    Read range by range of ids (see WINDOW_PAGE) until ``batch_size`` rows are in or the
    window's highest id is passed: fewer rows than ``batch_size`` means the window's last page.
    A range that held fewer rows than asked for (other lanes' rows, rows of later windows) makes
    the next one wider in proportion."""
    params = {**_lane_params(lanes, owned, cursor), "batch_size": batch_size}
    rows: list[ClaimedRow] = []
    done, span = cursor.done, 2 * batch_size
    with _begin(conn).cursor(binary=True) as cur:
        while done < cursor.high:
            wanted = batch_size - len(rows)
            end = min(cursor.high, done + span)
            cur.execute(sql.page, {**params, "done": done, "end": end, "batch_size": wanted})
            got: list[ClaimedRow] = cur.fetchall()
            rows += got
            if len(got) == wanted:
                break
            # The range held `got` rows of `end - done` ids: the next one is sized to hold what
            # is still wanted at that density (twice over), within bounds.
            span = min(64 * batch_size, max(span, 2 * wanted * (end - done) // max(1, len(got))))
            done = end
    return rows


def held_read(
    conn: sa.Connection, sql: WindowStatements, lanes: int, owned: Sequence[int]
) -> list[HeldRow]:
    """The held rows of the ``owned`` lanes (after holding the parked rows none covers)."""
    with _begin(conn).cursor() as cur:
        cur.execute(sql.adopt, {"lanes": lanes, "owned": list(owned)})
        cur.execute(sql.held, {"lanes": lanes, "owned": list(owned)})
        return [HeldRow(int(r[0]), int(r[1]), r[2]) for r in cur.fetchall()]


def held_owed(
    conn: sa.Connection, sql: WindowStatements, lanes: int, owned: Sequence[int], cursor: Cursor
) -> list[ClaimedRow]:
    """The rows the held keys of ``owned`` lanes owe, in id order."""
    with _begin(conn).cursor(binary=True) as cur:
        cur.execute(sql.owed, _lane_params(lanes, owned, cursor))
        rows: list[ClaimedRow] = cur.fetchall()
    return rows


def held_write(
    conn: sa.Connection,
    sql: WindowStatements,
    drop: Sequence[int],
    add: Sequence[HeldRow],
) -> None:
    """Forget the held rows ``drop`` and hold ``add`` (in the batch's transaction)."""
    with _begin(conn).cursor() as cur:
        if drop:
            cur.execute(f"DELETE FROM {sql.held_table} WHERE id = ANY(%s::bigint[])", (list(drop),))
        if add:
            cur.execute(
                f"INSERT INTO {sql.held_table} (id, key_hash, key) "
                "SELECT * FROM unnest(%s::bigint[], %s::integer[], %s::bytea[]) "
                "ON CONFLICT (id) DO NOTHING",
                ([h.id for h in add], [h.key_hash for h in add], [h.key for h in add]),
            )


def cursor_write(
    conn: sa.Connection, sql: WindowStatements, owned: Sequence[int], cursor: Cursor
) -> None:
    """Persist the owned lanes' cursor (in the batch's transaction)."""
    with _begin(conn).cursor() as cur:
        cur.execute(
            sql.write,
            {
                "owned": list(owned),
                "delivered": cursor.delivered,
                "opened": cursor.opened,
                "done": cursor.done,
                "high": cursor.high,
            },
        )


@dataclass(frozen=True)
class Reclaimed:
    """What a reclaim did: truncated the table, or deleted ``deleted`` rows (or nothing)."""

    truncated: bool = False
    deleted: int = 0


def reclaim(
    conn: sa.Connection, sql: WindowStatements, lanes: int, delete_after: int, limit: int
) -> Reclaimed:
    """Give back the space of the rows every lane delivered (see RECLAIM_* above); commits."""
    driver = _begin(conn)
    try:
        with driver.cursor() as cur:
            cur.execute(sql.horizon, {"lanes": lanes})
            row = cur.fetchone()
            assert row is not None
            horizon = row[0]
            params = {"horizon": horizon, "lanes": lanes}
            if horizon is None:
                return Reclaimed()
            cur.execute("SAVEPOINT outbox_reclaim")
            try:
                cur.execute(sql.lock)
            except psycopg.errors.LockNotAvailable:
                cur.execute("ROLLBACK TO SAVEPOINT outbox_reclaim")
            else:
                cur.execute(sql.all_delivered, params)
                done = cur.fetchone()
                if done is not None and done[0]:
                    try:
                        cur.execute(sql.truncate)
                    except psycopg.errors.InsufficientPrivilege:
                        pass  # without TRUNCATE (deploy/sql/relay-role.sql): a DELETE below
                    else:
                        return Reclaimed(truncated=True)
                cur.execute("ROLLBACK TO SAVEPOINT outbox_reclaim")  # the lock goes
            cur.execute(sql.vacuum)
            kept = cur.fetchone()
            params["vacuum"] = None if kept is None else kept[0]
            cur.execute(sql.count, {**params, "limit": delete_after})
            counted = cur.fetchone()
            if counted is None or int(counted[0]) < delete_after:
                return Reclaimed()
            cur.execute(sql.delete, {**params, "limit": limit})
            return Reclaimed(deleted=cur.rowcount)
    finally:
        conn.commit()


def window_stats(
    conn: sa.Connection, sql: WindowStatements, lanes: int, owned: Sequence[int], floor: int | None
) -> dict[str, tuple[int, int, float]]:
    """Per topic: rows of the ``owned`` lanes their cursors are not past yet, parked rows, and
    the oldest pending row's age (see WINDOW_STATS); in a transaction the caller commits."""
    params = {"lanes": lanes, "owned": list(owned), "floor": None if floor is None else str(floor)}
    out: dict[str, tuple[int, int, float]] = {}
    with _begin(conn).cursor() as cur:
        cur.execute(sql.stats, params)
        for topic, pending, parked, age in cur.fetchall():
            was = out.get(topic, (0, 0, 0.0))
            out[topic] = (was[0] + int(pending), was[1] + int(parked), max(was[2], float(age or 0)))
    return out


# For `outbox status`: every lane's cursor -- whether it has delivered anything, the window in
# progress and how far into it, transaction ids committed since its delivered snapshot, when it
# was written -- and its held rows (read in the status' snapshot, no lock).
WINDOWS_STATUS = """
SELECT w.lane, w.lanes, w.delivered IS NOT NULL, w.opened IS NOT NULL, w.done_id, w.high_id,
       CASE WHEN w.delivered IS NOT NULL
            THEN (pg_snapshot_xmax(pg_current_snapshot())::text::bigint
                  - pg_snapshot_xmax(w.delivered::pg_snapshot)::text::bigint) END,
       EXTRACT(EPOCH FROM now() - w.updated_at)::float8,
       (SELECT count(*) FROM {held} h WHERE h.key_hash %% w.lanes = w.lane),
       CASE WHEN w.delivered IS NOT NULL
            THEN pg_snapshot_xmin(w.delivered::pg_snapshot)::text END
FROM {windows} w
ORDER BY w.lane
"""

# Per lane: rows not parked and not yet past the lane's cursor, and the oldest one's age; from
# the lowest xmin of the delivered snapshots on through the txid index (NULL: some lane has
# delivered nothing yet, every row counts). A row without txid (written before 0007) is
# delivered once its lane has delivered a window.
WINDOWS_BACKLOG = """
SELECT w.lane, count(*), EXTRACT(EPOCH FROM now() - min(o.created_at))::float8
FROM {outbox} o
JOIN {windows} w ON w.lane = o.key_hash %% %(lanes)s
WHERE o.parked_at IS NULL
  AND (%(floor)s::xid8 IS NULL OR o.txid >= %(floor)s::xid8)
  AND CASE WHEN w.delivered IS NULL THEN true
           WHEN o.txid IS NULL THEN false
           ELSE NOT pg_visible_in_snapshot(o.txid, w.delivered::pg_snapshot) END
GROUP BY w.lane
"""


@dataclass(frozen=True)
class LaneWindow:
    """A lane's cursor as ``outbox status`` shows it."""

    lane: int
    lanes: int  # the lane count the cursors were made for
    delivered: bool  # a window was delivered (else the first window holds every row)
    in_progress: bool  # a window is open; ``done`` of its ids up to ``high`` are sent
    done: int
    high: int
    xids_behind: int | None  # transaction ids assigned since the delivered snapshot
    written_age: float  # seconds since the cursor was last written
    held: int  # held rows (failed or parked keys) of the lane
    backlog: int  # rows not parked and not yet past the cursor
    oldest_age: float | None  # the oldest of those, in seconds


def windows_status(conn: sa.Connection, schema: str | None) -> list[LaneWindow]:
    """Every lane's cursor, held rows and backlog (empty while no window relay has run, or on a
    schema migrated to before 0007), in the caller's transaction."""
    names = {
        "outbox": qualified(validate_schema_name(schema), OUTBOX),
        "held": qualified(validate_schema_name(schema), RELAY_HELD),
        "windows": qualified(validate_schema_name(schema), RELAY_WINDOWS),
    }
    driver = _driver(conn)
    if not conn.in_transaction():
        conn.begin()
    with driver.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (names["windows"],))
        found = cur.fetchone()
        if not (found and found[0]):
            return []
        cur.execute(WINDOWS_STATUS.format(**names), {})
        cursors = cur.fetchall()
        if not cursors:
            return []
        xmins = [int(r[9]) for r in cursors if r[9] is not None]
        floor = str(min(xmins)) if len(xmins) == len(cursors) else None
        cur.execute(WINDOWS_BACKLOG.format(**names), {"lanes": int(cursors[0][1]), "floor": floor})
        backlog = {int(r[0]): (int(r[1]), None if r[2] is None else float(r[2])) for r in cur}
    return [
        LaneWindow(
            lane=int(r[0]),
            lanes=int(r[1]),
            delivered=bool(r[2]),
            in_progress=bool(r[3]),
            done=int(r[4]),
            high=int(r[5]),
            xids_behind=None if r[6] is None else int(r[6]),
            written_age=float(r[7]),
            held=int(r[8]),
            backlog=backlog.get(int(r[0]), (0, None))[0],
            oldest_age=backlog.get(int(r[0]), (0, None))[1],
        )
        for r in cursors
    ]
