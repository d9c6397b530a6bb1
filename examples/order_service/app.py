"""The order service of the example: handlers for `outbox consume`.

* ``accept_order`` (group ``order-service``, topic ``order.requests``) writes an order row and
  publishes ``order.accepted`` through the outbox -- in one transaction with the idempotency key.
  Its work is :func:`place_order`, which the HTTP door (``api.py``, ``POST /orders`` with an
  ``Idempotency-Key``) runs too: two doors, one unit of work.
  ``accept_order_async`` is the same handler for asyncio services: `outbox consume` runs a
  coroutine handler on the asyncio runner. Both may serve the same group side by side.
* ``ship_order`` (group ``shipping``, topic ``order.accepted``) reacts to that event by writing a
  shipment row. The relay sets each event's ``X-Idempotency-Key`` to its event id, so a re-sent
  event is absorbed here too.

Run them with ``outbox consume app:accept_order ...`` from this directory (see README.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import AsyncUnitOfWork, PermanentError, UnitOfWork


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "example_orders"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(sa.Text)  # deliberately not unique: see README
    customer: Mapped[str] = mapped_column(sa.Text)
    amount_cents: Mapped[int]


class Shipment(Base):
    __tablename__ = "example_shipments"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    order_id: Mapped[int]


def topic(name: str) -> str:
    """``name`` plus the suffix in ``ORDER_TOPIC_SUFFIX`` (empty by default).

    With a suffix per run, several runs of the example share one Kafka cluster without reading
    each other's messages; ``demo.py --topic-suffix`` sets it for every process it starts.
    """
    return name + os.environ.get("ORDER_TOPIC_SUFFIX", "")


def create_tables(engine: sa.Engine) -> None:
    """Create the example's business tables (the outbox tables come from `outbox migrate`)."""
    Base.metadata.create_all(engine)


class InvalidOrder(PermanentError):
    """An order request that no retry can fix."""


def place_order(uow: UnitOfWork, customer: str, amount_cents: int) -> dict[str, int]:
    """The order service's unit of work, whichever door the request came in by: one order row
    and one ``order.accepted`` event, committed with the request's idempotency key."""
    if amount_cents <= 0:
        raise InvalidOrder(f"order amount must be positive, got {amount_cents}")
    order = Order(request_id=uow.key, customer=customer, amount_cents=amount_cents)
    uow.session.add(order)
    uow.session.flush()  # assigns order.id
    uow.publish(
        topic("order.accepted"),
        {"order_id": order.id, "customer": order.customer, "amount_cents": order.amount_cents},
        key=str(order.id),
    )
    return {"order_id": order.id}


def accept_order(uow: UnitOfWork, message: Any) -> dict[str, int]:
    """The Kafka door: an order request from ``order.requests``. An invalid one raises
    :class:`InvalidOrder`, a ``PermanentError``: the key is recorded as failed and the message
    dead-lettered."""
    request = json.loads(message.value())
    return place_order(uow, request["customer"], request["amount_cents"])  # stored with the key


async def accept_order_async(uow: AsyncUnitOfWork, message: Any) -> dict[str, int]:
    """:func:`accept_order` for the asyncio runner (``uow.session`` is an ``AsyncSession``)."""
    order = new_order(uow.key, json.loads(message.value()))
    uow.session.add(order)
    await uow.session.flush()
    uow.publish(topic("order.accepted"), accepted(order), key=str(order.id))  # only buffers
    return {"order_id": order.id}


def new_order(request_id: str, request: dict[str, Any]) -> Order:
    """The order row for a request (not yet added to a session)."""
    if request["amount_cents"] <= 0:
        # Retrying cannot fix this: record the key as failed and dead-letter the message.
        raise PermanentError(f"order amount must be positive, got {request['amount_cents']}")
    return Order(request_id=request_id, customer=request["customer"],
                 amount_cents=request["amount_cents"])  # fmt: skip


def accepted(order: Order) -> dict[str, Any]:
    """The ``order.accepted`` event of an order."""
    return {"order_id": order.id, "customer": order.customer, "amount_cents": order.amount_cents}


def ship_order(uow: UnitOfWork, message: Any) -> dict[str, int]:
    """React to ``order.accepted``: one shipment per accepted order."""
    event = json.loads(message.value())
    shipment = Shipment(order_id=event["order_id"])
    uow.session.add(shipment)
    uow.session.flush()
    return {"shipment_id": shipment.id}
