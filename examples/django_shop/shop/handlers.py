"""``manage.py outbox_consume shop.handlers:ship --topic orders.created --group shipping``:
each order is shipped once, however often its event is delivered."""

from __future__ import annotations

import json
from typing import Any

from shop.models import Order


def ship(uow: Any, message: Any) -> dict[str, int]:
    event = json.loads(message.value())
    Order.objects.filter(pk=event["id"]).update(shipped=True)
    uow.publish("orders.shipped", {"id": event["id"]}, key=str(event["id"]))
    return {"shipped": event["id"]}
