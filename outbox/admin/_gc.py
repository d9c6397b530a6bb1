"""Deleting old idempotency keys (``outbox gc``) without blocking live units of work.

Invariant: a retention that would let a duplicate run twice is refused before anything is
deleted (:func:`~outbox._core.durations.check_retention`); deletes go in short batches that skip
rows another transaction has locked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox._core.durations import DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS, check_retention
from outbox._pg import operations as ops
from outbox.admin._status import JSON_FORMAT_VERSION
from outbox.config import DEFAULT_CACHE_TTL_SECONDS
from outbox.errors import ConfigurationError
from outbox.schema import validate_schema_name

DEFAULT_GC_BATCH_SIZE = 5000
MAX_GC_BATCH_SIZE = 100_000


@dataclass(frozen=True)
class GcResult:
    cutoff: datetime
    candidates: int
    deleted: int
    batches: int
    seconds: float
    dry_run: bool


def gc_cutoff(connection: sa.Connection, older_than: float) -> datetime:
    """The database's ``now() - older_than`` (the database clock decides, like ``updated_at``)."""
    return ops.idempotency_keys_gc_cutoff(connection, older_than)


def count_expired_keys(
    connection: sa.Connection, cutoff: datetime, schema: str | None = None, scope: str | None = None
) -> int:
    """Idempotency keys last updated before ``cutoff``."""
    return ops.idempotency_keys_count_expired(
        connection, cutoff, validate_schema_name(schema), scope
    )


def check_gc_batch_size(batch_size: int) -> int:
    if not 1 <= batch_size <= MAX_GC_BATCH_SIZE:
        raise ConfigurationError(
            f"--batch-size must be between 1 and {MAX_GC_BATCH_SIZE}, got {batch_size}"
        )
    return batch_size


def check_duty_cycle(duty_cycle: float) -> float:
    if not (
        isinstance(duty_cycle, (int, float))
        and not isinstance(duty_cycle, bool)
        and 0.0 < duty_cycle <= 1.0
    ):
        raise ConfigurationError(
            f"--duty-cycle must be a number above 0 and at most 1 (the share of the time gc "
            f"works, e.g. 0.25), got {duty_cycle!r}"
        )
    return float(duty_cycle)


def delete_expired_keys(
    engine: sa.Engine,
    cutoff: datetime,
    *,
    schema: str | None = None,
    scope: str | None = None,
    batch_size: int = DEFAULT_GC_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    max_batches: int | None = None,
    duty_cycle: float = 1.0,
) -> tuple[int, int]:
    """Delete keys last updated before ``cutoff``, ``batch_size`` rows per transaction.

    Stops when a batch deletes fewer than ``batch_size`` rows (rows locked by live transactions
    are skipped, not waited for; a later run gets them). ``progress(deleted_so_far, batch)`` is
    called after each committed batch. Below a ``duty_cycle`` of 1, it pauses after each batch
    so that batches take that share of the time (on a busy database, gc's deletes otherwise
    take their full share of its CPU from live units of work). Returns ``(deleted, batches)``.
    """
    check_gc_batch_size(batch_size)
    pause = 1.0 / check_duty_cycle(duty_cycle) - 1.0
    schema = validate_schema_name(schema)
    deleted = batches = 0
    after = None  # each batch starts where the previous one ended
    while max_batches is None or batches < max_batches:
        started = time.monotonic()
        n, last = ops.idempotency_keys_delete_expired_batch(
            engine, cutoff, schema, scope, batch_size, after
        )
        took = time.monotonic() - started
        after = last or after
        batches += 1
        deleted += n
        if progress is not None:
            progress(deleted, n)
        if n < batch_size:
            break
        if pause:
            time.sleep(took * pause)
    return deleted, batches


def run_gc(
    engine: sa.Engine,
    older_than: float,
    *,
    cache_ttl: float = DEFAULT_CACHE_TTL_SECONDS,
    min_redelivery_window: float = DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    schema: str | None = None,
    scope: str | None = None,
    batch_size: int = DEFAULT_GC_BATCH_SIZE,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
    duty_cycle: float = 1.0,
) -> GcResult:
    """Check the retention, count the expired keys, then (unless ``dry_run``) delete them.

    ``progress(deleted_so_far, candidates)`` is called after each committed batch;
    ``duty_cycle`` as for :func:`delete_expired_keys`.
    """
    check_retention(older_than, cache_ttl, min_redelivery_window)
    check_duty_cycle(duty_cycle)
    started = time.monotonic()
    with engine.connect() as conn:
        cutoff = gc_cutoff(conn, older_than)
        candidates = count_expired_keys(conn, cutoff, schema, scope)
    if dry_run or candidates == 0:
        return GcResult(cutoff, candidates, 0, 0, time.monotonic() - started, dry_run)
    report = progress
    deleted, batches = delete_expired_keys(
        engine,
        cutoff,
        schema=schema,
        scope=scope,
        batch_size=batch_size,
        progress=(lambda done, _batch: report(done, candidates)) if report is not None else None,
        duty_cycle=duty_cycle,
    )
    return GcResult(cutoff, candidates, deleted, batches, time.monotonic() - started, dry_run)


def gc_to_json(result: GcResult, older_than: float) -> Mapping[str, Any]:
    """The ``outbox gc --json`` document (format version 1)."""
    return {
        "version": JSON_FORMAT_VERSION,
        "older_than_seconds": older_than,
        "cutoff": result.cutoff.isoformat(),
        "dry_run": result.dry_run,
        "candidates": result.candidates,
        "deleted": result.deleted,
        "batches": result.batches,
        "seconds": round(result.seconds, 3),
    }
