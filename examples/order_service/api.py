"""The order service's HTTP door: ``POST /orders`` with an ``Idempotency-Key`` header runs the
same unit of work as the Kafka consumer (:func:`app.place_order`), behind the WSGI middleware.

    export OUTBOX_DATABASE_URL=postgresql+psycopg://outbox:outbox@localhost:5432/outbox
    export OUTBOX_REDIS_URL=redis://localhost:6379/0
    gunicorn --worker-class gthread --threads 8 --bind 127.0.0.1:8000 api:app

    curl -i -X POST localhost:8000/orders -H 'Idempotency-Key: 9b1deb4d' \\
         -H 'Content-Type: application/json' -d '{"customer": "ada", "amount_cents": 1200}'

The order row, the ``order.accepted`` event and the response commit together before the
response leaves; the same request again gets the same bytes back (``Idempotent-Replayed:
true``) without a second order.
"""

from __future__ import annotations

import os
from typing import Any

from app import InvalidOrder, place_order
from flask import Flask, jsonify, request

from outbox import Outbox, UnitOfWork
from outbox.http import current_unit_of_work
from outbox.http.wsgi import IdempotencyMiddleware

ob = Outbox(os.environ["OUTBOX_DATABASE_URL"], redis_url=os.environ.get("OUTBOX_REDIS_URL"))

app = Flask(__name__)
# A scope of its own: the consumer's scope is its group, and each door stores its own kind of
# result (a response here, the handler's return value there).
app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, ob, scope="order-service.http", require_key=True
)


@app.post("/orders")
def create_order() -> Any:
    uow = current_unit_of_work()
    assert isinstance(uow, UnitOfWork)  # the WSGI door's units of work are the sync flavour
    body = request.get_json(force=True)
    try:
        order = place_order(uow, body["customer"], body["amount_cents"])
    except InvalidOrder as exc:
        # A 422 is the answer to this request for good: it is stored and replayed like a 201.
        problem = {"type": "about:blank", "title": "Invalid order", "status": 422,
                   "detail": str(exc)}  # fmt: skip
        return problem, 422, {"Content-Type": "application/problem+json"}
    return jsonify(order), 201, {"Location": f"/orders/{order['order_id']}"}
