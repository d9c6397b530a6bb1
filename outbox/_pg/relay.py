"""The relay's PostgreSQL side: its SQL, written once, and the session it runs on.

The claim and the delete run on the driver's cursor (psycopg placeholders; the hot path skips
SQLAlchemy's result machinery, thousands of rows per batch), the rest through SQLAlchemy. The
table name is an allow-listed schema, quoted by :func:`outbox._pg.statements.qualified`; values
always travel as bound parameters.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox._core.delivery import ClaimedRow
from outbox._core.lanes import APPLICATION_NAME
from outbox._core.lowwater import Facts
from outbox._pg.statements import qualified
from outbox.schema import OUTBOX, validate_schema_name

# Settings of every relay session (the batch session and the wake-up listener); `options` is
# made by session_options.
SESSION_SETTINGS: dict[str, Any] = {
    "application_name": APPLICATION_NAME,
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}

# Server settings of the relay's sessions, sent as the connection's `options` after those of the
# database URL, which may change them (a later `-c` wins): plan the claim as the short
# primary-key range walk it is, with hash joins over the claimed rows. The planner cannot know
# how many rows a claim takes or where the `skipped` range ends, so it would otherwise guess a
# handful of rows (nested loops, quadratic in --batch-size) or a third of the table (a full scan
# per claim); those cost estimates also trigger JIT compilation, hundreds of milliseconds per
# claim. Server-side keepalives: PostgreSQL notices a vanished relay host (and frees its lanes)
# within about 25 s instead of the kernel's two hours. Only these sessions.
DEFAULT_OPTIONS: dict[str, str] = {
    "jit": "off",
    "enable_seqscan": "off",
    "enable_bitmapscan": "off",
    "enable_nestloop": "off",
    "tcp_keepalives_idle": "10",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "3",
}

# What the low-water mark's readings rely on (outbox._core.lowwater): sent last, so that the URL
# cannot change it; startup options also outrank ALTER DATABASE/ROLE ... SET. The readings check
# it on every claim all the same.
PINNED_OPTIONS: dict[str, str] = {"default_transaction_isolation": "read committed"}


def _option_words(options: str) -> list[str]:
    """libpq's split of ``options``: whitespace separates words, a backslash escapes the next
    character."""
    words: list[str] = []
    word: list[str] | None = None
    escaped = False
    for ch in options:
        if escaped:
            word = (word or []) + [ch]
            escaped = False
        elif ch == "\\":
            escaped = True
            word = word or []
        elif ch.isspace():
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = (word or []) + [ch]
    if word is not None:
        words.append("".join(word))
    return words


def _escape(word: str) -> str:
    return "".join("\\" + ch if ch.isspace() or ch == "\\" else ch for ch in word)


def session_options(url_options: str | None) -> str:
    """The ``options`` of a relay session: the relay's defaults, then every word of the URL's
    ``options`` (``-c search_path=billing`` and anything else PostgreSQL accepts there), then the
    settings the relay pins. A setting of the URL replaces the relay's default of the same name;
    a pinned one replaces the URL's."""
    given = _option_words(url_options or "")
    named: dict[str, str] = {}
    others: list[str] = []
    words = iter(given)
    for word in words:
        setting, spelled = None, [word]
        if word == "-c":
            setting = next(words, "")
            spelled.append(setting)
        elif word.startswith("-c") or (word.startswith("--") and "=" in word):
            setting = word[2:]
        if setting is not None and "=" in setting:
            name, value = setting.split("=", 1)
            named[name.strip().lower().replace("-", "_")] = value
        else:
            others.extend(spelled)
    merged = {**DEFAULT_OPTIONS, **named, **PINNED_OPTIONS}
    return " ".join(
        [*map(_escape, others), *(f"-c {_escape(f'{k}={v}')}" for k, v in merged.items())]
    )


