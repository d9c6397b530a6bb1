"""What every command shares: flags with their ``OUTBOX_*`` variables, exit codes, errors.

Invariant: every value -- from a flag, its variable or its default -- is checked by the core
before the command opens any connection; bad usage of any kind exits with :data:`EXIT_USAGE`
and one line on stderr, secrets redacted. Each flag is declared once, in :data:`FLAGS`, and
``--help`` names its variable.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from outbox._core import guard as _guard, settings as _settings, validate as _validate
from outbox._core.durations import parse_duration
from outbox._core.redact import HIDDEN, redact, redact_text
from outbox._core.urls import check_database_url, check_redis_url
from outbox.config import (
    ENV_CACHE_TTL,
    ENV_CONSUMER_GROUP,
    ENV_CONSUMER_METRICS_PORT,
    ENV_CONSUMER_TRACE_CONTEXT,
    ENV_DATABASE_URL,
    ENV_GC_BATCH_SIZE,
    ENV_GC_DUTY_CYCLE,
    ENV_GUARD_LEASE,
    ENV_GUARD_ON_REDIS_ERROR,
    ENV_GUARD_REDIS_URL,
    ENV_GUARD_SECRET,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG,
    ENV_LOG_LEVEL,
    ENV_METRICS_HOST,
    ENV_MIN_REDELIVERY_WINDOW,
    ENV_POOLER,
    ENV_REDIS_URL,
    ENV_RELAY_BATCH_SIZE,
    ENV_RELAY_ENGINE,
    ENV_RELAY_LANES,
    ENV_RELAY_MAX_ATTEMPTS,
    ENV_RELAY_METRICS_PORT,
    ENV_RELAY_POLL_INTERVAL,
    ENV_RELAY_REBALANCE_INTERVAL,
    ENV_RETENTION,
    ENV_SCHEMA,
    MAX_LANES,
    POOLERS,
    TRACE_CONTEXTS,
    env,
)
from outbox.errors import ConfigurationError, OutboxError, ValidationError
from outbox.schema import validate_schema_name

# Exit codes of every command, defined once.
EXIT_OK = 0
EXIT_FAILURE = 1  # a database, broker or other runtime error
EXIT_USAGE = 2  # bad flags or settings (argparse uses 2 as well)
EXIT_RETENTION_REFUSED = 3  # outbox gc: the retention is shorter than a duplicate can arrive


@dataclass(frozen=True)
class Flag:
    """A command-line flag that an ``OUTBOX_*`` environment variable may set instead."""

    option: str
    env: str | None
    help: str
    type: Callable[[str], Any] = str
    kind: str = "a value"  # for the error about a malformed variable: "an integer", ...
    default: Any = None
    default_text: str | None = None  # how --help shows the default, when not str(default)
    metavar: str | None = None
    choices: Sequence[str] | None = None
    # Checks a converted value before any I/O: check(name, value) raises ConfigurationError
    # (``name`` is the flag, or the variable the value came from).
    check: Callable[[str, Any], object] | None = None
    # The value may hold a password: --help points to the variable first (a flag shows in ps).
    secret: bool = False

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    def help_text(self) -> str:
        notes = []
        if self.env and self.secret:
            notes.append(f"env {self.env}, preferred: a flag's value shows in ps")
        elif self.env:
            notes.append(f"env {self.env}")
        shown = self.default_text if self.default_text is not None else self.default
        if shown is not None:
            notes.append(f"default {shown}")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help


SECRETS_EPILOG = (
    "Secrets: set OUTBOX_DATABASE_URL, OUTBOX_REDIS_URL and OUTBOX_KAFKA_CONFIG (e.g. "
    "sasl.password=...) in the environment rather than passing them as flags, whose values "
    "every local user can read with ps. A process given secrets as flags rewrites its title "
    "to hide them (with outbox-kit[proctitle] installed), but only once it has started."
)


class Parser(argparse.ArgumentParser):
    """``argparse`` with the toolkit's usage errors: one line, secrets redacted, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {redact_text(message)} (see --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _int(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_validate.shown(value)} is not an integer") from None


