"""The window relay: an index on the outbox's keys, for the rows a held key owes.

A key the window relay holds (``outbox_relay_held``: a failed or parked row) owes its rows from
the held one on; the relay reads them before every batch of the key's lane (``HELD_OWED`` in
:mod:`outbox._pg.window`). ``(key_hash, id)`` finds them with a range scan per held key, where
the table (backlog and delivered rows not given back yet) was scanned whole at every batch. The
index is built while writers wait, as 0007's: the outbox is small where the relay keeps up
(build it ``CONCURRENTLY`` by hand beforehand on a large one, the migration then finds it).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import context, op
from sqlalchemy.sql.compiler import IdentifierPreparer

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def _table(name: str) -> str:
    quote = IdentifierPreparer(op.get_bind().dialect)
    schema = _schema()
    return quote.quote(name) if schema is None else f"{quote.quote(schema)}.{quote.quote(name)}"


def upgrade() -> None:
    op.execute(
        f"CREATE INDEX IF NOT EXISTS ix_outbox_key_hash ON {_table('outbox')} (key_hash, id)"
    )


def downgrade() -> None:
    op.execute(f"DROP INDEX IF EXISTS {_table('ix_outbox_key_hash')}")
