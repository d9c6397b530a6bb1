"""The window relay: each outbox row records its transaction; lanes keep a snapshot cursor.

``outbox.txid`` is the writing transaction's id (``pg_current_xact_id()``, filled by the
column's default, so no writer changes). Adding a column without a default and then setting
the default only change the catalogue (a volatile default given with ADD COLUMN would rewrite
the table); rows written before have no txid and count as committed before any window. The
index lets a window read only the rows of the transactions that committed inside it. Both
statements take the outbox's lock for a moment, bounded by the migration's lock timeout (``outbox
migrate`` tries again after a backoff). The index is built while writers wait: the outbox is
small where the relay keeps up (build it ``CONCURRENTLY`` by hand beforehand on a large one, the
migration then finds it).

``outbox_relay_windows``: one row per lane, the snapshot up to which the lane's rows were
delivered, the window in progress and how far into it. ``outbox_relay_held``: the first row of
each key the window relay still owes (a failed or parked row; later rows of the key wait).
Both are new, empty tables.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.sql.compiler import IdentifierPreparer

revision: str = "0007"
down_revision: str | None = "0006"
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
    schema = _schema()
    outbox = _table("outbox")
    op.execute(f"ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS txid xid8")
    op.execute(f"ALTER TABLE {outbox} ALTER COLUMN txid SET DEFAULT pg_current_xact_id()")
    op.execute(f"CREATE INDEX IF NOT EXISTS ix_outbox_txid ON {outbox} (txid)")
    op.create_table(
        "outbox_relay_windows",
        sa.Column("lane", sa.Integer(), nullable=False),
        sa.Column("lanes", sa.Integer(), nullable=False),
        sa.Column("delivered", sa.Text(), nullable=True),
        sa.Column("opened", sa.Text(), nullable=True),
        sa.Column("done_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("high_id", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("lane", name="outbox_relay_windows_pkey"),
        schema=schema,
    )
    # Updated once per batch: room on the page keeps those updates HOT.
    op.execute(f"ALTER TABLE {_table('outbox_relay_windows')} SET (fillfactor = 50)")
    op.create_table(
        "outbox_relay_held",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("key_hash", sa.Integer(), nullable=False),
        sa.Column("key", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="outbox_relay_held_pkey"),
        schema=schema,
    )


def downgrade() -> None:
    schema = _schema()
    op.drop_table("outbox_relay_held", schema=schema)
    op.drop_table("outbox_relay_windows", schema=schema)
    op.execute(f"DROP INDEX IF EXISTS {_table('ix_outbox_txid')}")
    op.execute(f"ALTER TABLE {_table('outbox')} DROP COLUMN IF EXISTS txid")
