"""The shop under Django's test client: a repeated request is answered once."""

from __future__ import annotations

from django.test import Client
from shop.models import Order

from outbox.django import unit_of_work


def test_a_repeated_order_request_creates_one_order(outbox_django_db: str) -> None:
    client = Client()
    headers = {"HTTP_IDEMPOTENCY_KEY": "order-1"}
    first = client.post("/orders", {"item": "tea", "quantity": 2}, "application/json", **headers)
    again = client.post("/orders", {"item": "tea", "quantity": 2}, "application/json", **headers)
    assert first.status_code == again.status_code == 201
    assert again.content == first.content and again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1


def test_a_request_without_a_key_is_refused(outbox_django_db: str) -> None:
    answer = Client().post("/orders", {"item": "tea", "quantity": 1}, "application/json")
    assert answer.status_code == 400
    assert Order.objects.count() == 0


def test_shipping_runs_once_per_key(outbox_django_db: str) -> None:
    order = Order.objects.create(item="tea", quantity=1)
    for _ in range(2):  # the same event delivered twice
        with unit_of_work(f"ship-{order.pk}", scope="shipping") as uow:
            if not uow.replayed:
                Order.objects.filter(pk=order.pk).update(shipped=True)
                uow.result = {"shipped": order.pk}
    assert Order.objects.get(pk=order.pk).shipped
