"""The flags of a relay serving many databases (docs/relay.md, "Many databases"), which
``outbox status`` takes too: here, apart from the relay's command, so that reading them loads no
Kafka client."""

from __future__ import annotations

import argparse

from outbox._core.environment import (
    ENV_RELAY_DATABASES_FILE,
    ENV_RELAY_DISCOVER_PATTERN,
    ENV_RELAY_DISCOVER_URL,
    ENV_RELAY_MEMBER_ID,
    ENV_RELAY_MEMBERSHIP_URL,
    ENV_RELAY_REFRESH_INTERVAL,
)
from outbox._core.settings import MAX_TIMEOUT, check_seconds
from outbox._core.urls import check_database_url
from outbox.cli._common import Flag


def _url(name: str, value: str) -> object:
    return check_database_url(value)


def _refresh(name: str, value: float) -> object:
    return check_seconds(name, value, MAX_TIMEOUT)


def _number(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("not a number") from None


FLEET_FLAGS = (
    Flag(
        "--databases-file",
        ENV_RELAY_DATABASES_FILE,
        "a file of PostgreSQL URLs to serve, one per line (# comments), read again every "
        "--refresh-interval: lines added or removed start or stop their relay",
        metavar="PATH",
    ),
    Flag(
        "--discover-url",
        ENV_RELAY_DISCOVER_URL,
        "a PostgreSQL URL whose server's databases named like --discover-pattern are served "
        "(each through this URL with its database name replaced), looked up again every "
        "--refresh-interval",
        check=_url,
        secret=True,
        metavar="URL",
    ),
    Flag(
        "--discover-pattern",
        ENV_RELAY_DISCOVER_PATTERN,
        "SQL LIKE pattern of the database names --discover-url serves, e.g. 'tenant_%%'",
        metavar="LIKE",
    ),
    Flag(
        "--refresh-interval",
        ENV_RELAY_REFRESH_INTERVAL,
        "seconds between two readings of --databases-file and --discover-url",
        type=_number,
        kind="a number",
        default=10.0,
        default_text="10",
        check=_refresh,
    ),
    Flag(
        "--member-id",
        ENV_RELAY_MEMBER_ID,
        "this process's name among the relay processes sharing the databases; keep it stable "
        "across restarts (a restarted member gets its databases back)",
        default_text="the host name",
    ),
    Flag(
        "--membership-url",
        ENV_RELAY_MEMBERSHIP_URL,
        "the database whose locks show which relay processes are alive (every process must "
        "reach it)",
        default_text="--discover-url, else the first --database-url",
        check=_url,
        secret=True,
        metavar="URL",
    ),
)
