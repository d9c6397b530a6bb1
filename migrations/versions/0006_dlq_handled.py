"""Handled dead letters: the ones an operator discarded or redrove, by their place in the topic.

Dead letters live in Kafka, which cannot forget one; this table remembers which ones need no
more attention, so that ``outbox dlq list`` and the console leave them out. A new, empty table:
creating it takes no lock any running statement waits for.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def upgrade() -> None:
    op.create_table(
        "outbox_dlq_handled",
        sa.Column("dlq_topic", sa.Text(), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column(
            "handled_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("how", sa.Text(), nullable=False),
        sa.Column("handled_by", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("dlq_topic", "partition", "offset", name="outbox_dlq_handled_pkey"),
        sa.CheckConstraint("how IN ('discarded', 'redriven')", name="outbox_dlq_handled_how_check"),
        schema=_schema(),
    )


def downgrade() -> None:
    op.drop_table("outbox_dlq_handled", schema=_schema())