def _float(value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_validate.shown(value)} is not a number") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{_validate.shown(value)} is not a finite number")
    return number


def _ranged(low: int, high: int) -> Callable[[str, Any], object]:
    return lambda name, value: _settings.check_int(name, value, low, high)


def _seconds(name: str, value: Any) -> object:
    return _settings.check_seconds(name, value, _settings.MAX_TIMEOUT)


def _duration(name: str, value: Any) -> object:
    try:
        return parse_duration(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}: {exc}") from None


def _schema(name: str, value: Any) -> object:
    return validate_schema_name(value)


def _group(name: str, value: Any) -> object:
    _settings.check_text_setting(name, value, limit=255)
    try:
        return _validate.check_scope(value)
    except ValidationError as exc:
        raise ConfigurationError(f"{name}: {exc}") from None


FLAGS: Mapping[str, Flag] = {
    flag.dest: flag
    for flag in (
        Flag(
            "--database-url",
            ENV_DATABASE_URL,
            "PostgreSQL URL, postgresql+psycopg://user:pass@host/db",
            check=lambda _name, value: check_database_url(value),
            secret=True,
        ),
        Flag(
            "--schema",
            ENV_SCHEMA,
            "PostgreSQL schema of the outbox tables",
            default_text="public",
            check=_schema,
        ),
        Flag(
            "--pooler",
            ENV_POOLER,
            "what stands between the units of work and PostgreSQL: transaction (a pooler such "
            "as PgBouncer in transaction mode: nothing relies on the session) or session",
            default_text="none (a direct connection)",
            choices=POOLERS,
        ),
        Flag(
            "--redis-url",
            ENV_REDIS_URL,
            "Redis URL for the duplicate fast path (optional)",
            check=lambda _name, value: check_redis_url(value),
            secret=True,
        ),
        Flag(
            "--guard-redis-url",
            ENV_GUARD_REDIS_URL,
            "Redis URL of the idempotency guard: run HANDLER as handler(claim, message) under a "
            "Redis claim of each key instead of a unit of work (no PostgreSQL)",
            check=lambda _name, value: check_redis_url(value),
            secret=True,
        ),
        Flag(
            "--guard-lease",
            ENV_GUARD_LEASE,
            "seconds a guard claim holds its key; a crashed consumer's key is taken over after it",
            type=_float,
            kind="a number",
            default_text=f"{_guard.DEFAULT_LEASE:g}",
            check=_guard.check_lease,
        ),
        Flag(
            "--guard-secret",
            ENV_GUARD_SECRET,
            "signs the guard's completed and failed records, so that a Redis writer cannot forge "
            "an outcome (at least 16 bytes; the same in every process sharing the guard)",
            secret=True,
        ),
        Flag(
            "--guard-on-redis-error",
            ENV_GUARD_ON_REDIS_ERROR,
            "when the guard's Redis cannot answer: closed (retry the message later) or open (run "
            "the handler unguarded; it may run twice)",
            choices=_guard.POLICIES,
            default_text="closed",
            check=_guard.check_policy,
        ),
        Flag(
            "--bootstrap-servers",
            ENV_KAFKA_BOOTSTRAP,
            "Kafka bootstrap servers, host:port[,host:port]",
            check=lambda name, value: _settings.check_bootstrap_servers(value, name),
        ),
        Flag(
            "--log-level",
            ENV_LOG_LEVEL,
            "log level",
            type=str.upper,
            default="INFO",
            choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        ),
        Flag(
            "--group",
            ENV_CONSUMER_GROUP,
            "Kafka consumer group, also the idempotency scope",
            check=_group,
        ),
        Flag(
            "--batch-size",
            ENV_RELAY_BATCH_SIZE,
            "rows claimed per batch",
            type=_int,
            kind="an integer",
            check=_ranged(1, 100_000),
        ),
        Flag(
            "--poll-interval",
            ENV_RELAY_POLL_INTERVAL,
            "seconds between polls when no wake-up arrives",
            type=_float,
            kind="a number",
            check=_seconds,
        ),
        Flag(
            "--lanes",
            ENV_RELAY_LANES,
            "number of lanes; must be the same for every relay",
            type=_int,
            kind="an integer",
            check=_ranged(1, MAX_LANES),
        ),
        Flag(
            "--max-attempts",
            ENV_RELAY_MAX_ATTEMPTS,
            "failed deliveries before a row is parked",
            type=_int,
            kind="an integer",
            check=_ranged(1, 1_000_000),
        ),
        Flag(
            "--engine",
            ENV_RELAY_ENGINE,
            "where batches come from: claim (row locks, a DELETE per row) or window (snapshot "
            "windows, no row lock, no per-row DELETE); docs/relay.md",
            default="claim",
            choices=("claim", "window"),
        ),
        Flag(
            "--rebalance-interval",
            ENV_RELAY_REBALANCE_INTERVAL,
            "seconds between lane rebalances",
            type=_float,
            kind="a number",
            check=_seconds,
        ),
        Flag(
            "--metrics-port",
            ENV_RELAY_METRICS_PORT,
            "serve /metrics (Prometheus) and /healthz on this port",
            type=_int,
            kind="an integer",
            default_text="off",
            check=_ranged(0, _settings.MAX_PORT),
        ),
        Flag(
            "--metrics-host",
            ENV_METRICS_HOST,
            "the address /metrics and /healthz listen on; 0.0.0.0 (or ::) in a container "
            "probed from outside",
            default="127.0.0.1",
            check=_settings.check_host,
        ),
        Flag(
            "--trace-context",
            ENV_CONSUMER_TRACE_CONTEXT,
            "a message's trace context is its process span's parent, or a link of a new "
            "trace (OpenTelemetry)",
            default="parent",
            choices=TRACE_CONTEXTS,
        ),
        Flag(
            "--older-than",
            ENV_RETENTION,
            "delete keys last updated longer ago than this, e.g. 7d, 36h, 90m (required)",
            metavar="DURATION",
            check=_duration,
        ),
        Flag(
            "--cache-ttl",
            ENV_CACHE_TTL,
            "the applications' Redis cache TTL (OutboxConfig.cache_ttl); --older-than must "
            "be longer",
            metavar="DURATION",
            check=_duration,
        ),
        Flag(
            "--min-redelivery-window",
            ENV_MIN_REDELIVERY_WINDOW,
            "how late a broker may redeliver a message; --older-than must be at least this",
            metavar="DURATION",
            check=_duration,
        ),
    )
}

