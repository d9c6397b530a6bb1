"""What the benchmark scripts share: the database they measure in.

Every benchmark runs in a database of its own, created and migrated at the start and dropped at
the end (also when the run fails), so that no run measures what an earlier one left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import sqlalchemy as sa


def database_argument(parser: argparse.ArgumentParser, database: str) -> None:
    """``--database-url``: the scratch database, named ``database`` unless
    ``OUTBOX_BENCH_DATABASE_URL`` or the argument says otherwise."""
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "OUTBOX_BENCH_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
        ),
        help="the database to create, measure in and drop (default: %(default)s)",
    )


@contextlib.contextmanager
def scratch_database(url: str, *ddl: str) -> Iterator[str]:
    """A fresh database at ``url`` (one left over by an interrupted run is dropped first),
    migrated, with the benchmark's own tables (``ddl``); dropped on the way out. Yields the URL
    with its password, for engines and child processes."""
    # Imported here: a benchmark's worker process may have to import ``outbox`` in its own way
    # (the tracing benchmark blocks opentelemetry first).
    from outbox import migrate

    db = sa.make_url(url)
    admin = sa.create_engine(db.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db.database}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{db.database}"'))
        try:
            url_s = db.render_as_string(hide_password=False)
            migrate.upgrade(url_s)
            if ddl:
                engine = sa.create_engine(url_s)
                with engine.begin() as conn:
                    for statement in ddl:
                        conn.execute(sa.text(statement))
                engine.dispose()
            yield url_s
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db.database}" WITH (FORCE)'))
    finally:
        admin.dispose()
