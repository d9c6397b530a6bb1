# generated from outbox/uow/_batch_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/uow/_batch_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from outbox._core import claim, results
from outbox._core.claim import StoredOutcome
from outbox._core.events import Event, order_lock_id
from outbox._core.failures import is_permanent
from outbox._pg.statements import many_statements
from outbox._pg.transaction import Transaction
from outbox.errors import ConfigurationError
from outbox.uow._unit import UnitOfWork
from outbox.uow._unit_base import Completion

if TYPE_CHECKING:
    from outbox.uow._outbox import Outbox

log = logging.getLogger("outbox.uow")

# Up to this many bytes of event values, the final statement and COMMIT share one round trip (as
# in a single unit of work); above it the values go as binary parameters.
_INLINE_LIMIT = 64 * 1024

# A released savepoint that wrote something keeps its subtransaction id in the transaction until
# the commit, and PostgreSQL caches 64 of them per backend: past that the transaction is
# "suboverflowed", and every snapshot that meets its rows -- in any session -- reads pg_subtrans
# for them (the subtransaction cliff). A batch is full once it released this many (rolled-back
# savepoints do not count: their ids leave the cache).
MAX_SAVEPOINTS = 48


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """What a batch's lookup learned about one key: whether this transaction holds its lock, and
    its committed outcome (with its age in seconds) if it has one."""

    acquired: bool
    stored: StoredOutcome | None
    age: float | None

    @property
    def runnable(self) -> bool:
        """True when the key's work may run here: no outcome yet and the lock is ours."""
        return self.acquired and self.stored is None


class BatchUnitOfWork(UnitOfWork):
    """A unit of work of a batch: the batch's connection, in the savepoint of its message.

    Reaching for ``connection`` or ``session`` marks it *touched*: only then does its savepoint
    need releasing (or rolling back) when it ends.
    """

    touched = False

    @property
    def connection(self) -> Connection:
        self.touched = True
        return super().connection

    @property
    def session(self) -> Session:
        self.touched = True
        return super().session