# Flags whose variable differs by command: the command passes its own Flag.
CONSUMER_METRICS_PORT = Flag(
    "--metrics-port",
    ENV_CONSUMER_METRICS_PORT,
    "serve /metrics (Prometheus) and /healthz on this port",
    type=_int,
    kind="an integer",
    default_text="off",
    check=_ranged(0, _settings.MAX_PORT),
)
GC_BATCH_SIZE = Flag(
    "--batch-size",
    ENV_GC_BATCH_SIZE,
    "keys deleted per transaction",
    type=_int,
    kind="an integer",
    check=None,  # the range is the gc command's (admin.MAX_GC_BATCH_SIZE)
)

GC_DUTY_CYCLE = Flag(
    "--duty-cycle",
    ENV_GC_DUTY_CYCLE,
    "share of the time gc works: after each batch it pauses so that its batches take at most "
    "this share of the run (0 < F <= 1), leaving the rest of the database's CPU to live units "
    "of work",
    type=_float,
    kind="a number",
    metavar="F",
    check=None,  # the range is the gc command's (admin.check_duty_cycle)
)

# For flags a command declares itself (add_argument): the same converters and checks.
integer = _int
number = _float
ranged = _ranged

_RESOLVE = "_outbox_flags"
_RESOLVED = "_outbox_flags_resolved"
_KAFKA = "_outbox_kafka_config"


def add_flags(parser: argparse.ArgumentParser, *flags: str | Flag, **overrides: Any) -> None:
    """Add ``flags`` (names in :data:`FLAGS`, or :class:`Flag` objects) to ``parser``.

    ``overrides`` maps a flag's dest to a replacement :class:`Flag` field dict, e.g.
    ``default=5`` or ``help=...`` for one command.
    """
    declared: list[Flag] = list(parser.get_default(_RESOLVE) or [])
    for item in flags:
        flag = FLAGS[item] if isinstance(item, str) else item
        changes = overrides.get(flag.dest)
        if changes:
            flag = Flag(**{**flag.__dict__, **changes})
        parser.add_argument(
            flag.option,
            dest=flag.dest,
            type=flag.type,
            default=None,
            metavar=flag.metavar,
            choices=flag.choices,
            help=flag.help_text(),
        )
        declared.append(flag)
    parser.set_defaults(**{_RESOLVE: declared})


def add_kafka_config(parser: argparse.ArgumentParser) -> None:
    """``--kafka-config KEY=VALUE`` (repeatable), merged over ``OUTBOX_KAFKA_CONFIG``."""
    parser.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any librdkafka property, e.g. security.protocol=SASL_SSL (repeatable; env "
        f"{ENV_KAFKA_CONFIG} holds KEY=VALUE pairs separated by commas or newlines: put "
        "secrets such as sasl.password there, a flag's value shows in ps)",
    )
    parser.set_defaults(**{_KAFKA: True})


def resolve_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every declared flag left out on the command line from its variable or default,
    then check every value (from the command line, a variable or a default) before any I/O."""
    if getattr(args, _RESOLVED, False):
        return args
    for flag in getattr(args, _RESOLVE, None) or ():
        name = flag.option
        if getattr(args, flag.dest) is None:
            raw = env(flag.env) if flag.env else None
            value = flag.default
            if raw is not None:
                name = flag.env or flag.option
                try:
                    value = flag.type(raw)
                except (ValueError, argparse.ArgumentTypeError):
                    shown = "(hidden)" if flag.dest.endswith("_url") else _validate.shown(raw)
                    raise ConfigurationError(f"{flag.env}={shown} is not {flag.kind}") from None
                if flag.choices is not None and value not in flag.choices:
                    raise ConfigurationError(
                        f"{flag.env}={_validate.shown(raw)} is not one of {', '.join(flag.choices)}"
                    )
            setattr(args, flag.dest, value)
        value = getattr(args, flag.dest)
        if value is not None and flag.check is not None:
            flag.check(name, value)
    if getattr(args, _KAFKA, False) and isinstance(args.kafka_config, list):
        args.kafka_config = parse_kafka_config(args.kafka_config, env(ENV_KAFKA_CONFIG))
    setattr(args, _RESOLVED, True)
    return args


def parse_kafka_config(pairs: Sequence[str], env_value: str | None = None) -> dict[str, str]:
    """Parse ``KEY=VALUE`` pairs (flags win over the environment) into a librdkafka dict.

    A malformed pair is refused without being quoted: it may be a secret typed without its
    name. Names and values are checked like every Kafka setting
    (:func:`outbox._core.settings.check_kafka_config`).
    """
    items: list[tuple[str, str]] = []
    if env_value:
        items.extend(
            (ENV_KAFKA_CONFIG, p)
            for chunk in env_value.splitlines()
            for p in chunk.split(",")
            if p.strip()
        )
    items.extend(("--kafka-config", p) for p in pairs)
    config: dict[str, str] = {}
    for number, (source, item) in enumerate(items, 1):
        key, sep, value = item.strip().partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigurationError(
                f"invalid {source} entry #{number} (not shown): expected KEY=VALUE with both "
                "parts, e.g. acks=all"
            )
        config[key.strip()] = value.strip()
    return _settings.check_kafka_config(config, "--kafka-config")


def require(args: argparse.Namespace, dest: str) -> str:
    """The value of a required flag, or a usage error naming the flag and its variable."""
    value: str | None = getattr(args, dest, None)
    if not value:
        flag = FLAGS.get(dest)
        option = flag.option if flag else "--" + dest.replace("_", "-")
        hint = f" (or set {flag.env})" if flag and flag.env else ""
        raise ConfigurationError(f"{option} is required{hint}")
    return value


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if level != "DEBUG":
        # alembic narrates every plugin it loads at INFO; keep commands' output to the point.
        logging.getLogger("alembic").setLevel(logging.WARNING)


def tune_collector() -> None:
    """Garbage-collector settings of a process that turns thousands of rows or messages a batch
    into short-lived objects (``outbox-relay``, ``outbox consume``), called once its set-up is
    done; never by the library, whose host process keeps its own collector settings.

    With the default thresholds the collector runs every few hundred allocations and now and
    then walks every object of the process (SQLAlchemy, psycopg, confluent-kafka): measured as
    most of the relay's per-row Python time (the relay's claim, records and delete without
    Kafka, 100,000 rows: 236,000-287,000 rows/s with the defaults, 403,000-409,000 with these).
    What exists now lives as long as the process, so it is frozen out of every collection;
    young objects are collected after 50,000 allocations instead of 700.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


