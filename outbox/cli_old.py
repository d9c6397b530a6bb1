"""The ``outbox`` command: ``migrate``, ``parked``, ``consume``, ``status``, ``gc``.

Shared flag helpers live here too, so every command reads the same ``OUTBOX_*`` environment
variables and shows them in ``--help``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from outbox.config import (
    ENV_DATABASE_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_SCHEMA,
    env,
    redact_url,
)
from outbox.errors import ConfigurationError, OutboxError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def add_database_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=env(ENV_DATABASE_URL),
        help=f"PostgreSQL URL, postgresql+psycopg://user:pass@host/db (env {ENV_DATABASE_URL})",
    )
    parser.add_argument(
        "--schema",
        default=env(ENV_SCHEMA),
        help=f"PostgreSQL schema of the outbox tables (env {ENV_SCHEMA}; default: public)",
    )


def add_kafka(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap-servers",
        default=env(ENV_KAFKA_BOOTSTRAP),
        help=f"Kafka bootstrap servers, host:port[,host:port] (env {ENV_KAFKA_BOOTSTRAP})",
    )
    parser.add_argument(
        "--kafka-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any librdkafka property, e.g. security.protocol=SASL_SSL (repeatable; env "
        "OUTBOX_KAFKA_CONFIG holds KEY=VALUE pairs separated by commas or newlines)",
    )


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=env("OUTBOX_LOG_LEVEL") or "INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="log level (env OUTBOX_LOG_LEVEL; default INFO)",
    )


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


def require(value: str | None, flag: str, env_name: str) -> str:
    if not value:
        raise ConfigurationError(f"{flag} is required (or set {env_name})")
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


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command, turning toolkit errors into one clear line on stderr (no traceback)."""
    try:
        return func(args)
    except ConfigurationError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OutboxError as exc:
        print(f"outbox: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # driver errors: one line, password-free
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        url = getattr(args, "database_url", None)
        if url:
            message = message.replace(url, redact_url(url))
        print(f"outbox: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_FAILURE