class Batch:
    """Units of work of many keys in one transaction, each in a savepoint.

    ::

        batch = Batch.open(ob, scope, ["k1", "k2", "k3"])   # BEGIN + every lookup
        try:
            for key in ("k1", "k2", "k3"):
                with batch.unit_of_work(key, scope, fingerprint=None) as uow:
                    ...                          # the same unit of work as Outbox's
            batch.commit()                 # every key's final row, every outbox row, COMMIT
        finally:
            batch.close()

    A unit of work costs a transaction of its own two round trips and a commit (an fsync). A
    batch pays them once for all its units of work:

    * :meth:`open` sends ``BEGIN``, tries the advisory lock of every key (never waiting: a key
      held elsewhere is :class:`~outbox.errors.KeyInProgress` for its unit of work, which fails
      fast), reads every committed outcome and sets a savepoint -- one round trip. The read runs
      after the locks, so it sees the outcome of any attempt that held a lock before.
    * Each unit of work runs in the savepoint; a failure rolls back to it, so only that unit's
      writes go. The locks stay held (they were taken before the savepoint). Success releases
      the savepoint and sets the next one in one round trip -- and only if the body touched the
      connection or the session at all; a body that only publishes and returns costs none.
      After :data:`MAX_SAVEPOINTS` such releases the batch is :meth:`full`: its caller commits
      it and opens another for the keys left.
    * With ``chunk`` > 1 (``open(..., chunk=32)``), up to ``chunk`` units of work share one
      savepoint: the round trip that releases it is paid once per chunk, and only when another
      unit of work is about to begin. A unit that fails after touching the connection rolls the
      whole chunk back: the chunk's other units of work are then *lost* -- not recorded, their
      keys not to be used again in this batch -- and :meth:`take_lost` names them, so that the
      caller runs them again in another batch.
    * ``open(..., optimistic=True)`` sets no savepoint between units of work and pipelines
      their statements (a statement returns once sent; psycopg only): a message that writes
      costs no round trip of its own unless it reads rows. Any failure of a unit of work (or of
      a pipelined statement, which may surface in a later one: whose it was is not known)
      makes the batch :attr:`abandoned`: nothing of it is recorded, and its caller closes it
      and runs its messages again in batches with a savepoint each.
    * :meth:`commit` writes every key's final row and every outbox row in one statement and
      commits in the same round trip, after the last unit of work's business writes took their
      locks (as a single unit of work does); the outcomes go to Redis only after the commit.

    A caller that acts on a unit of work's success (the runner committing a Kafka offset) waits
    for :meth:`commit` to return.
    """

    def __init__(
        self,
        outbox: Outbox,
        scope: str,
        tx: Transaction,
        lookups: dict[str, KeyLookup],
        chunk: int = 1,
        optimistic: bool = False,
    ) -> None:
        self._outbox = outbox
        self.chunk = chunk
        self.optimistic = optimistic
        self.abandoned = False  # an optimistic batch's unit of work failed: it cannot commit
        # Units of work that ended well in the current savepoint, not staged yet (it may still
        # be rolled back); whether any of them touched the connection; and the keys of units of
        # work lost with a savepoint since take_lost() last asked.
        self._pending: list[Completion] = []
        self._dirty = False
        self._lost: list[str] = []
        self.scope = scope
        self._tx: Transaction | None = tx
        self._lookups = lookups
        self._used: set[str] = set()
        # The final rows, in the order their units of work ended.
        self._keys: list[str] = []
        self._statuses: list[str] = []
        self._fingerprints: list[str | None] = []
        self._results: list[str | None] = []
        self._errors: list[str | None] = []
        self._events: list[Event] = []
        self.staged_bytes = 0
        self.savepoints = 0  # released after writing: subtransaction ids the transaction holds
        # Outcomes for Redis after the commit; and outcomes read from PostgreSQL, already
        # committed, to warm it with whatever becomes of the batch.
        self._outcomes: list[tuple[str, StoredOutcome, float | None]] = []
        self._warm: list[tuple[str, StoredOutcome, float | None]] = []
        self.committed = False

    @classmethod
    def open(
        cls,
        outbox: Outbox,
        scope: str,
        keys: list[str],
        *,
        chunk: int = 1,
        optimistic: bool = False,
    ) -> Batch:
        """Begin the batch's transaction, take every key's lock and read every key's outcome
        (``keys``: distinct, already validated) in one round trip; raises what the database
        raised (nothing is held then). ``chunk``: units of work per savepoint; ``optimistic``:
        none between them, their statements pipelined."""
        if len(set(keys)) != len(keys):
            raise ConfigurationError("a batch claims each key once")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ConfigurationError(f"chunk must be a positive integer, got {chunk!r}")
        sql = many_statements(outbox.config.schema)
        outbox._check_sessions()
        tx = outbox._transactions.open(outbox.engine, pooled=outbox._pooled)
        try:
            locks, rows = tx.begin_with_many(
                [sql.idempotency_keys_lock, sql.idempotency_keys_read],
                {
                    "lock_ids": [claim.lock_id(scope, key) for key in keys],
                    "scope": scope,
                    "keys": keys,
                },
                savepoint=True,
            )
            if optimistic:
                tx.start_pipeline()
        except BaseException:
            tx.close()
            raise
        stored = {
            row[0]: (StoredOutcome(row[1], row[2], results.from_database(row[3]), row[4]), row[5])
            for row in rows
        }
        lookups = {}
        for key, acquired in zip(keys, locks[0][0], strict=True):
            outcome, age = stored.get(key, (None, None))
            lookups[key] = KeyLookup(bool(acquired), outcome, age)
        return cls(outbox, scope, tx, lookups, chunk, optimistic)

    def lookup(self, key: str) -> KeyLookup:
        """What the batch's lookup learned about ``key`` (one of the keys it was opened with)."""
        return self._lookups[key]

    def usable(self) -> bool:
        """True while more units of work can run and the batch can still commit."""
        return self._tx is not None and not self.abandoned and self._tx.usable()

    def full(self) -> bool:
        """True once the batch released :data:`MAX_SAVEPOINTS` savepoints that wrote: another
        unit of work that writes would take the transaction past PostgreSQL's cache of
        subtransactions."""
        return self.savepoints >= MAX_SAVEPOINTS

    def take_lost(self) -> list[str]:
        """The keys whose units of work ended well but were rolled back with their savepoint
        (a later unit of work of its chunk failed) since the last call: none of them is
        recorded, and none may have another unit of work in this batch."""
        lost, self._lost = self._lost, []
        return lost

    def unit_of_work(self, key: str, scope: str, fingerprint: str | None = None) -> _BatchAttempt:
        """The unit of work of ``key`` in this batch: the same outcomes as
        :meth:`Outbox.unit_of_work` (a replay, :class:`~outbox.errors.KeyInProgress`,
        :class:`~outbox.errors.PreviouslyFailed`, :class:`~outbox.errors.KeyReuseError`)."""
        return _BatchAttempt(self, [(key, scope, fingerprint)])

    def begin(self, key: str, fingerprint: str | None = None) -> BatchUnitOfWork:
        """Begin the unit of work of ``key``, a key whose work runs here (its lookup is
        :attr:`~KeyLookup.runnable`): what ``with batch.unit_of_work(key, batch.scope,
        fingerprint)`` enters, without the context manager. Its caller must :meth:`end` it."""
        self._make_room()
        uow = self._begin(key, self.scope, fingerprint)
        if uow.replayed:
            raise ConfigurationError(f"key {key!r} is decided already: no work of it runs here")
        return uow

    def end(self, uow: BatchUnitOfWork, exc: BaseException | None) -> None:
        """End the unit of work :meth:`begin` began, as the with-block of
        :meth:`unit_of_work` ends: ``exc`` is what its body raised (None: it ended well)."""
        self._end([uow], exc)

    def units_of_work(self, keys: list[tuple[str, str | None]]) -> _BatchGroup:
        """Units of work of several runnable keys (``(key, fingerprint)``) in ONE savepoint, for
        one body that serves them all. A failure rolls back all of them and records none."""
        return _BatchGroup(self, [(key, self.scope, fp) for key, fp in keys])

    # -- the units of work -----------------------------------------------------------------

    def _begin(self, key: str, scope: str, fingerprint: str | None) -> BatchUnitOfWork:
        if scope != self.scope:
            raise ConfigurationError(f"this batch claims keys of scope {self.scope!r}")
        if key in self._used:
            raise ConfigurationError(f"key {key!r} already had its unit of work in this batch")
        tx = self._tx
        if tx is None:
            raise ConfigurationError("the batch has ended")
        found = self._lookups[key]
        if not found.runnable:
            stored = self._replay(key, fingerprint, found)
            result = stored.result_json
            return BatchUnitOfWork(
                self._outbox, scope, key, fingerprint, None, replayed=True,
                result=json.loads(result) if result is not None else None,
                replayed_from="postgres",
            )  # fmt: skip
        self._used.add(key)
        return BatchUnitOfWork(
            self._outbox, scope, key, fingerprint, tx, replayed=False, shared=True
        )

    def replay(self, key: str, fingerprint: str | None) -> None:
        """Decide a key that is not :attr:`~KeyLookup.runnable` here without a unit of work:
        returns when its stored result may be replayed to this message (and warms the cache
        with it, as its replayed unit of work would), raises what its unit of work would raise
        (:class:`~outbox.errors.KeyInProgress`, :class:`~outbox.errors.PreviouslyFailed`,
        :class:`~outbox.errors.KeyReuseError`) otherwise. The key has no unit of work in this
        batch after it."""
        if key in self._used:
            raise ConfigurationError(f"key {key!r} already had its unit of work in this batch")
        if self._tx is None:
            raise ConfigurationError("the batch has ended")
        found = self._lookups[key]
        if found.runnable:
            raise ConfigurationError(f"key {key!r} is not decided yet: its work runs here")
        self._replay(key, fingerprint, found)

    def _replay(self, key: str, fingerprint: str | None, found: KeyLookup) -> StoredOutcome:
        self._used.add(key)
        claim.verdict(self.scope, key, fingerprint, found.stored, found.acquired)  # raises, or:
        assert found.stored is not None
        ttl = claim.warm_ttl(self._outbox.config.cache_ttl, self._outbox.config.retention,
                             found.age)  # fmt: skip
        if ttl is not None:
            self._warm.append((key, found.stored, ttl))
        return found.stored

    def _end(self, units: list[BatchUnitOfWork], exc: BaseException | None) -> None:
        """End ``units`` (one savepoint): stage their final rows, or roll them back."""
        tx = self._tx
        assert tx is not None
        if self.optimistic:
            self._end_optimistic(units, exc, tx)
            return
        touched = any(u.touched for u in units)
        if exc is None:
            try:
                done = [uow.complete() for uow in units]
                # Sharing a savepoint, a body whose statement failed (the error caught) still
                # ends here, on the savepoint it broke: RELEASE then fails it, as alone.
                if touched and (self.chunk == 1 or tx.failed()):
                    tx.renew(rollback=False)
                    self.savepoints += 1
            except BaseException:
                self._roll_back(units, touched)
                raise
            _close(units)
            self.staged_bytes += sum(len(e.value or b"") for d in done for e in d.events)
            if self.chunk == 1:
                for completion in done:
                    self._stage_completed(completion)
            else:  # staged once their savepoint is released (_make_room, commit)
                self._pending.extend(done)
                self._dirty = self._dirty or touched
            return
        self._roll_back(units, touched)
        if len(units) == 1 and is_permanent(exc, self._outbox.config.permanent_errors):
            # The key's lock is the transaction's, taken before the savepoint: still held, so
            # the failure is recorded with no gap in which another attempt could run the key.
            uow = units[0]
            self._stage(uow.key, claim.STATUS_FAILED, uow.fingerprint, None, None,
                        claim.failure_text(exc))  # fmt: skip

    def _end_optimistic(
        self, units: list[BatchUnitOfWork], exc: BaseException | None, tx: Transaction
    ) -> None:
        """End ``units`` of an optimistic batch: kept for the commit, or the batch abandoned
        (no rollback here: the whole transaction goes when the batch is closed)."""
        try:
            if exc is None and not tx.failed():
                for uow in units:
                    done = uow.complete()
                    if done.events:
                        self.staged_bytes += sum(len(e.value or b"") for e in done.events)
                    self._pending.append(done)
                return
            self.abandoned = True
        except BaseException:
            self.abandoned = True
            raise
        finally:
            _close(units)

    def _roll_back(self, units: list[BatchUnitOfWork], touched: bool) -> None:
        try:
            _close(units)
        finally:
            tx = self._tx
            if touched:
                # The chunk's earlier units of work go with the savepoint -- also those that
                # wrote nothing: a message of their partition may be among the lost, and
                # effects commit in partition order.
                self._lost.extend(c.key for c in self._pending)
                self.staged_bytes -= sum(len(e.value or b"") for c in self._pending
                                         for e in c.events)  # fmt: skip
                self._pending = []
                self._dirty = False
                if tx is not None and tx.usable():
                    tx.renew(rollback=True)

    def _make_room(self) -> None:
        """Before a unit of work begins: a full chunk's savepoint is released and the next one
        set (one round trip; none if the chunk wrote nothing), and its units of work staged."""
        if self.optimistic or len(self._pending) < self.chunk:
            return
        tx = self._tx
        if self._dirty and tx is not None:
            tx.renew(rollback=False)
            self.savepoints += 1
        self._stage_pending()

    def _stage_pending(self) -> None:
        for completion in self._pending:
            self._stage_completed(completion)
        self._pending = []
        self._dirty = False

    def _stage_completed(self, done: Completion) -> None:
        self._stage(done.key, claim.STATUS_COMPLETED, done.fingerprint, done.result_json,
                    done.result, None)  # fmt: skip
        self._events.extend(done.events)

    def _stage(
        self,
        key: str,
        status: str,
        fingerprint: str | None,
        result_json: str | None,
        result: Any,
        error: str | None,
    ) -> None:
        self._keys.append(key)
        self._statuses.append(status)
        self._fingerprints.append(fingerprint)
        self._results.append(result)
        self._errors.append(error)
        if self._outbox.cache is not None:  # only Redis reads them, after the commit
            self._outcomes.append(
                (key, StoredOutcome(status, fingerprint, result_json, error), None)
            )

    # -- the end -----------------------------------------------------------------------------

    def commit(self) -> None:
        """Write every staged row and commit, then put the outcomes in Redis. Raises what the
        database raised; nothing of the batch is committed then."""
        tx = self._tx
        if tx is None:
            raise ConfigurationError("the batch has ended")
        if self.abandoned:
            raise ConfigurationError("an abandoned batch cannot commit")
        if self.optimistic:
            tx.end_pipeline()  # raises the error of a pipelined statement that failed
            if tx.failed():
                raise ConfigurationError("a statement failed in the optimistic batch")
        self._stage_pending()  # COMMIT releases the last savepoint
        if not self._keys:
            tx.finish()  # nothing to write: no statement, no COMMIT record to wait for
            self._tx = None
            self.committed = True
            self._after(committed=True)
            return
        events = self._events
        schema = self._outbox.config.schema
        params: dict[str, Any] = {
            "scope": self.scope,
            "keys": self._keys,
            "statuses": self._statuses,
            "fingerprints": self._fingerprints,
            "results": self._results,
            "errors": self._errors,
            "event_ids": [e.event_id for e in events],
            "topics": [e.topic for e in events],
            "event_keys": [e.key for e in events],
            "values": [e.value for e in events],
            "headers": [e.headers_json for e in events],
            "key_hashes": [e.key_hash for e in events],
            "order_locks": sorted(
                {order_lock_id(schema, e.key) for e in events if e.key is not None}
            ),
        }
        statement = many_statements(self._outbox.config.schema).idempotency_keys_complete
        if self.staged_bytes <= _INLINE_LIMIT:
            tx.commit_with(statement, params)
        else:
            # Large values go as binary parameters rather than quoted literals.
            tx.commit_bound(statement, params)
        self.committed = True
        self.close()
        self._after(committed=True)

    def close(self) -> None:
        """Return the connection (rolling back whatever was not committed). Idempotent."""
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.close()
            if not self.committed:
                self._after(committed=False)

    def _after(self, committed: bool) -> None:
        cache = self._outbox.cache
        if cache is not None:
            cache.put_many(self.scope, self._warm + (self._outcomes if committed else []))
        self._warm = []
        if committed and self._events:
            self._outbox._notify()


