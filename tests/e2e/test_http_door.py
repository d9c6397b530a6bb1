"""The HTTP door over TCP: FastAPI under uvicorn and Flask under gunicorn (threads), each
behind its idempotency middleware, driven by httpx (``tests/apps`` has the endpoints).

Every test runs against both servers; the database is read back after each answer.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
import redis

from tests.fixtures.uow import count, rows
from tests.fixtures.web import HttpApp

PROBLEM = "application/problem+json"


def post(
    app: HttpApp, key: str | None, body: Any = None, path: str = "/orders", **headers: str
) -> httpx.Response:
    sent = {name.replace("_", "-"): value for name, value in headers.items()}
    if key is not None:
        sent["Idempotency-Key"] = key
    with httpx.Client(base_url=app.url, timeout=30) as client:
        return client.post(path, json={"amount": 1} if body is None else body, headers=sent)


def effects(app: HttpApp) -> tuple[int, int, int]:
    """(order rows, outbox rows, idempotency keys) in the app's database."""
    return (
        count(app.engine, "orders"),
        count(app.engine, "outbox"),
        count(app.engine, "idempotency_keys"),
    )


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    document = response.json()
    assert document["status"] == status
    assert document["type"].endswith("/" + slug)
    assert document["title"] and document["detail"]
    return dict(document)


def database_use(app: HttpApp) -> tuple[int, int]:
    """(statements sent through SQLAlchemy, connections checked out of the pool) in the app:
    the unit of work sends its SQL on the raw driver connection, which only the checkouts see."""
    with httpx.Client(base_url=app.url, timeout=10) as client:
        stats = client.get("/stats").json()
    return int(stats["statements"]), int(stats["checkouts"])


def test_sixteen_concurrent_identical_posts_make_one_order(http_app: HttpApp) -> None:
    key = str(uuid.uuid4())
    answers: list[httpx.Response | BaseException] = [RuntimeError("not sent")] * 16
    answered_at = [0.0] * 16  # when each answer arrived (monotonic), to order them
    barrier = threading.Barrier(16)

    def one(i: int) -> None:
        with httpx.Client(base_url=http_app.url, timeout=30) as client:
            barrier.wait()
            try:
                answers[i] = client.post(
                    "/orders",
                    json={"amount": 5},
                    # the first attempt holds its unit of work open for a while
                    headers={"Idempotency-Key": key, "X-Delay": "3"},
                )
                answered_at[i] = time.monotonic()
            except BaseException as exc:
                answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    responses = [a for a in answers if isinstance(a, httpx.Response)]
    assert len(responses) == 16, answers

    assert effects(http_app) == (1, 1, 1)
    created = [r for r in responses if r.status_code == 201]
    first = [r for r in created if "idempotent-replayed" not in r.headers]
    assert len(first) == 1, [(r.status_code, dict(r.headers)) for r in responses]
    for r in created:
        assert r.content == first[0].content
        assert r.headers["location"] == first[0].headers["location"]
        if r is not first[0]:
            assert r.headers["idempotent-replayed"] == "true"
    in_progress = [i for i, r in enumerate(responses) if r.status_code == 409]
    assert in_progress, "the concurrent duplicates must have met the running attempt"
    first_answered = answered_at[responses.index(first[0])]
    for i in in_progress:
        problem(responses[i], 409, "idempotency-key-in-progress")
        assert int(responses[i].headers["retry-after"]) >= 1
        # refused while the first attempt was still running, not made to wait for it
        assert answered_at[i] < first_answered, "a duplicate waited for the running attempt"
    assert len(created) + len(in_progress) == 16

    # once it has committed, every duplicate gets the same bytes back
    later = post(http_app, key, {"amount": 5})
    assert later.status_code == 201 and later.content == first[0].content
    assert later.headers["idempotent-replayed"] == "true"
    assert effects(http_app) == (1, 1, 1)


def test_a_duplicate_replays_the_stored_response_from_redis(
    http_app: HttpApp, redis_url: str, redis_prefix: str
) -> None:
    key = str(uuid.uuid4())
    first = post(http_app, key, {"amount": 7})
    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    order = first.json()
    assert first.headers["location"] == f"/orders/{order['order_id']}"
    assert effects(http_app) == (1, 1, 1)
    stored = rows(http_app.engine, "SELECT key, result FROM idempotency_keys")
    assert stored[0][0] == key
    assert stored[0][1]["status"] == 201
    assert json.loads(stored[0][1]["body"]) == order

    # The first retry is answered from the key's row, which it caches.
    retried = post(http_app, key, {"amount": 7})
    assert retried.status_code == 201 and retried.content == first.content
    assert retried.headers["idempotent-replayed"] == "true"
    cached = redis.Redis.from_url(redis_url).keys(f"*{redis_prefix}*")
    assert cached, "the committed response is in the cache"
    before = database_use(http_app)
    again = post(http_app, key, {"amount": 7})
    assert database_use(http_app) == before, "a replay from Redis takes no PostgreSQL connection"
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == first.headers["content-type"]
    assert again.headers["location"] == first.headers["location"]
    assert effects(http_app) == (1, 1, 1)


def test_the_same_key_for_another_request_is_422(http_app: HttpApp) -> None:
    key = str(uuid.uuid4())
    assert post(http_app, key, {"amount": 1}).status_code == 201
    problem(post(http_app, key, {"amount": 2}), 422, "idempotency-key-reused")
    problem(post(http_app, key, {"amount": 1}, path="/stream"), 422, "idempotency-key-reused")
    assert effects(http_app) == (1, 1, 1)


