"""The consumer handler the Django door's tests run under ``manage.py outbox_consume``."""

from __future__ import annotations

import json
from typing import Any

from django.db import connection

from tests.django.shop.models import Order


def accept(uow: Any, message: Any) -> dict[str, str]:
    """An order per message; ``"hold": n`` waits, after the insert, for the advisory lock ``n``
    the test holds (a deterministic hook for the kill)."""
    body = json.loads(message.value())
    Order.objects.create(order_key=body["key"], amount=int(body.get("amount", 1)))
    uow.publish("orders.accepted", {"key": body["key"]}, key=body["key"])
    if body.get("hold"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(body["hold"])])
    return {"accepted": body["key"]}