def session_settings(url: sa.URL) -> dict[str, Any]:
    """The connection settings of a relay session for the database ``url`` (its ``options``
    merged with the relay's; without any, libpq's ``PGOPTIONS``, which an explicit ``options``
    would otherwise replace)."""
    given = url.query.get("options")
    if isinstance(given, tuple):
        given = " ".join(given)
    if given is None:
        given = os.environ.get("PGOPTIONS")
    return {**SESSION_SETTINGS, "options": session_options(given)}


def relay_engine(url: str) -> sa.Engine:
    """An engine of relay sessions: one connection at a time, no pool to hold it."""
    return sa.create_engine(
        url,
        poolclass=sa.pool.NullPool,
        # No server-side prepared statements: a generic plan of the claim ignores how few rows
        # a batch takes and degrades to scans costing seconds; planning costs ~0.5 ms.
        connect_args={**session_settings(sa.make_url(url)), "prepare_threshold": None},
    )


def listen_connector(engine: sa.Engine) -> Callable[[], Any]:
    """Opens a plain driver connection with the relay's session settings (the wake-up
    listener's: it lives outside SQLAlchemy, in autocommit)."""

    def connect() -> Any:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        return psycopg.connect(*cargs, **{**cparams, **session_settings(engine.url)})

    return connect


def _not_behind_parked(row: str) -> str:
    """SQL: ``row`` has no parked row of its key before it (``{outbox}`` is formatted later)."""
    return f"""((SELECT NOT EXISTS (SELECT 1 FROM {{outbox}} WHERE parked_at IS NOT NULL))
       OR NOT EXISTS (
          SELECT 1 FROM {{outbox}} p
          WHERE p.parked_at IS NOT NULL
            AND p.key_hash = {row}.key_hash AND p.key = {row}.key AND p.id < {row}.id
          OFFSET 0
       ))"""


# Claim rule (see outbox.relay). Rows of keys blocked by a parked row are never even locked,
# so a poison key cannot fill every batch. The per-row probe of the small partial index
# ix_outbox_parked (`OFFSET 0` keeps it a probe instead of a join over the whole table) only
# runs when some row is parked at all: the uncorrelated `NOT EXISTS` is an InitPlan evaluated
# once, and PostgreSQL evaluates the arms of an OR in the order written.
#
# The second arm returns the *skipped* rows: rows of the owned lanes, inside the id range the
# claim covered, that the claim did not get. Such a row is locked by another transaction (a
# relay that still holds it) or waits behind a parked row; either way every later claimed row
# of its key must wait. The relay drops those rows itself (outbox._core.delivery.drop_blocked):
# done in SQL, the join on `key` between claim and skipped rows cost more than the claim (a sort
# or hash of the whole batch on bytea keys), while in Python it is one dict look-up per row and
# nothing at all in the usual case where no row was skipped. Rows waiting behind a parked row
# are left out of the skipped rows: their key is never claimed anyway, and a long queue behind a
# parked row would otherwise travel to the relay with every claim. Both scans walk the primary
# key over the same short range, so a claim costs the same with 100 or 10 million rows pending.
#
# Columns come back in binary (no hex decoding of bytea), the event id already as the bytes of
# its text form (the value of the X-Idempotency-Key header). `%%` is psycopg's escaped `%`.
OUTBOX_CLAIM_BATCH = (
    """
WITH claim AS (
    SELECT o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.attempts
    FROM {outbox} o
    WHERE o.id >= %(low)s
      AND o.parked_at IS NULL
      AND (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
      AND """
    + _not_behind_parked("o")
    + """
    ORDER BY o.id
    LIMIT %(batch_size)s
    FOR UPDATE OF o SKIP LOCKED
)
SELECT c.id, c.attempts, c.topic, c.key, c.value, c.headers::text,
       convert_to(c.event_id::text, 'UTF8'), false
FROM claim c
UNION ALL
SELECT s.id, 0, NULL, s.key, NULL, NULL, NULL, true
FROM {outbox} s
WHERE s.id < (SELECT max(id) FROM claim)
  AND s.id >= %(low)s
  AND s.key IS NOT NULL
  AND s.parked_at IS NULL
  AND (s.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND NOT EXISTS (SELECT 1 FROM claim c WHERE c.id = s.id)
  AND """
    + _not_behind_parked("s")
    + """
"""
)

