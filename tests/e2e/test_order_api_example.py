"""The order-service example's HTTP door (``examples/order_service/api.py``) under gunicorn:
the consumer's unit of work behind an ``Idempotency-Key``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.fixtures.common import ServiceUnavailable, unavailable
from tests.fixtures.uow import count, rows
from tests.fixtures.web import HOW_HTTP, WebServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "order_service"


@pytest.fixture
def order_api(engine: sa.Engine, database_url: str, redis_url: str) -> Iterator[str]:
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        import app  # the example's module, as gunicorn will import it

        app.create_tables(engine)
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("app", None)
    server = WebServer(
        "wsgi",
        {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_REDIS_URL": redis_url},
        ["gunicorn", "--worker-class", "gthread", "--threads", "4", "--bind",
         "127.0.0.1:{port}", "api:app"],
        cwd=EXAMPLE,
    )  # fmt: skip
    try:
        server.start()
    except ServiceUnavailable as exc:
        server.close()
        unavailable("the example's HTTP door (gunicorn)", str(exc), HOW_HTTP)
    try:
        yield server.url
    finally:
        server.stop()
        server.close()


def test_http_door_places_one_order_per_key(
    order_api: str, engine: sa.Engine, redis_prefix: str
) -> None:
    # The example caches under its default prefix: keys unique to this test (their cache
    # entries contain the test's prefix, and go with it).
    key, bad = f"{redis_prefix}-1", f"{redis_prefix}-2"
    order = {"customer": "ada", "amount_cents": 1200}
    with httpx.Client(base_url=order_api, timeout=30) as client:
        first = client.post("/orders", json=order, headers={"Idempotency-Key": key})
        again = client.post("/orders", json=order, headers={"Idempotency-Key": key})
        invalid = client.post(
            "/orders",
            json={"customer": "bob", "amount_cents": 0},
            headers={"Idempotency-Key": bad},
        )
        invalid_again = client.post(
            "/orders",
            json={"customer": "bob", "amount_cents": 0},
            headers={"Idempotency-Key": bad},
        )
        missing = client.post("/orders", json=order)
    assert first.status_code == 201 and first.headers["location"].startswith("/orders/")
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert invalid.status_code == invalid_again.status_code == 422
    assert invalid_again.headers["idempotent-replayed"] == "true"
    assert missing.status_code == 400
    assert rows(engine, "SELECT request_id, customer FROM example_orders") == [(key, "ada")]
    assert count(engine, "outbox", "topic = 'order.accepted'") == 1
    assert count(engine, "idempotency_keys", "scope = 'order-service.http'") == 2
