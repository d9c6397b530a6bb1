"""The views the door's end-to-end tests call."""

from __future__ import annotations

import json

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from outbox.http import current_unit_of_work
from tests.django.shop.models import Order


def probe(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@csrf_exempt
def orders(request: HttpRequest) -> HttpResponse:
    """Create an order and its event. ``X-Hold: <n>`` makes the view wait, after its insert, for
    the PostgreSQL advisory lock ``n`` the test holds (a deterministic hook: the test sees the
    wait in pg_locks). ``X-Fail: 500`` answers 500 after the insert."""
    body = json.loads(request.body or b"{}")
    order = Order.objects.create(order_key=request.headers.get("Idempotency-Key", ""),
                                 amount=int(body.get("amount", 1)))  # fmt: skip
    if "Idempotency-Key" in request.headers:  # covered: the event goes with the unit of work
        current_unit_of_work().publish("orders.created", {"id": order.pk}, key=str(order.pk))
    hold = request.headers.get("X-Hold")
    if hold:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(hold)])
    if request.headers.get("X-Fail"):
        return JsonResponse({"error": "failed"}, status=500)
    answer = JsonResponse({"order_id": order.pk}, status=201)
    answer["Location"] = f"/orders/{order.pk}"
    return answer


@api_view(["POST"])
def api_orders(request: Request) -> Response:
    """The same order as :func:`orders`, as a Django REST framework view (``X-Hold`` too)."""
    order = Order.objects.create(order_key=request.headers.get("Idempotency-Key", ""),
                                 amount=int(request.data.get("amount", 1)))  # fmt: skip
    if "Idempotency-Key" in request.headers:
        current_unit_of_work().publish("orders.created", {"id": order.pk}, key=str(order.pk))
    hold = request.headers.get("X-Hold")
    if hold:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [int(hold)])
    return Response({"order_id": order.pk}, status=201, headers={"Location": f"/orders/{order.pk}"})