# The claim of a relay that meets no other transaction's lock in its lanes (the usual case):
# the same rows as OUTBOX_CLAIM_BATCH, but with NOWAIT instead of SKIP LOCKED, so it either locks
# every row it passes or fails at once with lock_not_available. When it succeeds nothing was
# skipped, so it needs neither the second arm nor the CTE that feeds it: it costs PostgreSQL
# about a third less per row (the materialized CTE copies every wide row once more). When it
# fails, the relay rolls back and uses OUTBOX_CLAIM_BATCH until a claim skips nothing again.
OUTBOX_CLAIM_UNCONTENDED = (
    """
SELECT o.id, o.attempts, o.topic, o.key, o.value, o.headers::text,
       convert_to(o.event_id::text, 'UTF8'), false
FROM {outbox} o
WHERE o.id >= %(low)s
  AND o.parked_at IS NULL
  AND (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND """
    + _not_behind_parked("o")
    + """
ORDER BY o.id
LIMIT %(batch_size)s
FOR UPDATE OF o NOWAIT
"""
)

# The ids go as one text parameter, an array literal the relay formats itself ("{1,2,3}"): a
# ",".join of ints is ~20 times cheaper than the driver's per-element array dumper.
OUTBOX_DELETE_CONFIRMED = "DELETE FROM {outbox} WHERE id = ANY(%s::bigint[])"

# The same rows when their ids lie close together (a drain's batch usually is one run of ids):
# one walk of the primary key over their range, each row checked against the (hashed) list,
# instead of one index descent per id -- about a third cheaper for a batch of thousands. The
# `+ 0` keeps the list out of the index condition, which would bring back the descents. The
# list is hashed because it is a constant of the statement's plan: relay sessions never prepare
# statements (relay_engine); a generic plan would search it row by row.
OUTBOX_DELETE_CONFIRMED_RANGE = (
    "DELETE FROM {outbox} WHERE id BETWEEN %s AND %s AND id + 0 = ANY(%s::bigint[])"
)

# The range walk is used while it passes fewer than this many index entries per deleted row
# (measured: about even with the per-id probes at four).
DENSE_IDS = 3

OUTBOX_RECORD_FAILURES = """
UPDATE {outbox} o
SET attempts = o.attempts + 1,
    last_error = f.error,
    parked_at = CASE WHEN f.park THEN now() ELSE NULL END
FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[]), CAST(:park AS boolean[]))
     AS f(id, error, park)
WHERE o.id = f.id
"""

# The low-water mark's three readings (outbox._core.lowwater), sent in one message: the simple query
# protocol runs them one after the other, each with its own snapshot (READ COMMITTED, which the
# first one reports, with the sequence's settings, whether the relay's role may read it, its
# relfilenode, the transaction that last altered it and, when asked, the database's other backends:
# the facts the mark rests on), in the order the mark's argument needs. The last value is read only
# where the role may (else the reading is NULL instead of an error that would fail the batch).
# pg_locks shows every session's locks to every role; the relay's own session (which deletes) is
# left out, a prepared transaction (no pid) is not. An INSERT takes ROW EXCLUSIVE (also when its
# transaction holds a stronger lock, which are listed as well); VACUUM, ANALYZE and CREATE INDEX
# (SHARE UPDATE EXCLUSIVE, SHARE) draw no id and do not count, so that an autovacuum of a large
# outbox does not hold the mark for its whole run. Backends are listed by pid (all a role sees of
# another role's sessions), other relays' sessions left out where their name is visible. The
# relfilenode is read from pg_class, in the statement's snapshot like the settings beside it
# (ALTER SEQUENCE ... CACHE gives the sequence a new one too): pg_relation_filenode() looks at the
# catalog as it is now, so an ALTER committed during the statement would show a new file with the
# old settings, and read as a RESTART.
_LOW_WATER_FACTS = """
SELECT current_setting('transaction_isolation'), s.seqcache, s.seqincrement, s.seqcycle,
       p.readable,
       CASE WHEN p.readable
            THEN coalesce(pg_sequence_last_value(%(sequence)s::oid::regclass), 0) END,
       c.relfilenode::bigint, s.xmin::text::bigint, {backends}"""

