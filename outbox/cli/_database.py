"""The short-lived engine every operator command opens (no pool: one command, one session)."""

from __future__ import annotations

import argparse

import sqlalchemy as sa

from outbox.cli._common import require
from outbox.config import normalize_database_url


def command_engine(args: argparse.Namespace, application_name: str | None = None) -> sa.Engine:
    """An engine on ``--database-url`` for one command, named in ``pg_stat_activity``."""
    url = normalize_database_url(require(args, "database_url"))
    connect_args: dict[str, object] = {"connect_timeout": 10}
    if application_name is not None:
        connect_args["application_name"] = application_name
    return sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args)