# Flags whose whole value is a secret (not a URL or a KEY=VALUE pair that redact_text reads).
_HIDDEN_WHOLE = frozenset({"--guard-secret", "--admin-token"})


def hide_secret_arguments(argv: Sequence[str] | None = None) -> bool | None:
    """Rewrite the process title when the command line carries a secret (a password in a URL,
    a secret ``--kafka-config`` value), so that ``ps`` and ``/proc/<pid>/cmdline`` show it
    redacted to other local users.

    ``argv`` defaults to the process's own ``sys.argv``. Returns ``False`` when there was
    nothing to hide, ``True`` once hidden, ``None`` when a secret is there but the optional
    ``setproctitle`` package (``pip install 'outbox-kit[proctitle]'``) is missing. The secret
    stays readable until this runs, and in the shell's history: the ``OUTBOX_*`` variables
    are the way to pass secrets.
    """
    given = list(sys.argv if argv is None else argv)
    shown = [redact_text(argument) for argument in given]
    for position, argument in enumerate(given):
        option, equals, _ = argument.partition("=")
        if option in _HIDDEN_WHOLE:
            if equals:
                shown[position] = f"{option}={HIDDEN}"
            elif position + 1 < len(given):
                shown[position + 1] = HIDDEN
    if shown == given:
        return False
    try:
        import setproctitle
    except ImportError:
        return None
    setproctitle.setproctitle(" ".join(shown))
    return True


def run(prog: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command, turning errors into one clear, secret-free line on stderr and an exit
    code: :data:`EXIT_USAGE` for configuration errors and refused input, :data:`EXIT_FAILURE`
    otherwise."""

    def clean(text: str) -> str:
        urls = [
            getattr(args, "database_url", None),
            getattr(args, "redis_url", None),
            getattr(args, "guard_redis_url", None),
        ]
        secrets = getattr(args, "kafka_config", None)
        text = redact(text, urls=urls, kafka_config=secrets if isinstance(secrets, dict) else None)
        lines = redact_text(text).splitlines()
        return lines[0] if lines else ""

    hidden = hide_secret_arguments()
    try:
        resolve_flags(args)
        configure_logging(getattr(args, "log_level", None) or "INFO")
        if hidden is None:
            logging.getLogger("outbox").warning(
                "the command line carries a secret that other local users can read (ps); pass "
                "it in an OUTBOX_* variable instead, or install outbox-kit[proctitle] to hide "
                "it from the process title"
            )
        return func(args)
    except (ConfigurationError, ValidationError) as exc:
        print(f"{prog}: error: {clean(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except OutboxError as exc:
        print(f"{prog}: error: {clean(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # driver errors: one line, password-free
        message = clean(str(exc)) or type(exc).__name__
        print(f"{prog}: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILURE
