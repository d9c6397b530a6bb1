"""``POST /orders`` with an ``Idempotency-Key``: one order and one ``orders.created`` event per
key, whatever the client repeats (the middleware replays the stored response)."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from outbox.http import current_unit_of_work
from shop.models import Order


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> HttpResponse:
    body = json.loads(request.body)
    order = Order.objects.create(item=body["item"], quantity=int(body["quantity"]))
    current_unit_of_work().publish(
        "orders.created", {"id": order.pk, "item": order.item}, key=str(order.pk)
    )
    return JsonResponse({"order_id": order.pk}, status=201)
