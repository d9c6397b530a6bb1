"""A Django REST framework view (``@api_view``) behind ``IdempotencyKeyMiddleware``, over TCP
under ``manage.py runserver``: the same answers as a plain Django view (test_middleware_server)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import sqlalchemy as sa

from tests.django.test_middleware_server import (
    Hold,
    Site,
    effects,
    problem,
    site as site,
)

API = "/api/orders"


def test_a_duplicate_post_to_an_api_view_gets_the_stored_response_back(
    site: Site, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    first = site.post(key, 7, path=API)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert first.headers["content-type"] == "application/json"
    again = site.post(key, 7, path=API)
    assert again.status_code == 201 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    problem(site.post(key, 8, path=API), 422, "idempotency-key-reused")
    assert effects(engine) == (1, 1, 1)


def test_a_duplicate_of_a_running_api_request_gets_409_at_once(
    site: Site, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    hold = Hold(engine)
    answers: list[Any] = []
    first = threading.Thread(
        target=lambda: answers.append(site.post(key, 3, path=API, X_Hold=str(hold.id)))
    )
    first.start()
    try:
        hold.wait_for_waiter()
        problem(site.post(key, 3, path=API), 409, "idempotency-key-in-progress")
    finally:
        hold.release()
        first.join(30)
    assert answers[0].status_code == 201
    assert effects(engine) == (1, 1, 1)
