"""Bodies through real servers (uvicorn, gunicorn): a chunked request body is fingerprinted,
stored and replayed like a sized one, and a response over the middleware's limit is a 500
problem with nothing stored."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx

from outbox._core.http import (
    DEFAULT_MAX_RESPONSE_BYTES,
)
from tests.e2e.test_http_door import effects, post, problem
from tests.fixtures.web import HttpApp


def _chunked(app: HttpApp, key: str, body: bytes) -> httpx.Response:
    def pieces() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        for start in range(0, len(body), 7):
            yield body[start : start + 7]

    with httpx.Client(base_url=app.url, timeout=30) as client:
        return client.post(
            "/orders",
            content=pieces(),
            headers={"Idempotency-Key": key, "Content-Type": "application/json"},
        )


def test_a_chunked_request_body_is_stored_and_replayed(http_app: HttpApp) -> None:
    key = str(uuid.uuid4())
    body = json.dumps({"amount": 3, "note": "in pieces " * 20}).encode()
    first = _chunked(http_app, key, body)
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    again = _chunked(http_app, key, body)
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    # The same key with another chunked body is another request.
    other = _chunked(http_app, key, json.dumps({"amount": 4}).encode())
    problem(other, 422, "idempotency-key-reused")
    assert effects(http_app) == (1, 1, 1)


def test_a_response_over_the_limit_is_a_500_problem_and_nothing_is_stored(
    http_app: HttpApp,
) -> None:
    key = str(uuid.uuid4())
    too_big = post(http_app, key, X_Pad=str(DEFAULT_MAX_RESPONSE_BYTES + 1))
    assert too_big.status_code == 500
    assert too_big.headers["content-type"] == "application/problem+json"
    assert "idempotent-replayed" not in too_big.headers
    assert effects(http_app) == (0, 0, 0), "no row, no event, no key"
    retry = post(http_app, key)
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert effects(http_app) == (1, 1, 1)
