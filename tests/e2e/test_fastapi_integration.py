"""``outbox.http.fastapi`` over TCP: FastAPI under uvicorn (``tests/apps/http_fastapi.py``), a
unit of work in the request's session committed before the response, the toolkit's refusals as
problems, and the ``Idempotency-Key`` header in OpenAPI."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from outbox import Outbox, PermanentError
from tests.fixtures.common import ServiceUnavailable, unavailable, wait_for
from tests.fixtures.uow import count, create_orders
from tests.fixtures.web import HOW_HTTP, WebServer

PROBLEM = "application/problem+json"
ARGV = ["uvicorn", "tests.apps.http_fastapi:app", "--host", "127.0.0.1", "--port", "{port}",
        "--log-level", "warning", "--no-access-log"]  # fmt: skip
# A row of order_lines must point at an order; checked only at COMMIT.
ORDER_LINES_DDL = (
    "CREATE TABLE order_lines (order_id bigint NOT NULL REFERENCES orders (id) "
    "DEFERRABLE INITIALLY DEFERRED)"
)


@pytest.fixture
def app_url(
    engine: sa.Engine, database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[str]:
    create_orders(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(ORDER_LINES_DDL))
    server = WebServer(
        "asgi",
        {
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_REDIS_URL": redis_url,
            "OUTBOX_TEST_CACHE_PREFIX": redis_prefix,
        },
        argv=ARGV,
    )
    try:
        server.start()
    except ServiceUnavailable as exc:
        server.close()
        unavailable("HTTP server (FastAPI integration)", str(exc), HOW_HTTP)
    try:
        yield server.url
    finally:
        server.stop()
        server.close()


def post(url: str, key: str | None, amount: int = 1, **headers: str) -> httpx.Response:
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    if key is not None:
        sent["Idempotency-Key"] = key
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post("/orders", json={"amount": amount}, headers=sent)


def effects(engine: sa.Engine) -> tuple[int, int, int]:
    return (count(engine, "orders"), count(engine, "outbox"), count(engine, "idempotency_keys"))


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    document: dict[str, Any] = response.json()
    assert document["status"] == status and document["type"].endswith("/" + slug)
    return document


def test_a_commit_that_fails_at_commit_never_answers_2xx(app_url: str, engine: sa.Engine) -> None:
    key = str(uuid.uuid4())
    failed = post(app_url, key, x_fail="commit")
    assert failed.status_code == 500, failed.text
    assert effects(engine) == (0, 0, 0)  # no order, no event, no key
    retried = post(app_url, key)  # the key stayed free: the retry runs
    assert retried.status_code == 201, retried.text
    assert effects(engine) == (1, 1, 1)
    replayed = post(app_url, key)
    assert replayed.status_code == 201 and replayed.json() == retried.json()
    assert effects(engine) == (1, 1, 1)


def test_a_handler_that_raises_stores_nothing(app_url: str, engine: sa.Engine) -> None:
    response = post(app_url, str(uuid.uuid4()), x_fail="raise")
    assert response.status_code == 500
    assert effects(engine) == (0, 0, 0)


def test_a_concurrent_duplicate_gets_409_with_retry_after(app_url: str, engine: sa.Engine) -> None:
    key, lock = str(uuid.uuid4()), 7_300_001
    first: list[httpx.Response] = []
    with engine.connect() as holder:
        holder.execute(sa.text("SELECT pg_advisory_lock(:n)"), {"n": lock})
        thread = threading.Thread(target=lambda: first.append(post(app_url, key, x_hold=str(lock))))
        thread.start()

        def first_waits() -> bool:  # the first request holds its key and waits on our lock
            with engine.connect() as conn:
                waiting = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted AND objid = :n"
                    ),
                    {"n": lock},
                ).scalar_one()
            return bool(waiting)

        wait_for(first_waits, 20, "the first request never reached its advisory lock")
        duplicate = post(app_url, key)
        problem(duplicate, 409, "idempotency-key-in-progress")
        assert duplicate.headers["retry-after"] == "2"
        holder.execute(sa.text("SELECT pg_advisory_unlock(:n)"), {"n": lock})
        holder.commit()
    thread.join(30)
    assert [r.status_code for r in first] == [201]
    assert effects(engine) == (1, 1, 1)


def test_a_reused_key_gets_422(app_url: str, engine: sa.Engine) -> None:
    key = str(uuid.uuid4())
    assert post(app_url, key, amount=1).status_code == 201
    problem(post(app_url, key, amount=2), 422, "idempotency-key-reused")
    assert effects(engine) == (1, 1, 1)


def test_a_key_that_failed_permanently_gets_422(
    app_url: str, database_url: str, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    ob = Outbox(database_url)
    try:
        with pytest.raises(PermanentError), ob.unit_of_work(key, scope="tenant-none"):
            raise PermanentError("refused upstream")
    finally:
        ob.close()
    problem(post(app_url, key), 422, "idempotency-key-failed")
    assert count(engine, "orders") == 0


@pytest.mark.parametrize(
    ("headers", "slug"),
    [({}, "idempotency-key-missing"), ({"Idempotency-Key": ""}, "idempotency-key-invalid")],
)
def test_a_missing_or_bad_key_gets_400(
    app_url: str, engine: sa.Engine, headers: dict[str, str], slug: str
) -> None:
    with httpx.Client(base_url=app_url, timeout=30) as client:
        response = client.post("/orders", json={"amount": 1}, headers=headers)
    problem(response, 400, slug)
    assert effects(engine) == (0, 0, 0)


@pytest.mark.parametrize("path", ["/open", "/middleware/open"])
def test_current_unit_of_work_without_a_key_is_a_400_not_a_500(app_url: str, path: str) -> None:
    with httpx.Client(base_url=app_url, timeout=30) as client:
        response = client.post(path, json={})
    problem(response, 400, "idempotency-key-missing")


def test_the_openapi_schema_marks_the_key_required_where_the_server_requires_it(
    app_url: str,
) -> None:
    with httpx.Client(base_url=app_url, timeout=30) as client:
        schema = client.get("/openapi.json").json()

    def key_parameter(path: str) -> dict[str, Any]:
        parameters = schema["paths"][path]["post"]["parameters"]
        (found,) = [p for p in parameters if (p["in"], p["name"]) == ("header", "Idempotency-Key")]
        return found  # type: ignore[no-any-return]

    assert key_parameter("/orders")["required"] is True  # a request without it gets a 400
    assert key_parameter("/open")["required"] is False  # require_key=False


def test_a_second_caller_with_the_same_key_never_gets_the_first_callers_response(
    app_url: str, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    alice = post(app_url, key, authorization="Bearer alice")
    assert alice.status_code == 201, alice.text
    problem(post(app_url, key, authorization="Bearer bob"), 422, "idempotency-key-reused")
    problem(post(app_url, key), 422, "idempotency-key-reused")  # nor to a caller without any
    again = post(app_url, key, authorization="Bearer alice")
    assert again.status_code == 201 and again.json() == alice.json()
    assert effects(engine) == (1, 1, 1)


def test_a_replay_is_marked_idempotent_replayed_like_the_middlewares(
    app_url: str, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    first = post(app_url, key)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = post(app_url, key)
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert effects(engine) == (1, 1, 1)


def test_an_outbox_of_the_wrong_flavour_is_refused_before_any_request(database_url: str) -> None:
    from outbox.errors import ConfigurationError
    from outbox.http.fastapi import unit_of_work

    ob = Outbox(database_url)
    try:
        with pytest.raises(ConfigurationError, match="AsyncOutbox"):
            unit_of_work(ob)  # type: ignore[arg-type]
    finally:
        ob.close()
