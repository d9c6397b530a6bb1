"""The order service's handlers, tested with ``outbox.testing`` alone: the real unit of work on a
database of each test's own, messages delivered as the consumer runner would, no broker."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from app import accept_order, accept_order_async, ship_order, topic

from outbox import Outbox
from outbox.testing import Deliverer, Published, assert_one_effect_per_key

ACCEPTED = topic("order.accepted")


def request_ids(outbox: Outbox) -> list[str]:
    with outbox.engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT request_id FROM example_orders")).scalars())


def shipped(outbox: Outbox) -> list[int]:
    with outbox.engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT order_id FROM example_shipments")).scalars())


@pytest.mark.parametrize("handler", [accept_order, accept_order_async])
def test_an_order_request_writes_one_order_and_its_event(
    handler: Any, deliver: Deliverer, outbox: Outbox, published: Published
) -> None:
    delivery = deliver(handler, {"customer": "ada", "amount_cents": 1200}, idempotency_key="r-1")
    assert delivery.outcome == "processed"
    order_id = delivery.result["order_id"]
    assert request_ids(outbox) == ["r-1"]
    (event,) = published.on(ACCEPTED)
    assert event.key == str(order_id)
    assert event.value == {"order_id": order_id, "customer": "ada", "amount_cents": 1200}


@pytest.mark.parametrize("handler", [accept_order, accept_order_async])
def test_redelivered_requests_apply_once(
    handler: Any, deliver: Deliverer, outbox: Outbox, published: Published
) -> None:
    requests = [{"customer": f"c{i}", "amount_cents": 100 + i} for i in range(4)]
    deliveries = deliver.deliver_many(handler, requests, times=3)
    assert sum(d.outcome == "processed" for d in deliveries) == 4
    assert all(d.outcome == "replayed" for d in deliveries[4:])
    # A replay answers with the result of the first delivery.
    assert [d.result for d in deliveries[4:8]] == [d.result for d in deliveries[:4]]
    assert_one_effect_per_key(request_ids(outbox), expected={d.key for d in deliveries})
    assert_one_effect_per_key(
        (e.value["order_id"] for e in published.on(ACCEPTED)),
        expected=[d.result["order_id"] for d in deliveries[:4]],
    )


def test_an_invalid_order_is_dead_lettered_and_writes_nothing(
    deliver: Deliverer, outbox: Outbox, published: Published
) -> None:
    refused = deliver(accept_order, {"customer": "bob", "amount_cents": 0}, idempotency_key="r-0")
    assert refused.outcome == "dead_lettered"
    assert refused.dead_letter is not None and refused.dead_letter.reason == "permanent-error"
    assert "must be positive" in refused.dead_letter.error
    again = deliver(accept_order, {"customer": "bob", "amount_cents": 0}, idempotency_key="r-0")
    assert again.outcome == "previously_failed"  # no second dead letter
    assert len(deliver.dead_letters) == 1
    assert request_ids(outbox) == [] and len(published) == 0


def test_each_accepted_order_is_shipped_once(
    deliver: Deliverer, outbox: Outbox, published: Published
) -> None:
    for i in range(3):
        deliver(accept_order, {"customer": f"c{i}", "amount_cents": 500}, idempotency_key=f"r{i}")
    events = published.on(ACCEPTED)
    assert len(events) == 3
    # As the relay sends them: the event id is the record's X-Idempotency-Key; sent twice.
    for _ in range(2):
        for event in events:
            deliver(ship_order, event.raw, key=event.key, idempotency_key=str(event.event_id))
    assert_one_effect_per_key(shipped(outbox), expected=[e.value["order_id"] for e in events])