def test_missing_empty_and_too_long_keys_are_400(http_app: HttpApp) -> None:
    problem(post(http_app, None), 400, "idempotency-key-missing")
    problem(post(http_app, ""), 400, "idempotency-key-invalid")
    detail = problem(post(http_app, "k" * 256), 400, "idempotency-key-invalid")["detail"]
    assert "255" in detail
    assert effects(http_app) == (0, 0, 0)
    # 255 characters is a key
    assert post(http_app, "k" * 255).status_code == 201


def test_a_structured_field_key_is_stored_as_its_content(http_app: HttpApp) -> None:
    assert post(http_app, '"order-1"').status_code == 201
    replay = post(http_app, "order-1")  # the same key, sent bare
    assert replay.headers["idempotent-replayed"] == "true"
    assert rows(http_app.engine, "SELECT key FROM idempotency_keys") == [("order-1",)]


@pytest.mark.parametrize("failure", ["500", "raise"])
def test_a_5xx_or_an_exception_stores_nothing_and_the_retry_runs(
    http_app: HttpApp, failure: str
) -> None:
    key = str(uuid.uuid4())
    failed = post(http_app, key, X_Fail=failure)
    assert failed.status_code == 500
    assert "idempotent-replayed" not in failed.headers
    assert effects(http_app) == (0, 0, 0), "no row, no event, no key"

    retry = post(http_app, key)
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert effects(http_app) == (1, 1, 1)


def test_which_4xx_are_stored(http_app: HttpApp) -> None:
    conflict = str(uuid.uuid4())
    assert post(http_app, conflict, X_Status="409").status_code == 409
    assert effects(http_app) == (0, 0, 0)
    assert post(http_app, conflict).status_code == 201  # ran again

    gone = str(uuid.uuid4())
    first = post(http_app, gone, X_Status="410")
    assert first.status_code == 410
    assert effects(http_app) == (2, 2, 2)  # a 410 is the handler's verdict: stored
    again = post(http_app, gone)
    assert again.status_code == 410 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"


def test_two_tenants_with_one_key_get_two_orders(http_app: HttpApp) -> None:
    key = "shared-key"
    a = post(http_app, key, X_Tenant="a")
    b = post(http_app, key, X_Tenant="b")
    assert a.status_code == b.status_code == 201
    assert a.json()["order_id"] != b.json()["order_id"]
    assert effects(http_app) == (2, 2, 2)
    assert post(http_app, key, X_Tenant="a").content == a.content
    assert post(http_app, key, X_Tenant="b").content == b.content
    scopes = rows(http_app.engine, "SELECT scope, key FROM idempotency_keys ORDER BY scope")
    assert scopes == [("tenant-a", key), ("tenant-b", key)]


def test_get_passes_through_with_or_without_a_key(http_app: HttpApp) -> None:
    with httpx.Client(base_url=http_app.url, timeout=10) as client:
        for headers in ({}, {"Idempotency-Key": "k"}, {"Idempotency-Key": ""}):
            answer = client.get("/probe", headers=headers)
            assert answer.status_code == 200
            assert answer.json() == {"uow": False}
            assert "idempotent-replayed" not in answer.headers
    assert effects(http_app) == (0, 0, 0)


def test_streaming_responses_are_refused(http_app: HttpApp) -> None:
    key = str(uuid.uuid4())
    problem(post(http_app, key, path="/stream"), 500, "streaming-response")
    assert effects(http_app) == (0, 0, 0)
    problem(post(http_app, key, path="/stream"), 500, "streaming-response")


def test_a_request_body_over_the_limit_is_413(http_app: HttpApp) -> None:
    with httpx.Client(base_url=http_app.url, timeout=30) as client:
        answer = client.post(
            "/orders",
            content=b"x" * (1024 * 1024 + 1),
            headers={"Idempotency-Key": "big", "Content-Type": "application/json"},
        )
    problem(answer, 413, "request-too-large")
    assert effects(http_app) == (0, 0, 0)


def test_a_stored_response_is_only_for_its_own_caller(
    http_app: HttpApp, redis_url: str, redis_prefix: str
) -> None:
    """Alice's order answered with her card's digits; Mallory, with other credentials, the
    same key and the same body, gets a 422 and nothing of Alice's -- from Redis and from
    PostgreSQL alike -- and so does a caller without credentials. Alice still gets her
    response back."""
    key = str(uuid.uuid4())
    body = {"amount": 3, "card": "4242"}
    alice = post(http_app, key, body, Authorization="Bearer alice")
    assert alice.status_code == 201 and "idempotent-replayed" not in alice.headers
    secret = alice.json()["nonce"]
    for flushed in (False, True):
        if flushed:  # the answers below come from PostgreSQL
            with redis.Redis.from_url(redis_url) as client:
                assert client.delete(*client.scan_iter(match=f"{redis_prefix}*")) == 1
        for other in ({"Authorization": "Bearer mallory"}, {}):
            refused = post(http_app, key, body, **other)
            problem(refused, 422, "idempotency-key-reused")
            assert secret not in refused.text and "location" not in refused.headers
        again = post(http_app, key, body, Authorization="Bearer alice")
        assert again.status_code == 201 and again.content == alice.content
        assert again.headers["idempotent-replayed"] == "true"
    assert effects(http_app) == (1, 1, 1)