# The database's other backends, in the statements of a relay that watches them (and only
# there: planned at all, even behind a CASE that never runs it, the view cost each reading
# about 0.9 ms of backend CPU, more than the rest of the reading).
_BACKENDS = """ARRAY(
           SELECT a.pid FROM pg_stat_activity a
           WHERE a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND a.pid <> pg_backend_pid()
             AND a.application_name IS DISTINCT FROM %(relay)s)"""
_NO_BACKENDS = "NULL::integer[]"

_LOW_WATER_FROM = """
FROM (SELECT coalesce(has_sequence_privilege(%(sequence)s::oid, 'SELECT, USAGE'), false)
      AS readable) p
LEFT JOIN pg_sequence s ON s.seqrelid = %(sequence)s::oid
LEFT JOIN pg_class c ON c.oid = s.seqrelid"""

OUTBOX_LOW_WATER = (
    _LOW_WATER_FACTS
    + _LOW_WATER_FROM
    + """;
SELECT coalesce(array_agg(DISTINCT l.virtualtransaction), '{{}}')
FROM pg_locks l
WHERE l.locktype = 'relation'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.relation = %(table)s::oid
  AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock',
                 'AccessExclusiveLock')
  AND l.pid IS DISTINCT FROM pg_backend_pid();
SELECT min(o.id) FROM {outbox} o
WHERE o.id >= %(low)s AND (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
"""
)

# The first reading alone: the facts, checked on a claim that starts from the mark in force
# instead of moving it (outbox.relay._claims: the mark moves once per ADVANCE_ROWS rows claimed,
# since the writers' reading copies every lock of the server, a cost that grows with a fleet).
OUTBOX_LOW_WATER_FACTS = _LOW_WATER_FACTS + _LOW_WATER_FROM

# An idle relay's poll (outbox.relay._claims): the first reading of the low-water mark (the
# facts, checked on this poll as on every claim) and, in the same statement, whether the claim
# from the mark in force would find a row at all -- the claim's own conditions, parked keys
# included, without its locks. The mark stays where the last claim put it: every row that may
# still be sent lies at or above it while the facts hold (outbox._core.lowwater), so "none" is
# the claim's answer, in one statement instead of the readings' three and the claim.
OUTBOX_PENDING = (
    _LOW_WATER_FACTS
    + """,
       EXISTS (
           SELECT 1 FROM {outbox} o
           WHERE o.id >= %(low)s
             AND o.parked_at IS NULL
             AND (o.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
             AND """
    + _not_behind_parked("o")
    + """)"""
    + _LOW_WATER_FROM
)

# The outbox table's oid, its id sequence's oid and name, and the table's name as PostgreSQL
# resolved it (schema-qualified: through the session's search_path when no schema is
# configured), or NULLs when there is no such table.
OUTBOX_SEQUENCE = """
SELECT t.oid::bigint, q.seq::regclass::oid::bigint, q.seq,
       quote_ident(n.nspname) || '.' || quote_ident(c.relname)
FROM (SELECT to_regclass(%(table)s::text)::oid AS oid) t
LEFT JOIN pg_class c ON c.oid = t.oid
LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN LATERAL (SELECT pg_get_serial_sequence(%(table)s::text, 'id') AS seq
                   WHERE t.oid IS NOT NULL) q ON true
"""

