"""Autovacuum settings for the outbox and the idempotency keys.

The outbox is a queue: rows live for milliseconds, so the table's live size stays small while
every row sent leaves a dead tuple. PostgreSQL's default (vacuum once dead tuples pass 20 % of
the table's estimated rows) ties the trigger to a row estimate that swings between empty and a
burst; here VACUUM runs after a fixed 10,000 dead tuples. The cost limit stays the server's:
while a long transaction holds the horizon, each VACUUM finds the same dead tuples it may not
remove, and an unthrottled one would scan the whole table again every autovacuum_naptime. The
keys table is large and loses rows in batches (``outbox gc``): 2 % instead of 20 %.

Only storage parameters change: each ALTER takes a SHARE UPDATE EXCLUSIVE lock, which does not
conflict with reads, inserts, updates or deletes, so it runs while units of work and relays
run (it waits for a running VACUUM of the table, at most the migration's lock timeout).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import context, op
from sqlalchemy.sql.compiler import IdentifierPreparer

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OUTBOX = (
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000, "
    "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000"
)
OUTBOX_RESET = (
    "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
    "autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold"
)
KEYS = "autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000"
KEYS_RESET = "autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold"


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def _table(name: str) -> str:
    # The schema name passed the toolkit's identifier allow-list before it got here.
    quote = IdentifierPreparer(op.get_bind().dialect)
    schema = _schema()
    return (
        quote.quote(name) if schema is None else f"{quote.quote_schema(schema)}.{quote.quote(name)}"
    )


def upgrade() -> None:
    op.execute(f"ALTER TABLE {_table('outbox')} SET ({OUTBOX})")
    op.execute(f"ALTER TABLE {_table('idempotency_keys')} SET ({KEYS})")


def downgrade() -> None:
    op.execute(f"ALTER TABLE {_table('outbox')} RESET ({OUTBOX_RESET})")
    op.execute(f"ALTER TABLE {_table('idempotency_keys')} RESET ({KEYS_RESET})")
