"""``outbox gc``: delete idempotency keys older than the retention, with a progress display."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import IO, Any

from outbox import admin
from outbox._core.durations import format_duration, parse_duration
from outbox._core.validate import check_scope
from outbox.cli._common import (
    EXIT_OK,
    EXIT_RETENTION_REFUSED,
    FLAGS,
    GC_BATCH_SIZE,
    GC_DUTY_CYCLE,
    add_flags,
    ranged,
)
from outbox.cli._database import command_engine
from outbox.config import DEFAULT_CACHE_TTL_SECONDS
from outbox.errors import ConfigurationError, RetentionError
from outbox.schema import validate_schema_name


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "gc",
        help="delete idempotency keys older than the retention, in small batches",
        description="Delete idempotency keys whose updated_at is older than --older-than, "
        "in short batches that skip locked rows (live units of work never wait). Exit codes: "
        f"0 done, 1 database error, 2 bad usage, {EXIT_RETENTION_REFUSED} retention refused "
        "(shorter than the cache TTL or the minimum redelivery window).",
    )
    add_flags(
        p,
        "database_url",
        "schema",
        "log_level",
        "older_than",
        "cache_ttl",
        "min_redelivery_window",
        GC_BATCH_SIZE,
        GC_DUTY_CYCLE,
        cache_ttl={"default_text": format_duration(DEFAULT_CACHE_TTL_SECONDS)},
        min_redelivery_window={
            "default_text": format_duration(admin.DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS)
            + ", Kafka's default retention"
        },
        batch_size={
            "default_text": str(admin.DEFAULT_GC_BATCH_SIZE),
            "check": ranged(1, admin.MAX_GC_BATCH_SIZE),
        },
        duty_cycle={"default_text": "1, no pauses", "check": _duty_cycle},
    )
    p.add_argument("--scope", default=None, help="only keys of this scope (default: all)")
    p.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress)")
    p.set_defaults(func=command)


def _duty_cycle(name: str, value: float) -> None:
    try:
        admin.check_duty_cycle(value)
    except ConfigurationError as exc:
        raise ConfigurationError(str(exc).replace("--duty-cycle", name, 1)) from None


def _duration(args: argparse.Namespace, dest: str, default: float | None) -> float:
    value: str | None = getattr(args, dest)
    flag = FLAGS[dest]
    if value is None:
        if default is None:
            raise ConfigurationError(
                f"{flag.option} is required (or set {flag.env}), e.g. {flag.option} 7d"
            )
        return default
    try:
        return parse_duration(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{flag.option}: {exc}") from exc


def command(args: argparse.Namespace) -> int:
    older_than = _duration(args, "older_than", None)
    cache_ttl = _duration(args, "cache_ttl", DEFAULT_CACHE_TTL_SECONDS)
    window = _duration(args, "min_redelivery_window", admin.DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS)
    if args.scope is not None:
        check_scope(args.scope)
    batch_size = admin.check_gc_batch_size(
        args.batch_size if args.batch_size is not None else admin.DEFAULT_GC_BATCH_SIZE
    )
    duty_cycle = admin.check_duty_cycle(args.duty_cycle if args.duty_cycle is not None else 1.0)
    try:
        admin.check_retention(older_than, cache_ttl, window)
    except RetentionError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return EXIT_RETENTION_REFUSED
    engine = command_engine(args, "outbox gc")
    bar: Progress | None = None

    def progress(deleted: int, candidates: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(candidates, sys.stderr)
        bar.update(deleted)

    try:
        result = admin.run_gc(
            engine,
            older_than,
            cache_ttl=cache_ttl,
            min_redelivery_window=window,
            schema=validate_schema_name(args.schema),
            scope=args.scope,
            batch_size=batch_size,
            dry_run=args.dry_run,
            progress=None if args.json else progress,
            duty_cycle=duty_cycle,
        )
    finally:
        engine.dispose()
    if bar is not None:
        bar.finish(result.deleted)
    if args.json:
        print(json.dumps(admin.gc_to_json(result, older_than), indent=2))
    elif result.dry_run:
        print(
            f"dry run: {result.candidates:,} idempotency keys last updated before "
            f"{result.cutoff.isoformat(timespec='seconds')} would be deleted"
        )
    else:
        print(
            f"deleted {result.deleted:,} idempotency keys last updated before "
            f"{result.cutoff.isoformat(timespec='seconds')} in {result.batches} batches "
            f"({result.seconds:.1f}s)"
        )
    return EXIT_OK


class Progress:
    """A progress bar on a terminal, plain lines (at most one a second) otherwise."""

    def __init__(self, total: int, stream: IO[str], tty: bool | None = None, width: int = 30):
        self.total = total
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.width = width
        self.started = time.monotonic()
        self._last_line = 0.0

    def line(self, done: int) -> str:
        """The text shown for ``done`` of :attr:`total` (pure; tested)."""
        total = max(self.total, done)
        fraction = done / total if total else 1.0
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = done / elapsed
        if self.tty:
            filled = round(fraction * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            return f"[{bar}] {fraction:4.0%}  {done:,}/{total:,} keys  {rate:,.0f}/s"
        return f"gc: deleted {done:,} of {total:,} keys ({fraction:.0%}, {rate:,.0f}/s)"

    def update(self, done: int, _batch: int = 0) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done))
            self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last_line >= 1.0:
            self._last_line = now
            print(self.line(done), file=self.stream, flush=True)

    def finish(self, done: int) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(done) + "\n")
        else:
            print(self.line(done), file=self.stream)
        self.stream.flush()
