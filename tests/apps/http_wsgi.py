"""Flask under gunicorn (threads), behind ``outbox.http.wsgi.IdempotencyMiddleware`` (see the
package docstring for the endpoints)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from flask import Flask, Response, jsonify, request

from outbox import Outbox, OutboxConfig, UnitOfWork
from outbox.errors import NoUnitOfWork
from outbox.http import current_unit_of_work
from outbox.http.wsgi import IdempotencyMiddleware
from tests.apps import INSERT_ORDER, cache_prefix, database_url, redis_url, tenant

ob = Outbox(database_url(), redis_url=redis_url(), config=OutboxConfig(cache_prefix=cache_prefix()))
statements = [0]
checkouts = [0]  # PostgreSQL connections taken from the pool, whoever sends SQL on them


def _count(*_: Any) -> None:
    statements[0] += 1


def _checkout(*_: Any) -> None:
    checkouts[0] += 1


sa.event.listen(ob.engine, "before_cursor_execute", _count)
sa.event.listen(ob.engine, "checkout", _checkout)

app = Flask(__name__)
app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, ob, scope=tenant, require_key=True
)


@app.post("/orders")
def create_order() -> Any:
    payload = request.get_json()
    uow = current_unit_of_work()
    assert isinstance(uow, UnitOfWork)
    result = uow.connection.execute(sa.text(INSERT_ORDER), {"k": uow.key, "a": payload["amount"]})
    order_id = result.scalar_one()
    uow.publish("orders.created", {"order_id": order_id}, key=str(order_id))
    if delay := request.headers.get("x-delay"):
        time.sleep(float(delay))
    fail = request.headers.get("x-fail")
    if fail == "raise":
        raise RuntimeError("the handler failed after writing")
    if fail == "500":
        return jsonify(error="try again"), 500
    status = int(request.headers.get("x-status", "201"))
    body = {"order_id": order_id, "amount": payload["amount"], "nonce": uuid.uuid4().hex}
    if pad := request.headers.get("x-pad"):
        body["pad"] = "x" * int(pad)
    return jsonify(body), status, {"Location": f"/orders/{order_id}"}


@app.post("/stream")
def stream() -> Response:
    def chunks() -> Iterator[bytes]:
        for i in range(3):
            yield f"chunk {i}\n".encode()

    return Response(chunks(), mimetype="text/plain")


@app.get("/probe")
def probe() -> Any:
    try:
        current_unit_of_work()
    except NoUnitOfWork:
        return {"uow": False}
    return {"uow": True}


@app.get("/stats")
def stats() -> Any:
    return {"statements": statements[0], "checkouts": checkouts[0]}