OUTBOX_STATS = """
SELECT topic,
       count(*) FILTER (WHERE parked_at IS NULL) AS backlog,
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
       EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL)) AS oldest
FROM {outbox}
WHERE id >= :low
GROUP BY topic
"""

OUTBOX_STATS_SEQSCAN = sa.text("SET LOCAL enable_seqscan = on")


@dataclass(frozen=True)
class OutboxStatements:
    """The relay's SQL for one schema: ``claim`` and ``delete`` for the driver's cursor, the
    rest for SQLAlchemy."""

    claim: str
    claim_uncontended: str
    delete: str
    delete_range: str
    fail: sa.TextClause
    stats: sa.TextClause
    low_water: str
    low_water_watch: str
    facts: str
    facts_watch: str
    pending: str
    pending_watch: str
    table: str

    @classmethod
    def for_schema(cls, schema: str | None) -> OutboxStatements:
        table = qualified(validate_schema_name(schema), OUTBOX)
        return cls(
            claim=OUTBOX_CLAIM_BATCH.format(outbox=table),
            claim_uncontended=OUTBOX_CLAIM_UNCONTENDED.format(outbox=table),
            delete=OUTBOX_DELETE_CONFIRMED.format(outbox=table),
            delete_range=OUTBOX_DELETE_CONFIRMED_RANGE.format(outbox=table),
            fail=sa.text(OUTBOX_RECORD_FAILURES.format(outbox=table)),
            stats=sa.text(OUTBOX_STATS.format(outbox=table)),
            low_water=OUTBOX_LOW_WATER.format(outbox=table, backends=_NO_BACKENDS),
            low_water_watch=OUTBOX_LOW_WATER.format(outbox=table, backends=_BACKENDS),
            facts=OUTBOX_LOW_WATER_FACTS.format(outbox=table, backends=_NO_BACKENDS),
            facts_watch=OUTBOX_LOW_WATER_FACTS.format(outbox=table, backends=_BACKENDS),
            pending=OUTBOX_PENDING.format(outbox=table, backends=_NO_BACKENDS),
            pending_watch=OUTBOX_PENDING.format(outbox=table, backends=_BACKENDS),
            table=table,
        )


def outbox_claim_batch(
    conn: sa.Connection,
    sql: OutboxStatements,
    *,
    lanes: int,
    owned: Sequence[int],
    batch_size: int,
    low: int = 0,
    uncontended: bool = False,
    savepoint: str | None = None,
) -> list[ClaimedRow] | None:
    """Claim up to ``batch_size`` rows of the ``owned`` lanes (and report the skipped ones) in a
    transaction that stays open: the caller deletes or updates the rows and commits.

    With ``uncontended``, the cheaper claim that never skips a row: it returns ``None`` when
    another transaction holds a row it would have taken, after rolling back the transaction,
    or only back to ``savepoint`` when one is named (see
    :func:`outbox_delete_between_savepoints`).
    """
    # Beginning the transaction through SQLAlchemy first keeps its commit() and rollback() in
    # charge of the work done on the driver's cursor.
    if not conn.in_transaction():
        conn.begin()
    params = {"lanes": lanes, "owned": list(owned), "batch_size": batch_size, "low": low}
    with _driver(conn).cursor(binary=True) as cur:
        if uncontended:
            try:
                cur.execute(sql.claim_uncontended, params)
            except psycopg.errors.LockNotAvailable:
                if savepoint is None:
                    conn.rollback()
                else:
                    outbox_rollback_to(conn, savepoint)
                return None
        else:
            cur.execute(sql.claim, params)
        rows: list[ClaimedRow] = cur.fetchall()
    return rows


# Savepoints of the relay's batch transaction (constant names, never input).
SAVEPOINTS = frozenset({"outbox_sent", "outbox_ahead"})


def outbox_rollback_to(conn: sa.Connection, name: str) -> None:
    """Undo the batch transaction's work since ``SAVEPOINT name`` (and release its locks)."""
    assert name in SAVEPOINTS
    _driver(conn).execute(f"ROLLBACK TO SAVEPOINT {name}")


