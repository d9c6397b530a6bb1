"""Index for the relay: parked rows, which block later rows of their key.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def upgrade() -> None:
    schema = _schema()
    # Parked rows are few; this small partial index lets every claim skip keys blocked by one
    # with a probe per claimed row that costs next to nothing while nothing is parked.
    op.create_index(
        "ix_outbox_parked",
        "outbox",
        ["key_hash", "id"],
        schema=schema,
        postgresql_where=sa.text("parked_at IS NOT NULL"),
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_index("ix_outbox_parked", table_name="outbox", schema=schema)
