"""What every command shares: flags with their ``OUTBOX_*`` variables, exit codes, errors.

Every flag that an environment variable can set is declared once in :data:`FLAGS`. A command
adds the flags it takes with :func:`add_flags`; after parsing, :func:`resolve_flags` fills each
flag the command line left out from its variable (converted like the flag, with an error that
names the variable when it is malformed), then from its default. ``--help`` names the variable.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from outbox._core.redact import redact
from outbox.config import (
    ENV_CACHE_TTL,
    ENV_CONSUMER_GROUP,
    ENV_CONSUMER_METRICS_PORT,
    ENV_DATABASE_URL,
    ENV_GC_BATCH_SIZE,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG,
    ENV_LOG_LEVEL,
    ENV_MIN_REDELIVERY_WINDOW,
    ENV_REDIS_URL,
    ENV_RELAY_BATCH_SIZE,
    ENV_RELAY_LANES,
    ENV_RELAY_MAX_ATTEMPTS,
    ENV_RELAY_METRICS_PORT,
    ENV_RELAY_POLL_INTERVAL,
    ENV_RELAY_REBALANCE_INTERVAL,
    ENV_RETENTION,
    ENV_SCHEMA,
    env,
)
from outbox.errors import ConfigurationError, OutboxError

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

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    def help_text(self) -> str:
        notes = []
        if self.env:
            notes.append(f"env {self.env}")
        shown = self.default_text if self.default_text is not None else self.default
        if shown is not None:
            notes.append(f"default {shown}")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help


def _int(value: str) -> int:
    return int(value)


def _float(value: str) -> float:
    return float(value)


FLAGS: Mapping[str, Flag] = {
    flag.dest: flag
    for flag in (
        Flag(
            "--database-url",
            ENV_DATABASE_URL,
            "PostgreSQL URL, postgresql+psycopg://user:pass@host/db",
        ),
        Flag(
            "--schema",
            ENV_SCHEMA,
            "PostgreSQL schema of the outbox tables",
            default_text="public",
        ),
        Flag("--redis-url", ENV_REDIS_URL, "Redis URL for the duplicate fast path (optional)"),
        Flag(
            "--bootstrap-servers",
            ENV_KAFKA_BOOTSTRAP,
            "Kafka bootstrap servers, host:port[,host:port]",
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
        ),
        Flag(
            "--batch-size",
            ENV_RELAY_BATCH_SIZE,
            "rows claimed per batch",
            type=_int,
            kind="an integer",
        ),
        Flag(
            "--poll-interval",
            ENV_RELAY_POLL_INTERVAL,
            "seconds between polls when no wake-up arrives",
            type=_float,
            kind="a number",
        ),
        Flag(
            "--lanes",
            ENV_RELAY_LANES,
            "number of lanes; must be the same for every relay",
            type=_int,
            kind="an integer",
        ),
        Flag(
            "--max-attempts",
            ENV_RELAY_MAX_ATTEMPTS,
            "failed deliveries before a row is parked",
            type=_int,
            kind="an integer",
        ),
        Flag(
            "--rebalance-interval",
            ENV_RELAY_REBALANCE_INTERVAL,
            "seconds between lane rebalances",
            type=_float,
            kind="a number",
        ),
        Flag(
            "--metrics-port",
            ENV_RELAY_METRICS_PORT,
            "serve /metrics (Prometheus) and /healthz on this port",
            type=_int,
            kind="an integer",
            default_text="off",
        ),
        Flag(
            "--older-than",
            ENV_RETENTION,
            "delete keys last updated longer ago than this, e.g. 7d, 36h, 90m (required)",
            metavar="DURATION",
        ),
        Flag(
            "--cache-ttl",
            ENV_CACHE_TTL,
            "the applications' Redis cache TTL (OutboxConfig.cache_ttl); --older-than must "
            "be longer",
            metavar="DURATION",
        ),
        Flag(
            "--min-redelivery-window",
            ENV_MIN_REDELIVERY_WINDOW,
            "how late a broker may redeliver a message; --older-than must be at least this",
            metavar="DURATION",
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
)
GC_BATCH_SIZE = Flag(
    "--batch-size", ENV_GC_BATCH_SIZE, "keys deleted per transaction", type=_int, kind="an integer"
)

_RESOLVE = "_outbox_flags"
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
        f"{ENV_KAFKA_CONFIG} holds KEY=VALUE pairs separated by commas or newlines)",
    )
    parser.set_defaults(**{_KAFKA: True})


def resolve_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every declared flag left out on the command line from its variable or default."""
    for flag in getattr(args, _RESOLVE, None) or ():
        if getattr(args, flag.dest) is not None:
            continue
        raw = env(flag.env) if flag.env else None
        value = flag.default
        if raw is not None:
            try:
                value = flag.type(raw)
            except ValueError as exc:
                raise ConfigurationError(f"{flag.env}={raw!r} is not {flag.kind}") from exc
            if flag.choices is not None and value not in flag.choices:
                raise ConfigurationError(
                    f"{flag.env}={raw!r} is not one of {', '.join(flag.choices)}"
                )
        setattr(args, flag.dest, value)
    if getattr(args, _KAFKA, False) and isinstance(args.kafka_config, list):
        args.kafka_config = parse_kafka_config(args.kafka_config, env(ENV_KAFKA_CONFIG))
    return args


def parse_kafka_config(pairs: Sequence[str], env_value: str | None = None) -> dict[str, str]:
    """Parse ``KEY=VALUE`` pairs (flags win over the environment) into a librdkafka dict."""
    items: list[str] = []
    if env_value:
        items.extend(p for chunk in env_value.splitlines() for p in chunk.split(",") if p.strip())
    items.extend(pairs)
    config: dict[str, str] = {}
    for item in items:
        key, sep, value = item.strip().partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(
                f"invalid --kafka-config {item!r}: expected KEY=VALUE, e.g. acks=all"
            )
        config[key.strip()] = value.strip()
    return config


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


def run(prog: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command, turning errors into one clear, secret-free line on stderr and an exit
    code: :data:`EXIT_USAGE` for configuration errors, :data:`EXIT_FAILURE` otherwise."""

    def clean(text: str) -> str:
        urls = [getattr(args, "database_url", None), getattr(args, "redis_url", None)]
        secrets = getattr(args, "kafka_config", None)
        return redact(text, urls=urls, kafka_config=secrets if isinstance(secrets, dict) else None)

    try:
        resolve_flags(args)
        configure_logging(getattr(args, "log_level", None) or "INFO")
        return func(args)
    except ConfigurationError as exc:
        print(f"{prog}: error: {clean(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except OutboxError as exc:
        print(f"{prog}: error: {clean(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # driver errors: one line, password-free
        lines = str(exc).splitlines()
        message = clean(lines[0]) if lines else type(exc).__name__
        print(f"{prog}: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILURE
