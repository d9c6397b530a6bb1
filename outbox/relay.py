"""``outbox-relay``: move committed outbox rows to Kafka without loss and in per-key order.

One loop: wait for (a wake-up notification | the poll timer | stop); rebalance lanes when due;
claim a batch of the lanes this relay owns with ``FOR UPDATE SKIP LOCKED``; produce it; wait for
every delivery report; delete the confirmed rows in one statement, record failures in another;
commit. A row is deleted only after Kafka confirmed it, so a crash at any point re-sends (at
least once), never loses.

Per-key order rests on two rules, both enforced here:

1. **Claim rule.** A row is sent only when no earlier row of its key is left in the table
   outside this relay's own claim: not parked, not locked by another relay, not skipped. The
   claim query drops every key whose first claimed row has an earlier row still present.
2. **Round rule.** Within a batch, the ``n``-th row of a key is produced only after Kafka
   confirmed its ``n-1``-th row (rows go out in *rounds*: round ``r`` carries the ``r``-th row of
   every key; many keys share one round, so a batch costs a few round trips). A failed row stops
   its key for the rest of the batch.

Together: whenever a record of a key reaches Kafka for the first time, every earlier record of
that key already reached Kafka. Re-sends can repeat records (a relay killed after the broker
confirmed but before the delete), but for every key the *first occurrences* are in commit order;
a consumer that drops records whose ``X-Idempotency-Key`` it has already seen sees exactly the
commit order. Key-less rows have no order and are sent in the first round.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import operator
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final

import psycopg
import sqlalchemy as sa

from outbox import lanes as lanes_mod
from outbox._core.codec import IDEMPOTENCY_HEADER, decode_headers
from outbox._kafka.producer import (
    CONFIRMED,
    KafkaProducer,
    Outcome,
    Record,
    RecordTuple,
)
from outbox._kafka.producer import Headers as Headers
from outbox._pg.wakeup import Listener
from outbox.config import (
    ENV_DATABASE_URL,
    ENV_KAFKA_BOOTSTRAP,
    env,
    env_float,
    env_int,
    normalize_database_url,
    redact_url,
)
from outbox.errors import ConfigurationError, FatalProducerError, OutboxError, PublishError
from outbox.metrics import MetricsServer, RelayMetrics
from outbox.schema import OUTBOX, validate_schema_name

log = logging.getLogger("outbox.relay")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

ENV_BATCH_SIZE = "OUTBOX_RELAY_BATCH_SIZE"
ENV_POLL_INTERVAL = "OUTBOX_RELAY_POLL_INTERVAL"
ENV_LANES = "OUTBOX_RELAY_LANES"
ENV_MAX_ATTEMPTS = "OUTBOX_RELAY_MAX_ATTEMPTS"
ENV_REBALANCE_INTERVAL = "OUTBOX_RELAY_REBALANCE_INTERVAL"
ENV_METRICS_PORT = "OUTBOX_RELAY_METRICS_PORT"
ENV_KAFKA_CONFIG = "OUTBOX_KAFKA_CONFIG"


@dataclass(frozen=True)
class RelayConfig:
    """Settings of one relay process (every field has a CLI flag and an environment variable).

    ``lanes`` must be the same for every relay of one outbox; a relay refuses to start next to
    relays that use another value.
    """

    database_url: str
    bootstrap_servers: str
    schema: str | None = None
    kafka_config: Mapping[str, str] = field(default_factory=dict)
    # Rows per claim. Larger batches spread the per-batch costs (two statements, a commit,
    # a Kafka round trip per round) over more rows: 5000 drained ~20% faster than 1000 in
    # benchmarks/relay.py. It is also the bound on duplicates after a crash.
    batch_size: int = 5000
    poll_interval: float = 1.0
    lanes: int = lanes_mod.DEFAULT_LANES
    max_attempts: int = 10
    rebalance_interval: float = 1.0
    metrics_port: int | None = None
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    stats_interval: float = 5.0
    shutdown_grace: float = 5.0

    def validate(self) -> RelayConfig:
        normalize_database_url(self.database_url)
        validate_schema_name(self.schema)
        if not self.bootstrap_servers:
            raise ConfigurationError(
                f"--bootstrap-servers is required (or set {ENV_KAFKA_BOOTSTRAP})"
            )
        if not 1 <= self.batch_size <= 100_000:
            raise ConfigurationError(
                f"--batch-size must be between 1 and 100000, got {self.batch_size}"
            )
        if not 1 <= self.lanes <= lanes_mod.MAX_LANES:
            raise ConfigurationError(
                f"--lanes must be between 1 and {lanes_mod.MAX_LANES}, got {self.lanes}"
            )
        if self.max_attempts < 1:
            raise ConfigurationError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        for name in ("poll_interval", "rebalance_interval", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag} must be positive, got {getattr(self, name)!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"--metrics-port must be a TCP port, got {self.metrics_port}")
        return self


# --------------------------------------------------------------------------------------------
# Pure decisions (tested without services)
# --------------------------------------------------------------------------------------------


def delivery_rounds(keys: Sequence[bytes | None]) -> list[list[int]]:
    """Split a claimed batch (in id order) into rounds of row indexes.

    Round ``r`` holds the ``r``-th row of every key; key-less rows have no order to keep and all
    go in round 0. Within a round no key appears twice, so a round can be produced at once.
    """
    rounds: list[list[int]] = []
    seen: dict[bytes, int] = {}
    for index, key in enumerate(keys):
        depth = 0
        if key is not None:
            depth = seen.get(key, 0)
            seen[key] = depth + 1
        if depth == len(rounds):
            rounds.append([])
        rounds[depth].append(index)
    return rounds


@dataclass(frozen=True)
class Settlement:
    """What to write back for a batch: confirmed rows to delete and failed rows to update."""

    delete: list[int]
    fail_ids: list[int]
    fail_errors: list[str]
    fail_park: list[bool]
    outage: bool
    failed: int = 0  # rows with an outcome that is not a confirmation

    @property
    def parked(self) -> int:
        return sum(self.fail_park)


def settle(
    ids: Sequence[int],
    attempts: Sequence[int],
    outcomes: Sequence[Outcome | None],
    max_attempts: int,
) -> Settlement:
    """Decide each row's fate from its delivery outcome (``None``: not sent in this batch).

    * confirmed -> deleted;
    * permanent error -> parked at once;
    * retriable error -> one more attempt recorded, parked when ``max_attempts`` is reached --
      but only if Kafka confirmed some other record of the batch. When nothing at all got
      through, the broker is the problem, not the rows: attempts are not counted (an outage
      must never park the whole outbox) and the batch is an *outage* (the caller backs off).
    """
    delete: list[int] = []
    failures: list[tuple[int, int, Outcome]] = []
    for row_id, tries, outcome in zip(ids, attempts, outcomes, strict=True):
        if outcome is None:
            continue
        if outcome.error is None:
            delete.append(row_id)
        else:
            failures.append((row_id, tries, outcome))
    fail_ids: list[int] = []
    fail_errors: list[str] = []
    fail_park: list[bool] = []
    any_retriable = False
    for row_id, tries, outcome in failures:
        if outcome.permanent:
            fail_ids.append(row_id)
            fail_errors.append(outcome.error or "")
            fail_park.append(True)
        elif outcome.code is not None:
            any_retriable = True
            if delete:
                fail_ids.append(row_id)
                fail_errors.append(outcome.error or "")
                fail_park.append(tries + 1 >= max_attempts)
    return Settlement(
        delete,
        fail_ids,
        fail_errors,
        fail_park,
        outage=any_retriable and not delete,
        failed=len(failures),
    )


def backoff_delay(failures: int, initial: float, maximum: float, rng: random.Random) -> float:
    """Capped exponential backoff with full jitter: uniform in [d/2, d], d = initial * 2**n."""
    delay = min(maximum, initial * (2 ** max(0, failures - 1)))
    return rng.uniform(delay / 2, delay)


# A row as the claim returns it (a plain tuple: the relay handles thousands per batch):
# (id, attempts, topic, key, value, headers JSON text, event id as ASCII bytes, skipped).
# Skipped rows (see OUTBOX_CLAIM_BATCH) carry only id and key.
ClaimedRow = tuple[int, int, str, bytes | None, bytes, str, bytes, bool]
ID: Final = 0
ATTEMPTS: Final = 1
TOPIC: Final = 2
KEY: Final = 3
VALUE: Final = 4
HEADERS: Final = 5
EVENT_ID: Final = 6
SKIPPED: Final = 7
_row_id = operator.itemgetter(ID)


def drop_blocked(
    claimed: list[ClaimedRow], skipped: Sequence[tuple[int, bytes | None]]
) -> list[ClaimedRow]:
    """Claim rule, second half: drop every claimed row that has an earlier row of its key among
    the ``skipped`` rows (locked by another transaction, or behind a parked row).

    ``skipped`` is empty unless another relay holds rows of these lanes, so the usual cost is
    nothing.
    """
    if not skipped:
        return claimed
    first: dict[bytes, int] = {}
    for row_id, key in skipped:
        if key is not None and row_id < first.get(key, row_id + 1):
            first[key] = row_id
    kept: list[ClaimedRow] = []
    for row in claimed:
        key = row[KEY]
        if key is None or first.get(key, row[ID] + 1) > row[ID]:
            kept.append(row)
    return kept


def build_records(rows: Sequence[ClaimedRow]) -> list[RecordTuple]:
    """The Kafka records of claimed rows, in the same order (see :func:`build_record`)."""
    headers_of = _headers_of_json
    records: list[RecordTuple] = []
    append = records.append
    # One loop with local names: ~1 us per row, the relay's main per-row Python cost.
    for _, _, topic, key, value, stored, event_id, _ in rows:
        headers, has_idempotency_key = headers_of(stored)
        if not has_idempotency_key:
            headers = [*headers, (IDEMPOTENCY_HEADER, event_id)]
        append((topic, key, value, headers))
    return records


def build_records_checked(
    rows: Sequence[ClaimedRow],
) -> tuple[list[RecordTuple | None], dict[int, str]]:
    """:func:`build_records` for a batch in which some row cannot become a record (stored
    headers that are not what ``uow.publish`` writes, e.g. from hand-written SQL): those rows
    get ``None`` and an error text, by index; the others their records."""
    records: list[RecordTuple | None] = []
    broken: dict[int, str] = {}
    for index, row in enumerate(rows):
        try:
            records.append(build_records([row])[0])
        except Exception as exc:
            records.append(None)
            broken[index] = f"row cannot be turned into a record: {type(exc).__name__}: {exc}"
    return records, broken


def build_record(
    topic: str, key: bytes | None, value: bytes, stored_headers: Mapping[str, Any], event_id: str
) -> Record:
    """The Kafka record of an outbox row: the publisher's headers plus ``X-Idempotency-Key``
    (the event id, unless the publisher set that header itself)."""
    headers, has_idempotency_key = _headers(stored_headers)
    return Record(
        topic, key, value, _with_event_id(headers, has_idempotency_key, event_id.encode("ascii"))
    )


@functools.lru_cache(maxsize=4096)
def _headers_of_json(stored_json: str) -> tuple[Headers, bool]:
    # Most rows of an outbox carry the same few header sets (content type, source): decoding
    # each distinct JSON text once saves a JSON parse and a base64 pass per record. The cached
    # list is shared by many records and must never be mutated (confluent-kafka only reads it).
    return _headers(json.loads(stored_json))


def _headers(stored: Mapping[str, Any]) -> tuple[Headers, bool]:
    headers: Headers = list(decode_headers(stored))
    wanted = IDEMPOTENCY_HEADER.lower()
    return headers, any(name.lower() == wanted for name, _ in headers)


def _with_event_id(headers: Headers, has_idempotency_key: bool, event_id: bytes) -> Headers:
    # A new list (the cached one stays untouched), or the cached one itself when the publisher
    # set its own idempotency key.
    return headers if has_idempotency_key else [*headers, (IDEMPOTENCY_HEADER, event_id)]


# --------------------------------------------------------------------------------------------
# SQL (written once; the table name is an allow-listed schema, quoted by the dialect)
# --------------------------------------------------------------------------------------------


def _not_behind_parked(row: str) -> str:
    """SQL: ``row`` has no parked row of its key before it (``{outbox}`` is formatted later)."""
    return f"""((SELECT NOT EXISTS (SELECT 1 FROM {{outbox}} WHERE parked_at IS NOT NULL))
       OR NOT EXISTS (
          SELECT 1 FROM {{outbox}} p
          WHERE p.parked_at IS NOT NULL
            AND p.key_hash = {row}.key_hash AND p.key = {row}.key AND p.id < {row}.id
          OFFSET 0
       ))"""


# Claim rule (see the module docstring). Rows of keys blocked by a parked row are never even
# locked, so a poison key cannot fill every batch. The per-row probe of the small partial index
# ix_outbox_parked (`OFFSET 0` keeps it a probe instead of a join over the whole table) only
# runs when some row is parked at all: the uncorrelated `NOT EXISTS` is an InitPlan evaluated
# once, and PostgreSQL evaluates the arms of an OR in the order written.
#
# The second arm returns the *skipped* rows: rows of the owned lanes, inside the id range the
# claim covered, that the claim did not get. Such a row is locked by another transaction (a
# relay that still holds it) or waits behind a parked row; either way every later claimed row
# of its key must wait. The relay drops those rows itself (`blocked_keys`): done in SQL, the
# join on `key` between claim and skipped rows cost more than the claim (a sort or hash of the
# whole batch on bytea keys), while in Python it is one dict look-up per row and nothing at all
# in the usual case where no row was skipped. Rows waiting behind a parked row are left out of the
# skipped rows: their key is never claimed anyway, and a long queue behind a parked row would
# otherwise travel to the relay with every claim. Both scans walk the primary key over the same
# short range, so a claim costs the same with 100 or 10 million rows pending.
#
# Columns come back in binary (no hex decoding of bytea), the event id already as the bytes of
# its text form (the value of the X-Idempotency-Key header). `%%` is psycopg's escaped `%`.
OUTBOX_CLAIM_BATCH = (
    """
WITH claim AS (
    SELECT o.id, o.event_id, o.topic, o.key, o.value, o.headers, o.attempts
    FROM {outbox} o
    WHERE o.parked_at IS NULL
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
  AND s.key IS NOT NULL
  AND s.parked_at IS NULL
  AND (s.key_hash %% %(lanes)s) = ANY(%(owned)s::integer[])
  AND NOT EXISTS (SELECT 1 FROM claim c WHERE c.id = s.id)
  AND """
    + _not_behind_parked("s")
    + """
"""
)

# The ids go as one text parameter, an array literal the relay formats itself ("{1,2,3}"): a
# ",".join of ints is ~20 times cheaper than the driver's per-element array dumper.
OUTBOX_DELETE_CONFIRMED = "DELETE FROM {outbox} WHERE id = ANY(%s::bigint[])"

OUTBOX_RECORD_FAILURES = """
UPDATE {outbox} o
SET attempts = o.attempts + 1,
    last_error = f.error,
    parked_at = CASE WHEN f.park THEN now() ELSE NULL END
FROM unnest(CAST(:ids AS bigint[]), CAST(:errors AS text[]), CAST(:park AS boolean[]))
     AS f(id, error, park)
WHERE o.id = f.id
"""

OUTBOX_STATS = """
SELECT count(*) FILTER (WHERE parked_at IS NULL) AS backlog,
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,
       EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL)) AS oldest
FROM {outbox}
"""


def qualified_outbox(dialect: sa.Dialect, schema: str | None) -> str:
    """``"schema"."outbox"`` quoted by the dialect (the schema went through the allow-list)."""
    preparer = dialect.identifier_preparer
    schema = validate_schema_name(schema)
    table = preparer.quote(OUTBOX)
    return table if schema is None else f"{preparer.quote_schema(schema)}.{table}"


@dataclass(frozen=True)
class Statements:
    """The relay's SQL for one schema. ``claim`` and ``delete`` run on the driver's cursor
    (psycopg placeholders; the hot path skips SQLAlchemy's result machinery), the rest through
    SQLAlchemy."""

    claim: str
    delete: str
    fail: sa.TextClause
    stats: sa.TextClause

    @classmethod
    def for_schema(cls, dialect: sa.Dialect, schema: str | None) -> Statements:
        table = qualified_outbox(dialect, schema)
        return cls(
            claim=OUTBOX_CLAIM_BATCH.format(outbox=table),
            delete=OUTBOX_DELETE_CONFIRMED.format(outbox=table),
            fail=sa.text(OUTBOX_RECORD_FAILURES.format(outbox=table)),
            stats=sa.text(OUTBOX_STATS.format(outbox=table)),
        )


# --------------------------------------------------------------------------------------------
# The relay
# --------------------------------------------------------------------------------------------


@dataclass
class BatchResult:
    claimed: int = 0
    sent: int = 0
    confirmed: int = 0
    parked: int = 0
    failed: int = 0
    outage: bool = False
    stale_producer: bool = False
    error: str | None = None


class Relay:
    """One relay process's worth of work. ``run()`` until ``stop()`` (or drained, with
    ``once=True``).

    ``producer_factory`` exists for the benchmark and tests that need another producer
    configuration; it defaults to :class:`outbox._kafka.producer.KafkaProducer`.
    """

    def __init__(
        self,
        config: RelayConfig,
        *,
        producer_factory: Callable[[], KafkaProducer] | None = None,
    ) -> None:
        self.config = config.validate()
        self.url = normalize_database_url(config.database_url)
        self.stop_event = threading.Event()
        self.kick = threading.Event()
        # Set while the loop waits for work (tests and benchmarks wait for an idle relay).
        self.idle = threading.Event()
        self.metrics = RelayMetrics()
        self.owned: set[int] = set()
        self.pid: int | None = None
        self.totals = BatchResult()
        self._rng = random.Random()
        self._connect_args = {
            "application_name": lanes_mod.APPLICATION_NAME,
            "connect_timeout": 5,
            "keepalives": 1,
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            # Plan the claim as the short primary-key range walk it is, with hash joins over
            # the claimed rows. The planner cannot know how many rows a claim takes or where the
            # `skipped` range ends, so it would otherwise guess a handful of rows (nested loops,
            # quadratic in --batch-size) or a third of the table (a full scan per claim); those
            # cost estimates also trigger JIT compilation, hundreds of milliseconds per claim.
            # Server-side keepalives: PostgreSQL notices a vanished relay host (and frees its
            # lanes) within about 25 s instead of the kernel's two hours. Only these sessions.
            "options": "-c jit=off -c enable_seqscan=off -c enable_bitmapscan=off "
            "-c enable_nestloop=off "
            "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
        }
        self.engine = sa.create_engine(
            self.url,
            poolclass=sa.pool.NullPool,
            # No server-side prepared statements: a generic plan of the claim ignores how few
            # rows a batch takes and degrades to scans costing seconds; planning costs ~0.5 ms.
            connect_args={**self._connect_args, "prepare_threshold": None},
        )
        self.sql = Statements.for_schema(self.engine.dialect, config.schema)
        self._producer_factory = producer_factory or (
            lambda: KafkaProducer(config.bootstrap_servers, config.kafka_config)
        )
        self._producer: KafkaProducer | None = None
        self._conn: sa.Connection | None = None
        self._next_rebalance = 0.0
        self._next_stats = 0.0
        self._kafka_failures = 0
        self._db_failures = 0

    # ------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and return (safe from signal handlers)."""
        self.stop_event.set()
        self.kick.set()

    def _sleep(self, seconds: float) -> None:
        self.stop_event.wait(seconds)

    def _raw_connect(self) -> Any:
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        params = {**cparams, **self._connect_args}
        return psycopg.connect(*cargs, **params)

    # ---------------------------------------------------------------------------- database

    def _connect(self) -> sa.Connection:
        conn = self.engine.connect()
        try:
            pid = lanes_mod.register(conn, self.config.schema, self.config.lanes)
            counts = lanes_mod.configured_lane_counts(
                lanes_mod.read_locks(conn, self.config.schema), self.config.schema
            )
            conn.commit()
        except Exception:
            conn.close()
            raise
        others = counts - {self.config.lanes}
        if others:
            conn.close()
            raise ConfigurationError(
                f"other relays of this outbox run with --lanes {sorted(others)}, this one with "
                f"--lanes {self.config.lanes}: every relay must use the same lane count (stop "
                "them all and restart with one value)"
            )
        self.pid = pid
        self.owned = set()
        self._next_rebalance = 0.0
        self.metrics.database_up = True
        self.metrics.up.set(1)
        return conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self.owned = set()
        self.metrics.lanes_owned.set(0)
        self.metrics.database_up = False
        self.metrics.up.set(0)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def _rebalance(self, conn: sa.Connection) -> None:
        schema = self.config.schema
        rows = lanes_mod.read_locks(conn, schema)
        owners = lanes_mod.ownership_from_locks(rows, schema)
        mine = set(owners.get(self.pid or -1, ()))
        if mine != self.owned:
            log.warning(
                "event=lanes_mismatch expected=%s actual=%s",
                _ranges(self.owned),
                _ranges(mine),
            )
            self.owned = mine
        others = {lane for pid, held in owners.items() if pid != self.pid for lane in held}
        plan = lanes_mod.plan_rebalance(
            self.config.lanes, len(owners), self.owned, others, seed=self.pid or 0
        )
        if plan.release:
            lanes_mod.release(conn, schema, plan.release)
            self.owned -= set(plan.release)
        got: list[int] = []
        if plan.acquire:
            got = lanes_mod.try_acquire(conn, schema, plan.acquire)
            self.owned |= set(got)
        conn.commit()
        self.metrics.lanes_owned.set(len(self.owned))
        if plan.release or got:
            log.info(
                "event=lanes_changed relays=%d owned=%d target=%d took=%s gave_back=%s",
                len(owners),
                len(self.owned),
                plan.target,
                _ranges(got),
                _ranges(plan.release),
            )

    def _refresh_stats(self, conn: sa.Connection) -> None:
        # A whole-table count: here a sequential scan is the right plan (see connect options).
        conn.execute(sa.text("SET LOCAL enable_seqscan = on"))
        row = conn.execute(self.sql.stats).one()
        conn.commit()
        self.metrics.backlog.set(row.backlog)
        self.metrics.parked_rows.set(row.parked)
        self.metrics.oldest_age.set(float(row.oldest or 0.0))

    # ------------------------------------------------------------------------------- batch

    def _producer_or_new(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = self._producer_factory()
        return self._producer

    def process_batch(self, conn: sa.Connection) -> BatchResult:
        """Claim, produce, confirm, delete and commit one batch of the owned lanes."""
        result = BatchResult()
        if not self.owned:
            return result
        started = time.monotonic()
        # The claim and the delete run on the driver's cursor (the hot path: thousands of rows
        # per batch, no per-row SQLAlchemy objects). Beginning the transaction through
        # SQLAlchemy first keeps its commit() and rollback() in charge of that work.
        if not conn.in_transaction():
            conn.begin()
        dbapi: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
        with dbapi.cursor(binary=True) as cur:
            cur.execute(
                self.sql.claim,
                {
                    "lanes": self.config.lanes,
                    "owned": sorted(self.owned),
                    "batch_size": self.config.batch_size,
                },
            )
            fetched: list[ClaimedRow] = cur.fetchall()
        claimed = [r for r in fetched if not r[SKIPPED]]
        # In id order: the claim walks the primary key, so this sort only confirms it (O(n)).
        claimed.sort(key=_row_id)
        rows = drop_blocked(claimed, [(r[ID], r[KEY]) for r in fetched if r[SKIPPED]])
        if not rows:
            conn.commit()
            return result
        result.claimed = len(claimed)
        outcomes: list[Outcome | None] = [None] * len(rows)
        failed_keys: set[bytes] = set()
        records: Sequence[RecordTuple | None]
        broken: dict[int, str] = {}
        try:
            records = build_records(rows)
        except Exception:
            records, broken = build_records_checked(rows)
            for i, error in broken.items():
                outcomes[i] = Outcome(error=error, permanent=True)  # parked below
        producer = self._producer_or_new()
        for round_ in delivery_rounds([r[KEY] for r in rows]):
            if self.stop_event.is_set():
                break  # finish: what was confirmed so far is deleted below, the rest stays
            if broken:
                for i in round_:
                    key = rows[i][KEY]
                    if i in broken and key is not None:
                        failed_keys.add(key)  # its earlier rows went in earlier rounds
            todo = round_
            if failed_keys or broken:
                todo = [
                    i
                    for i in round_
                    if outcomes[i] is None
                    and (rows[i][KEY] is None or rows[i][KEY] not in failed_keys)
                ]
                if not todo:
                    continue
            sent = producer.send(
                [records[i] for i in todo],  # type: ignore[misc]  # broken rows are not in todo
                self.stop_event,
                self.config.shutdown_grace,
            )
            result.sent += len(todo)
            for i, outcome in zip(todo, sent, strict=True):
                outcomes[i] = outcome
                key = rows[i][KEY]
                if outcome is not CONFIRMED and key is not None:
                    failed_keys.add(key)
        verdict = settle(
            [r[ID] for r in rows], [r[ATTEMPTS] for r in rows], outcomes, self.config.max_attempts
        )
        if verdict.delete:
            with dbapi.cursor() as cur:
                cur.execute(self.sql.delete, ("{" + ",".join(map(str, verdict.delete)) + "}",))
        if verdict.fail_ids:
            conn.execute(
                self.sql.fail,
                {"ids": verdict.fail_ids, "errors": verdict.fail_errors, "park": verdict.fail_park},
            )
        conn.commit()
        result.confirmed = len(verdict.delete)
        result.parked = verdict.parked
        result.failed = verdict.failed
        result.outage = verdict.outage
        if verdict.failed:
            failures = [o for o in outcomes if o is not None and not o.ok]
            result.stale_producer = any(o.stale_producer for o in failures)
            result.error = failures[0].error
        self._report(rows, outcomes, verdict, result, time.monotonic() - started)
        return result

    def _report(
        self,
        rows: Sequence[ClaimedRow],
        outcomes: Sequence[Outcome | None],
        verdict: Settlement,
        result: BatchResult,
        duration: float,
    ) -> None:
        m = self.metrics
        m.batch_duration.observe(duration)
        m.published.inc(result.confirmed)
        m.parked.inc(result.parked)
        if result.failed:
            permanent = sum(1 for o in outcomes if o is not None and not o.ok and o.permanent)
            if permanent:
                m.failed.labels("permanent").inc(permanent)
            if result.failed - permanent:
                m.failed.labels("retriable").inc(result.failed - permanent)
        if result.parked:
            parked_ids = {i for i, p in zip(verdict.fail_ids, verdict.fail_park, strict=True) if p}
            for row, outcome in zip(rows, outcomes, strict=True):
                if row[ID] in parked_ids and outcome is not None:
                    log.warning(
                        "event=row_parked id=%d event_id=%s topic=%r attempts=%d error=%r",
                        row[ID],
                        row[EVENT_ID].decode("ascii"),
                        row[TOPIC],
                        row[ATTEMPTS] + 1,
                        outcome.error,
                    )
        self.totals.claimed += result.claimed
        self.totals.confirmed += result.confirmed
        self.totals.parked += result.parked
        self.totals.failed += result.failed
        log.debug(
            "event=batch claimed=%d sent=%d confirmed=%d failed=%d parked=%d duration_ms=%.1f",
            result.claimed,
            result.sent,
            result.confirmed,
            result.failed,
            result.parked,
            duration * 1000,
        )

    # -------------------------------------------------------------------------------- loop

    def run(self, once: bool = False) -> int:
        """Serve lanes until :meth:`stop` (or, with ``once``, until nothing is claimable)."""
        listener = None
        if not once:
            listener = Listener(self._raw_connect, self.config.schema, self.kick, self.stop_event)
            listener.start()
        log.info(
            "event=relay_started database=%s bootstrap=%s lanes=%d batch_size=%d once=%s",
            redact_url(self.url),
            self.config.bootstrap_servers,
            self.config.lanes,
            self.config.batch_size,
            once,
        )
        try:
            # Built up front: its first connection and producer id cost a round trip or two
            # that should not delay the first event.
            self._producer_or_new()
            return self._loop(once)
        finally:
            self._shutdown(listener)

    def _loop(self, once: bool) -> int:
        while not self.stop_event.is_set():
            self.metrics.beat()
            try:
                if self._conn is None:
                    self._conn = self._connect()
                    if self._db_failures:
                        log.info("event=database_reconnected pid=%s", self.pid)
                    self._db_failures = 0
                conn = self._conn
                now = time.monotonic()
                if now >= self._next_rebalance:
                    self._rebalance(conn)
                    self._next_rebalance = now + self.config.rebalance_interval
                if not once and now >= self._next_stats:
                    self._refresh_stats(conn)
                    self._next_stats = now + self.config.stats_interval
                self.kick.clear()
                result = self.process_batch(conn)
            except ConfigurationError:
                raise
            except FatalProducerError as exc:
                log.error("event=producer_rebuilt reason=%r", str(exc))
                self._rollback()
                self._close_producer()
                self._kafka_failures += 1
                self._sleep(self._delay(self._kafka_failures))
                continue
            except (sa.exc.SQLAlchemyError, psycopg.Error, OSError) as exc:
                # psycopg.Error: the claim and the delete use the driver's cursor directly.
                self._db_failures += 1
                delay = self._delay(self._db_failures)
                log.warning(
                    "event=database_lost error=%r retry_in=%.2fs",
                    _one_line(exc, self.url),
                    delay,
                )
                self._drop_connection()
                self._sleep(delay)
                continue
            if result.stale_producer or result.outage:
                # A fresh producer after an outage or a broken idempotence state: message
                # timeouts make librdkafka bump its epoch, which some brokers refuse for good.
                self._close_producer()
            if result.outage:
                self._kafka_failures += 1
                delay = self._delay(self._kafka_failures)
                log.warning(
                    "event=kafka_unavailable failed=%d consecutive=%d retry_in=%.2fs error=%r",
                    result.failed,
                    self._kafka_failures,
                    delay,
                    result.error,
                )
                self._sleep(delay)
                continue
            if result.confirmed and self._kafka_failures:
                log.info("event=kafka_recovered after_failures=%d", self._kafka_failures)
                self._kafka_failures = 0
            full = result.claimed >= self.config.batch_size and result.sent > 0
            if full or (result.sent and result.failed):
                continue
            if once:
                if not self.owned and self._conn is not None:
                    self._sleep(0.05)  # waiting for a lane to become free
                    continue
                if result.sent == 0:
                    return EXIT_OK
                continue
            if not self.kick.is_set():
                timeout = min(
                    self.config.poll_interval, max(0.0, self._next_rebalance - time.monotonic())
                )
                self.idle.set()
                self.kick.wait(timeout)
                self.idle.clear()
        return EXIT_OK

    def _delay(self, failures: int) -> float:
        return backoff_delay(
            failures, self.config.backoff_initial, self.config.backoff_max, self._rng
        )

    def _rollback(self) -> None:
        if self._conn is not None:
            try:
                self._conn.rollback()
            except sa.exc.SQLAlchemyError:
                self._drop_connection()

    def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.purge()

    def _shutdown(self, listener: Listener | None) -> None:
        self.stop_event.set()
        self._rollback()
        if self._producer is not None:
            self._producer.close(timeout=1.0)
            self._producer = None
        self._drop_connection()
        if listener is not None:
            listener.join(2.0)
        self.engine.dispose()
        log.info(
            "event=relay_stopped confirmed=%d failed=%d parked=%d",
            self.totals.confirmed,
            self.totals.failed,
            self.totals.parked,
        )

    # ------------------------------------------------------------------------------- check

    def check(self) -> list[str]:
        """Problems that would stop this relay from working (empty when ready)."""
        from outbox import migrate

        problems: list[str] = []
        try:
            with self.engine.connect() as conn:
                current = migrate.current_revision(conn, self.config.schema)
        except sa.exc.SQLAlchemyError as exc:
            problems.append(
                f"database {redact_url(self.url)} is not reachable: {_one_line(exc, self.url)}"
            )
        else:
            head = migrate.head_revision()
            if current != head:
                problems.append(
                    f"database schema is at revision {current or 'none'}, this relay needs "
                    f"{head}: run `outbox migrate --database-url URL`"
                )
        try:
            producer = self._producer_factory()
            brokers = producer.check()
            producer.close(0.1)
            log.info("event=kafka_check brokers=%d", brokers)
        except PublishError as exc:
            problems.append(str(exc))
        return problems


def _ranges(values: Sequence[int] | set[int]) -> str:
    """Compact lane list for logs: 0-3,7,9-10."""
    items = sorted(values)
    if not items:
        return "-"
    parts: list[str] = []
    start = prev = items[0]
    for v in [*items[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def _one_line(exc: BaseException, url: str) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    message = text[0] if text else type(exc).__name__
    return message.replace(url, redact_url(url))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from outbox.cli_old import add_database_url, add_kafka, add_log_level

    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="Relay committed outbox rows to Kafka: no loss, per-key order, many relays.",
    )
    add_database_url(parser)
    add_kafka(parser)
    add_log_level(parser)
    d = RelayConfig("", "")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"rows claimed per batch (env {ENV_BATCH_SIZE}; default {d.batch_size})",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        help=f"seconds between polls when no wake-up arrives (env {ENV_POLL_INTERVAL}; "
        f"default {d.poll_interval:g})",
    )
    parser.add_argument(
        "--lanes",
        type=int,
        default=None,
        help=f"number of lanes; must be the same for every relay (env {ENV_LANES}; default "
        f"{d.lanes})",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help=f"failed deliveries before a row is parked (env {ENV_MAX_ATTEMPTS}; default "
        f"{d.max_attempts})",
    )
    parser.add_argument(
        "--rebalance-interval",
        type=float,
        default=None,
        help=f"seconds between lane rebalances (env {ENV_REBALANCE_INTERVAL}; default "
        f"{d.rebalance_interval:g})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"serve /metrics and /healthz on this port (env {ENV_METRICS_PORT}; default off)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="drain what is pending, then exit 0")
    mode.add_argument(
        "--check",
        action="store_true",
        help="verify the schema is migrated and the broker answers, then exit",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    """Flags first, then ``OUTBOX_*`` environment variables, then defaults."""
    from outbox.cli_old import parse_kafka_config, require

    d = RelayConfig("", "")
    metrics_port = args.metrics_port
    if metrics_port is None and env(ENV_METRICS_PORT):
        metrics_port = env_int(ENV_METRICS_PORT, 0)

    def pick(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    return RelayConfig(
        database_url=require(args.database_url, "--database-url", ENV_DATABASE_URL),
        bootstrap_servers=require(
            args.bootstrap_servers, "--bootstrap-servers", ENV_KAFKA_BOOTSTRAP
        ),
        schema=args.schema,
        kafka_config=parse_kafka_config(args.kafka_config, env(ENV_KAFKA_CONFIG)),
        batch_size=pick(args.batch_size, env_int(ENV_BATCH_SIZE, d.batch_size)),
        poll_interval=pick(args.poll_interval, env_float(ENV_POLL_INTERVAL, d.poll_interval)),
        lanes=pick(args.lanes, env_int(ENV_LANES, d.lanes)),
        max_attempts=pick(args.max_attempts, env_int(ENV_MAX_ATTEMPTS, d.max_attempts)),
        rebalance_interval=pick(
            args.rebalance_interval, env_float(ENV_REBALANCE_INTERVAL, d.rebalance_interval)
        ),
        metrics_port=metrics_port,
    ).validate()


def _command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    relay = Relay(config)
    if args.check:
        problems = relay.check()
        relay.engine.dispose()
        for problem in problems:
            print(f"outbox-relay: check failed: {problem}", file=sys.stderr)
        if problems:
            return EXIT_FAILURE
        print("outbox-relay: check passed: schema migrated, brokers answer")
        return EXIT_OK

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("event=stop_requested signal=%s", signal.Signals(signum).name)
        relay.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = None
    if config.metrics_port is not None:
        server = MetricsServer(
            relay.metrics, config.metrics_port, max_silence=max(30.0, 3 * config.poll_interval)
        ).start()
        log.info("event=metrics_listening port=%d", server.port)
    try:
        return relay.run(once=args.once)
    finally:
        if server is not None:
            server.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``outbox-relay`` console script."""
    from outbox.cli_old import configure_logging, run

    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return run(_command, args)
    except OutboxError as exc:  # pragma: no cover - run() already turns these into exit codes
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
