"""Tombstones: outbox.value may be NULL (a record with a null value, "delete this key").

Dropping a NOT NULL constraint only changes the catalogue: no table rewrite, no scan. It takes
an ACCESS EXCLUSIVE lock on the outbox for a moment, and while it waits for that lock every
writer queues behind it: the wait is bounded by the migration's lock timeout (``outbox
migrate`` tries again after a backoff, letting the writers through in between).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def upgrade() -> None:
    op.alter_column(
        "outbox", "value", existing_type=sa.LargeBinary(), nullable=True, schema=_schema()
    )


def downgrade() -> None:
    # A tombstone still waiting for the relay cannot be kept in a NOT NULL column, and turning
    # it into an empty value would make a compacted topic keep the key it was meant to delete.
    schema = _schema()
    outbox = sa.table("outbox", sa.column("value", sa.LargeBinary()), schema=schema)
    waiting = op.get_bind().execute(
        sa.select(sa.func.count()).select_from(outbox).where(outbox.c.value.is_(None))
    )
    if waiting.scalar_one():
        raise RuntimeError(
            "tombstones (rows with a NULL value) are waiting in the outbox: let the relay "
            "deliver them (or discard them) before downgrading below revision 0005"
        )
    op.alter_column(
        "outbox", "value", existing_type=sa.LargeBinary(), nullable=False, schema=schema
    )
