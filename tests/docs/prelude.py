"""The names every documentation page's code blocks start with (docs/writing-docs.md lists them).

A page's blocks run in order in one namespace, on a database of the page's own (migrated to head,
with the example tables below), the suite's Redis and broker: ``db_url``, ``redis_url`` and
``bootstrap_servers`` name them, and ``OUTBOX_DATABASE_URL``, ``OUTBOX_REDIS_URL`` and
``OUTBOX_KAFKA_BOOTSTRAP_SERVERS`` are set to the same values.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

STOCK_ROWS = [{"sku": "book", "n": 100}, {"sku": "pen", "n": 100}]


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
    total: Mapped[int] = mapped_column(default=0)


class Invoice(Base):
    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True, autoincrement=True)
    order_id: Mapped[int] = mapped_column(sa.BigInteger)
    total: Mapped[int] = mapped_column(default=0)


stock = sa.Table(
    "stock",
    Base.metadata,
    sa.Column("sku", sa.Text, primary_key=True),
    sa.Column("n", sa.Integer, nullable=False),
)


def create_tables(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        Base.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(stock.insert(), STOCK_ROWS)
    finally:
        engine.dispose()


def namespace(database_url: str, redis_url: str, bootstrap_servers: str | None) -> dict[str, Any]:
    from pydantic import BaseModel

    class OrderIn(BaseModel):
        id: int
        total: int
        sku: str = "book"

    return {
        "__name__": "__docs__",
        "db_url": database_url,
        "redis_url": redis_url,
        "bootstrap_servers": bootstrap_servers,
        "Base": Base,
        "Order": Order,
        "Invoice": Invoice,
        "OrderIn": OrderIn,
        "orders": Order.__table__,
        "stock": stock,
    }