def outbox_delete_confirmed(conn: sa.Connection, sql: OutboxStatements, ids: Sequence[int]) -> None:
    """Delete the rows Kafka confirmed (inside the claim's transaction)."""
    if not ids:
        return
    with _driver(conn).cursor() as cur:
        cur.execute(*_delete(sql, ids))


def outbox_delete_between_savepoints(
    conn: sa.Connection, sql: OutboxStatements, ids: Sequence[int]
) -> None:
    """``SAVEPOINT outbox_sent``, delete ``ids`` (as :func:`outbox_delete_confirmed`),
    ``SAVEPOINT outbox_ahead``: one message to the server instead of three round trips (the
    values are bound on the client; they are integers, formatted by the relay itself)."""
    statement, params = _delete(sql, ids)
    with psycopg.ClientCursor(_driver(conn)) as cur:
        cur.execute(f"SAVEPOINT outbox_sent; {statement}; SAVEPOINT outbox_ahead", params)


def _delete(sql: OutboxStatements, ids: Sequence[int]) -> tuple[str, tuple[Any, ...]]:
    listed = "{" + ",".join(map(str, ids)) + "}"
    low, high = min(ids), max(ids)
    if high - low < DENSE_IDS * len(ids):
        return sql.delete_range, (low, high, listed)
    return sql.delete, (listed,)


def outbox_record_failures(
    conn: sa.Connection,
    sql: OutboxStatements,
    ids: Sequence[int],
    errors: Sequence[str],
    park: Sequence[bool],
) -> None:
    """Count one more attempt for each failed row, with its error; park those marked ``park``."""
    conn.execute(sql.fail, {"ids": list(ids), "errors": list(errors), "park": list(park)})


@dataclass(frozen=True)
class OutboxStats:
    """Rows waiting (not parked), parked rows, and the age of the oldest waiting row."""

    backlog: int
    parked: int
    oldest_age: float


def outbox_stats(
    conn: sa.Connection, sql: OutboxStatements, low: int = 0
) -> dict[str, OutboxStats]:
    """Count the outbox's rows from id ``low`` on, per topic (in a transaction the caller
    commits)."""
    if low == 0:
        # A whole-table count: here a sequential scan is the right plan (see SESSION_SETTINGS).
        conn.execute(OUTBOX_STATS_SEQSCAN)
    return {
        str(row.topic): OutboxStats(int(row.backlog), int(row.parked), float(row.oldest or 0.0))
        for row in conn.execute(sql.stats, {"low": low})
    }


@dataclass(frozen=True)
class OutboxSequence:
    """The outbox table's and its id sequence's oids, the sequence's name, and the table's
    schema-qualified name as the session resolves it (``table`` is ``None`` when there is no
    such table, ``sequence`` when the id column has no sequence)."""

    table: int | None
    sequence: int | None
    sequence_name: str | None
    resolved: str | None


def outbox_sequence(conn: sa.Connection, sql: OutboxStatements) -> OutboxSequence:
    """Look up what the low-water readings need (in a transaction the caller commits)."""
    with _driver(conn).cursor() as cur:
        cur.execute(OUTBOX_SEQUENCE, {"table": sql.table})
        row = cur.fetchone()
    assert row is not None
    return OutboxSequence(row[0], row[1], row[2], row[3])


# What a batch does to the outbox: claim (SELECT ... FOR UPDATE needs UPDATE), delete the rows
# sent, update those that failed.
BATCH_PRIVILEGES = ("SELECT", "UPDATE", "DELETE")


def outbox_privileges(conn: sa.Connection, sql: OutboxStatements) -> list[str]:
    """The privileges on the outbox a batch needs that the session's role lacks."""
    checks = ", ".join(f"has_table_privilege(%(table)s, '{p}')" for p in BATCH_PRIVILEGES)
    with _driver(conn).cursor() as cur:
        cur.execute(f"SELECT {checks}", {"table": sql.table})
        row = cur.fetchone()
    assert row is not None
    return [p for p, held in zip(BATCH_PRIVILEGES, row, strict=True) if not held]