class MessageBatch:
    """What a batch handler gets: messages with their units of work, all in one transaction.

    Iterating gives ``(uow, message)`` pairs in partition-offset order. ``connection`` and
    ``session`` belong to the first unit of work and serve bulk statements for all of them (the
    units of work share the transaction). Each ``uow`` publishes its own events and holds its
    own result.
    """

    def __init__(self, units: list[tuple[UnitOfWork, Any]]) -> None:
        if not units:
            raise ConfigurationError("a batch holds at least one message")
        self._units = units

    def __iter__(self) -> Iterator[tuple[UnitOfWork, Any]]:
        return iter(self._units)

    def __len__(self) -> int:
        return len(self._units)

    def __getitem__(self, index: int) -> tuple[UnitOfWork, Any]:
        return self._units[index]

    @property
    def messages(self) -> list[Any]:
        """The messages, in partition-offset order."""
        return [message for _, message in self._units]

    @property
    def connection(self) -> Connection:
        """The batch's connection, inside its transaction."""
        return self._units[0][0].connection

    @property
    def session(self) -> Session:
        """An ORM session in the batch's transaction (the first unit of work's)."""
        return self._units[0][0].session


class _BatchGroup:
    """Context manager returned by :meth:`Batch.units_of_work`."""

    __slots__ = ("_batch", "_keys", "_units")

    def __init__(self, batch: Batch, keys: list[tuple[str, str, str | None]]) -> None:
        self._batch = batch
        self._keys = keys
        self._units: list[BatchUnitOfWork] = []

    def __enter__(self) -> list[BatchUnitOfWork]:
        self._batch._make_room()
        for key, scope, fingerprint in self._keys:
            self._units.append(self._batch._begin(key, scope, fingerprint))
        return self._units

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        live = [u for u in self._units if not u.replayed]
        if live:
            self._batch._end(live, exc)
        return False


class _BatchAttempt(_BatchGroup):
    """Context manager returned by :meth:`Batch.unit_of_work`."""

    __slots__ = ()

    def __enter__(self) -> BatchUnitOfWork:  # type: ignore[override]
        return (super().__enter__())[0]


def _close(units: list[BatchUnitOfWork]) -> None:
    """Close the units' own sessions; the batch's transaction stays open."""
    for uow in units:
        uow.close()
