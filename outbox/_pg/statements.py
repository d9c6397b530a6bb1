"""Hot-path statements of the unit of work, written once, named entity-first.

They are driver-level SQL (psycopg ``%(name)s`` parameters) run with ``exec_driver_sql``: no
per-call compilation, and SQLAlchemy engine events (tracing, statement counters) still see them.

Table names are constants and the optional schema has passed the identifier allow-list; both are
quoted by the dialect's identifier preparer. Values always travel as bound parameters.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from outbox._pg.lanes import idle_probe_sql
from outbox.schema import IDEMPOTENCY_KEYS, OUTBOX, validate_schema_name

_preparer = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]


def qualified(schema: str | None, table: str) -> str:
    """``"schema"."table"`` quoted for PostgreSQL (``schema`` has passed the allow-list)."""
    name = _preparer.quote(table)
    return name if schema is None else f"{_preparer.quote_schema(schema)}.{name}"


@dataclass(frozen=True)
class Prepared:
    """A named server-side prepared statement: ``PREPARE`` text and ``EXECUTE`` text."""

    name: str
    prepare: str
    execute: str  # EXECUTE with psycopg parameters (for messages and client-side binding)
    direct: str  # the same statement with psycopg parameters, for the extended protocol
    args: tuple[str, ...] = ()  # parameter names in EXECUTE order


@dataclass(frozen=True)
class Statements:
    idempotency_key_claim_prepared: Prepared
    idempotency_key_fail: str
    relay_idle_probe: Prepared


@functools.cache
def statements(schema: str | None) -> Statements:
    schema = validate_schema_name(schema)
    keys = qualified(schema, IDEMPOTENCY_KEYS)
    # Prepared-statement names live per connection, across schemas: tell schemas apart by a
    # short digest (a long schema name would be truncated to 63 bytes and could collide).
    claim_body = (
        f"WITH lock AS (SELECT pg_try_advisory_xact_lock($1) AS acquired, {_unit_set('$4')}) "
        f"SELECT lock.acquired, k.status, k.fingerprint, k.result::text AS result, k.error, "
        f"EXTRACT(EPOCH FROM now() - k.updated_at)::float8 AS age "
        f"FROM lock LEFT JOIN {keys} AS k ON k.scope = $2 AND k.key = $3"
    )
    # The digest covers the text too: a server session that outlived a deploy (a pooler that
    # does not reset sessions) may still hold an older statement under an older name.
    claim_name = f"outbox_key_claim_{_digest(schema, claim_body)}"
    return Statements(
        # One round trip: try the key's transaction-scoped advisory lock (never waits) and read
        # any committed outcome. The lock is the claim: every writer of a key takes it first,
        # so the final INSERT of the key never waits on another writer's uncommitted row,
        # and it disappears with a crashed attempt's connection. A named server-side
        # prepared statement, so that it travels in one simple-protocol message together with
        # BEGIN without being planned every time.
        idempotency_key_claim_prepared=Prepared(
            claim_name,
            f"PREPARE {claim_name} (bigint, text, text, text) AS {claim_body}",
            f"EXECUTE {claim_name} (%(lock_id)s, %(scope)s, %(key)s, %(unit)s)",
            claim_body.replace("$1", "%(lock_id)s")
            .replace("$2", "%(scope)s")
            .replace("$3", "%(key)s")
            .replace("$4", "%(unit)s"),
            ("lock_id", "scope", "key", "unit"),
        ),
        idempotency_key_fail=(
            f"INSERT INTO {keys} (scope, key, status, fingerprint, error) "
            f"VALUES (%(scope)s, %(key)s, 'failed', %(fingerprint)s, %(error)s) "
            f"ON CONFLICT (scope, key) DO NOTHING"
        ),
        # After the COMMIT of a unit of work that appended events, in the same message: is a
        # relay waiting for work? Only then is a wake-up sent (outbox._pg.wakeup).
        relay_idle_probe=_prepared("outbox_relay_idle", schema, idle_probe_sql(schema), [], []),
    )


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=6).hexdigest()


# The proof that a final statement runs in the transaction that claimed its keys (docs/concepts.md
# I13). The claim sets the transaction-local setting UNIT_SETTING to a token of its own (a random
# value per unit of work or batch, bound as the parameter `unit`); the final statement checks for
# that token and fails otherwise, aborting its transaction. Whatever sits between the toolkit and
# PostgreSQL (a transaction pooler that hands out another server connection, a reconnect, a retry, a
# statement run outside the transaction in autocommit), a final statement that does not run in the
# claiming transaction cannot see the token: it raises, and nothing of it commits.
UNIT_SETTING = "outbox.unit"
# Text of the error the check raises ("invalid input syntax for type integer: ..."), which
# outbox._pg.errors recognizes.
UNIT_MISMATCH = "outbox: not in the transaction that claimed the key"


def _unit_set(param: str, *, append: bool = False) -> str:
    """``set_config`` of the claim's token; ``append`` keeps tokens already set in the same
    transaction (joined units of work, one after another or nested, in a caller's transaction)."""
    value = f"coalesce(current_setting('{UNIT_SETTING}', true), '') || {param}" if append else param
    return f"set_config('{UNIT_SETTING}', {value}, true)"


def _unit_check(param: str) -> str:
    """A condition that is true when the claim's token is set in this transaction, and raises
    (an integer cast of :data:`UNIT_MISMATCH`) otherwise. Neither branch is a constant the
    planner could fold: the error is raised only when the token is missing."""
    return (
        f"CAST(CASE WHEN strpos(current_setting('{UNIT_SETTING}', true), {param}) > 0 "
        f"THEN '1' ELSE '{UNIT_MISMATCH}' END AS integer) = 1"
    )


_ROW_TYPES = ("uuid", "text", "bytea", "bytea", "jsonb", "integer")


def _outbox_rows_insert(
    schema: str | None, events: int, locks: int, first: int
) -> tuple[str, list[str], list[str]]:
    """``INSERT`` of ``events`` outbox rows after taking ``locks`` order locks; parameters are
    numbered from ``$first``. Returns the SQL, the parameters' types and their psycopg names.

    The order locks (see :mod:`outbox._core.events`) are taken by a one-time filter, which
    PostgreSQL evaluates before it produces the first row, and so before any ``id`` is drawn
    from the identity sequence: a writer of a key that another uncommitted transaction has
    written waits here, and takes its ``id``s only after that transaction ended. The values
    carry their types, so that any driver can bind them (the joined flavour runs on the
    caller's connection).
    """
    types: list[str] = []
    args: list[str] = []
    rows = []
    n = first
    for i in range(events):
        cells = [
            f"CAST(${n + c} AS {t})" if locks else f"${n + c}" for c, t in enumerate(_ROW_TYPES)
        ]
        if not locks:
            cells[4] = f"CAST(${n + 4} AS jsonb)"
        rows.append(f"({', '.join(cells)})")
        types += ["uuid", "text", "bytea", "bytea", "text", "integer"]
        args += [f"%(e{i})s", f"%(t{i})s", f"%(k{i})s", f"%(v{i})s", f"%(h{i})s", f"%(x{i})s"]
        n += 6
    target = (
        f"INSERT INTO {qualified(schema, OUTBOX)} (event_id, topic, key, value, headers, key_hash)"
    )
    if not locks:
        return f"{target} VALUES {', '.join(rows)}", types, args
    lock_rows = []
    for j in range(locks):
        lock_rows.append(f"(CAST(${n} AS bigint))")
        types.append("bigint")
        args.append(f"%(l{j})s")
        n += 1
    sql = (
        f"{target} SELECT * FROM (VALUES {', '.join(rows)}) AS r "
        f"WHERE (SELECT count(pg_advisory_xact_lock(o.id)) "
        f"FROM (VALUES {', '.join(lock_rows)}) AS o(id)) = {locks}"
    )
    return sql, types, args


def _prepared(
    prefix: str, schema: str | None, body: str, types: list[str], args: list[str]
) -> Prepared:
    name = f"{prefix}_{_digest(schema, body)}"  # see the claim's name
    direct = body
    for n in range(len(args), 0, -1):  # $10 before $1
        direct = direct.replace(f"${n}", args[n - 1])
    if not args:
        return Prepared(name, f"PREPARE {name} AS {body}", f"EXECUTE {name}", direct)
    return Prepared(
        name,
        f"PREPARE {name} ({', '.join(types)}) AS {body}",
        f"EXECUTE {name} ({', '.join(args)})",
        direct,
        tuple(a[2:-2] for a in args),
    )


@functools.lru_cache(maxsize=512)
def idempotency_key_complete(schema: str | None, events: int, locks: int = 0) -> Prepared:
    """The key's final state and ``events`` outbox rows in ONE statement, after the order locks
    of their ``locks`` distinct message keys.

    It runs after the body's business writes took their locks and at the very end of the
    transaction, so the order locks are held only until the commit. Row ``i`` binds
    parameters ``e{i}`` (event id), ``t{i}`` (topic), ``k{i}`` (key), ``v{i}`` (value),
    ``h{i}`` (headers JSON) and ``x{i}`` (key hash); lock ``j`` binds ``l{j}``
    (:func:`outbox._core.events.event_params` binds them all); ``unit`` is the claim's token,
    without which the statement raises (see :data:`UNIT_SETTING`). The text depends only on the
    schema, ``events`` and ``locks``.
    """
    schema = validate_schema_name(schema)
    if events < 0 or not 0 <= locks <= events:
        raise ValueError("events must not be negative, locks between 0 and events")
    keys = qualified(schema, IDEMPOTENCY_KEYS)
    types = ["text", "text", "text", "text", "text"]
    args = ["%(scope)s", "%(key)s", "%(fingerprint)s", "%(result)s", "%(unit)s"]
    # The key row is written only in the transaction whose claim set the token `unit` ($5).
    key_insert = (
        f"INSERT INTO {keys} (scope, key, status, fingerprint, result) "
        f"SELECT $1, $2, 'completed', $3, CAST($4 AS jsonb) WHERE {_unit_check('$5')}"
    )
    if events == 0:
        body = key_insert
    else:
        rows, row_types, row_args = _outbox_rows_insert(schema, events, locks, 6)
        body = f"WITH completed AS ({key_insert}) {rows}"
        types += row_types
        args += row_args
    return _prepared(f"outbox_key_complete_{events}", schema, body, types, args)


# -- joined units of work and the keyless publish: statements on the caller's connection -----
#
# A caller's session or connection may come from any engine (and any PostgreSQL driver), so
# these are SQLAlchemy text() clauses with :named parameters, bound by its driver. They run in a
# savepoint of the caller's transaction, never with a COMMIT of their own.


@dataclass(frozen=True)
class JoinedStatements:
    idempotency_key_claim: sa.TextClause
    # The same claim for a message of its own with the savepoint (outbox._pg.savepoint_async).
    idempotency_key_claim_inline: Prepared
    idempotency_key_fail: sa.TextClause
    idempotency_key_relock: sa.TextClause
    idempotency_key_read: str  # driver-level SQL (outbox._pg.readback_async)
    idempotency_key_read_waking: str  # the same, and whether a relay waits for work
    idempotency_key_held: sa.TextClause


def _named(sql: str) -> str:
    return re.sub(r"%\((\w+)\)s", r":\1", sql)


@functools.cache
def joined_statements(schema: str | None) -> JoinedStatements:
    schema = validate_schema_name(schema)
    keys = qualified(schema, IDEMPOTENCY_KEYS)
    claim_inline = _prepared(
        "outbox_key_claim_joined",
        schema,
        f"WITH lock AS (SELECT pg_try_advisory_xact_lock($1) AS acquired, "
        f"{_unit_set('$4', append=True)}) "
        "SELECT lock.acquired, k.status, k.fingerprint, k.result::text AS result, k.error, "
        "EXTRACT(EPOCH FROM now() - k.updated_at)::float8 AS age "
        f"FROM lock LEFT JOIN {keys} AS k ON k.scope = $2 AND k.key = $3",
        ["bigint", "text", "text", "text"],
        ["%(lock_id)s", "%(scope)s", "%(key)s", "%(unit)s"],
    )
    return JoinedStatements(
        idempotency_key_claim_inline=claim_inline,
        idempotency_key_claim=sa.text(
            "WITH lock AS (SELECT pg_try_advisory_xact_lock(:lock_id) AS acquired, "
            f"{_unit_set(':unit', append=True)}) "
            "SELECT lock.acquired, k.status, k.fingerprint, k.result::text AS result, k.error, "
            "EXTRACT(EPOCH FROM now() - k.updated_at)::float8 AS age "
            f"FROM lock LEFT JOIN {keys} AS k ON k.scope = :scope AND k.key = :key"
        ),
        idempotency_key_fail=sa.text(_named(statements(schema).idempotency_key_fail)),
        idempotency_key_relock=sa.text("SELECT pg_try_advisory_xact_lock(:lock_id)"),
        # After the caller's commit, on a connection of the toolkit's own: the key's committed
        # row, if any (what the cache may learn).
        idempotency_key_read=(
            "SELECT status, fingerprint, result::text AS result, error, "
            "EXTRACT(EPOCH FROM now() - updated_at)::float8 AS age "
            f"FROM {keys} WHERE scope = %(scope)s AND key = %(key)s"
        ),
        # The same read, and the relays' idle probe (outbox._pg.wakeup) in its snapshot, taken
        # after the caller's commit: one statement instead of the read and the notifier's own.
        # The row is always there; a key not committed comes back with a NULL status.
        idempotency_key_read_waking=(
            "SELECT k.status, k.fingerprint, k.result::text AS result, k.error, "
            "EXTRACT(EPOCH FROM now() - k.updated_at)::float8 AS age, probe.idle "
            f"FROM ({idle_probe_sql(schema)}) AS probe (idle) "
            f"LEFT JOIN {keys} AS k ON k.scope = %(scope)s AND k.key = %(key)s"
        ),
        # Does this server session hold the key's advisory lock already? (A bigint lock shows
        # in pg_locks as its high and low 32 bits.)
        idempotency_key_held=sa.text(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid = pg_backend_pid() AND granted AND objsubid = 1 "
            "AND classid::bigint = ((CAST(:lock_id AS bigint) >> 32) & 4294967295) "
            "AND objid::bigint = (CAST(:lock_id AS bigint) & 4294967295))"
        ),
    )


@functools.lru_cache(maxsize=256)
def outbox_insert(schema: str | None, locks: int) -> sa.TextClause:
    """One outbox row (parameters as in :func:`idempotency_key_complete`), after its key's
    order lock when ``locks`` is 1: the keyless publish on the caller's connection."""
    schema = validate_schema_name(schema)
    sql, _types, args = _outbox_rows_insert(schema, 1, locks, 1)
    for n in range(len(args), 0, -1):
        sql = sql.replace(f"${n}", args[n - 1])
    return sa.text(_named(sql))


@functools.lru_cache(maxsize=512)
def idempotency_key_complete_joined(schema: str | None, events: int, locks: int) -> sa.TextClause:
    """:func:`idempotency_key_complete` as a text() clause for the caller's connection."""
    return sa.text(_named(idempotency_key_complete(schema, events, locks).direct))


# -- many keys in one transaction: the consumer runner's micro-batches ------------------------
#
# A batch claims all its keys in one round trip, runs each message's unit of work in a savepoint
# and writes every key's final row and every outbox row in one statement with its COMMIT. The
# statements take arrays, so one prepared statement serves every batch size.


@dataclass(frozen=True)
class ManyStatements:
    idempotency_keys_lock: Prepared
    idempotency_keys_read: Prepared
    idempotency_keys_complete: Prepared


@functools.cache
def many_statements(schema: str | None) -> ManyStatements:
    schema = validate_schema_name(schema)
    keys = qualified(schema, IDEMPOTENCY_KEYS)
    # Try every key's transaction-scoped advisory lock (never waits): one row, the answers in
    # the order of the ids given.
    lock = (
        "SELECT array_agg(pg_try_advisory_xact_lock(l.id) ORDER BY l.n) "
        "FROM unnest($1::bigint[]) WITH ORDINALITY AS l(id, n) "
        f"WHERE {_unit_set('$2')} IS NOT NULL"
    )
    # Run as a statement of its own after the locks: its snapshot is taken once the locks are
    # held, so it sees the outcome of any attempt that held one of them before (that attempt's
    # commit became visible before its locks were released). One statement reading and locking
    # would miss such an outcome and run the key's work again (its final insert would then fail).
    # One index lookup per key, whatever the planner knows: as a prepared statement this gets a
    # generic plan, and `key = ANY($2)` there may become a scan of the whole scope (planned while
    # the table was small, it stays so as it grows). The LATERAL subquery with OFFSET 0 cannot be
    # flattened into a hash join.
    read = (
        "SELECT k.key, k.status, k.fingerprint, k.result::text AS result, k.error, "
        "EXTRACT(EPOCH FROM now() - k.updated_at)::float8 AS age "
        "FROM unnest($2::text[]) AS r(key) CROSS JOIN LATERAL "
        f"(SELECT * FROM {keys} AS k WHERE k.scope = $1 AND k.key = r.key OFFSET 0) AS k"
    )
    # Every key's final row (completed with its result, or failed with its error) and every
    # outbox row, in the order given: run last, after the business writes of every message took
    # their locks, as the single unit of work's final statement is.
    complete = (
        f"WITH done AS (INSERT INTO {keys} (scope, key, status, fingerprint, result, error) "
        "SELECT $1, r.key, r.status, r.fingerprint, CAST(r.result AS jsonb), r.error "
        "FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) "
        f"AS r(key, status, fingerprint, result, error) WHERE {_unit_check('$14')}) "
        f"INSERT INTO {qualified(schema, OUTBOX)} "
        "(event_id, topic, key, value, headers, key_hash) "
        "SELECT e.event_id, e.topic, e.key, e.value, CAST(e.headers AS jsonb), e.key_hash "
        "FROM unnest($7::uuid[], $8::text[], $9::bytea[], $10::bytea[], $11::text[], "
        "$12::integer[]) WITH ORDINALITY AS e(event_id, topic, key, value, headers, key_hash, n) "
        # The order locks of the batch's message keys (ascending), taken by a one-time filter
        # before any outbox id is drawn, as in the single unit of work's final statement.
        "WHERE (SELECT count(pg_advisory_xact_lock(o.id)) FROM unnest($13::bigint[]) AS o(id)) "
        "= cardinality($13::bigint[]) "
        "ORDER BY e.n"
    )
    return ManyStatements(
        idempotency_keys_lock=_prepared_many(
            "outbox_keys_lock", schema, lock, [("lock_ids", "bigint[]"), ("unit", "text")]
        ),
        idempotency_keys_read=_prepared_many(
            "outbox_keys_read", schema, read, [("scope", "text"), ("keys", "text[]")]
        ),
        idempotency_keys_complete=_prepared_many(
            "outbox_keys_complete",
            schema,
            complete,
            [
                ("scope", "text"),
                ("keys", "text[]"),
                ("statuses", "text[]"),
                ("fingerprints", "text[]"),
                ("results", "text[]"),
                ("errors", "text[]"),
                ("event_ids", "uuid[]"),
                ("topics", "text[]"),
                ("event_keys", "bytea[]"),
                ("values", "bytea[]"),
                ("headers", "text[]"),
                ("key_hashes", "integer[]"),
                ("order_locks", "bigint[]"),
                ("unit", "text"),
            ],
        ),
    )


def _prepared_many(
    prefix: str, schema: str | None, body: str, args: list[tuple[str, str]]
) -> Prepared:
    name = f"{prefix}_{_digest(schema, body)}"  # see the claim's name
    direct = body
    for n in range(len(args), 0, -1):  # $10 before $1
        arg, kind = args[n - 1]
        # A bytea[] bound by the driver goes in binary: psycopg's text form of it is escaped
        # for a literal and reads wrong under standard_conforming_strings = off.
        direct = direct.replace(f"${n}", f"%({arg})b" if kind == "bytea[]" else f"%({arg})s")
    return Prepared(
        name,
        f"PREPARE {name} ({', '.join(t for _, t in args)}) AS {body}",
        f"EXECUTE {name} ({', '.join(f'%({a})s' for a, _ in args)})",
        direct,
        tuple(a for a, _ in args),
    )