def outbox_low_water(
    conn: sa.Connection,
    sql: OutboxStatements,
    sequence: OutboxSequence,
    *,
    lanes: int,
    owned: Sequence[int],
    low: int,
    watch: bool = False,
) -> tuple[Facts, list[str], int | None]:
    """The low-water mark's readings: the facts the mark rests on (with the sequence's last
    id), the transactions holding a write lock on the outbox, the lowest id from ``low`` on of a
    row of the ``owned`` lanes (in the caller's transaction; see :mod:`outbox._core.lowwater`).
    ``watch``: also list the database's other backends."""
    if not conn.in_transaction():
        conn.begin()
    with _driver(conn).cursor() as cur:
        statement = sql.low_water_watch if watch else sql.low_water
        cur.execute(statement % _low_water_values(sequence, lanes, owned, low))
        first = cur.fetchone()
        cur.nextset()
        writers = cur.fetchone()
        cur.nextset()
        live = cur.fetchone()
    assert first is not None and writers is not None and live is not None
    return _facts(first), list(writers[0]), live[0]


def outbox_low_water_facts(
    conn: sa.Connection,
    sql: OutboxStatements,
    sequence: OutboxSequence,
    *,
    watch: bool = False,
) -> Facts:
    """The first of :func:`outbox_low_water`'s readings alone: the facts the mark rests on (in
    the caller's transaction)."""
    if not conn.in_transaction():
        conn.begin()
    with _driver(conn).cursor() as cur:
        statement = sql.facts_watch if watch else sql.facts
        cur.execute(statement % _low_water_values(sequence, 1, [0], 0))
        row = cur.fetchone()
    assert row is not None
    return _facts(row)


def outbox_pending(
    conn: sa.Connection,
    sql: OutboxStatements,
    sequence: OutboxSequence,
    *,
    lanes: int,
    owned: Sequence[int],
    low: int,
    watch: bool = False,
) -> tuple[Facts, bool]:
    """The facts the low-water mark rests on (as :func:`outbox_low_water` reads them) and
    whether a claim of the ``owned`` lanes from ``low`` would find a row, in one statement
    (in the caller's transaction)."""
    if not conn.in_transaction():
        conn.begin()
    with _driver(conn).cursor() as cur:
        statement = sql.pending_watch if watch else sql.pending
        cur.execute(statement % _low_water_values(sequence, lanes, owned, low))
        row = cur.fetchone()
    assert row is not None
    return _facts(row[:-1]), bool(row[-1])


def _low_water_values(
    sequence: OutboxSequence, lanes: int, owned: Sequence[int], low: int
) -> dict[str, Any]:
    # Every value is an integer (or a constant) the relay formats itself, so the statements go
    # without parameters: one simple-protocol message, and no client-side parsing of the text
    # for placeholders (measured: that cost more than the server's work on them).
    return {
        "sequence": int(sequence.sequence or 0),
        "table": int(sequence.table or 0),
        "low": int(low),
        "lanes": int(lanes),
        "owned": "'{" + ",".join(str(int(lane)) for lane in owned) + "}'",
        "relay": f"'{APPLICATION_NAME}'",
    }


def _facts(row: Sequence[Any]) -> Facts:
    isolation, cache, increment, cycle, readable, drawn, filenode, altered, backends = row
    return Facts(
        isolation=isolation,
        cache=cache,
        increment=increment,
        cycle=cycle,
        readable=bool(readable),
        drawn=None if drawn is None else int(drawn),
        filenode=filenode,
        altered=altered,
        backends=None if backends is None else frozenset(backends),
    )


def _driver(conn: sa.Connection) -> psycopg.Connection[Any]:
    driver: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    return driver
