"""The secret that signs the Redis cache's entries.

One row, created here with 32 random bytes from PostgreSQL's strong random source. Cache
entries carry a MAC keyed by this secret and bound to the database's identity, so a writer that
can reach Redis but not this table cannot forge an outcome, and a recreated or restored
database does not trust the entries of its predecessor.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _schema() -> str | None:
    schema: str | None = context.config.attributes.get("outbox_schema")
    return schema


def upgrade() -> None:
    schema = _schema()
    table = op.create_table(
        "outbox_cache_secret",
        sa.Column("id", sa.SmallInteger(), server_default=sa.text("1"), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name="outbox_cache_secret_pkey"),
        sa.CheckConstraint("id = 1", name="outbox_cache_secret_one_row"),
        schema=schema,
    )
    # gen_random_uuid() draws from pg_strong_random(): two of them give 244 random bits.
    op.execute(
        table.insert().from_select(
            ["id", "secret"],
            sa.select(
                sa.literal(1),
                sa.func.uuid_send(sa.func.gen_random_uuid()).op("||")(
                    sa.func.uuid_send(sa.func.gen_random_uuid())
                ),
            ),
        )
    )


def downgrade() -> None:
    op.drop_table("outbox_cache_secret", schema=_schema())
