"""The Django door over TCP: the project in ``tests/django/project`` under ``manage.py
runserver``, its views behind ``IdempotencyKeyMiddleware``, driven by httpx; the database is
read back after each answer. The same answers as the ASGI and WSGI doors (tests/e2e)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.django.conftest import count
from tests.fixtures.common import ServiceUnavailable, unavailable, wait_for
from tests.fixtures.web import HOW_HTTP, WebServer

PROBLEM = "application/problem+json"
RUNSERVER = ["django", "runserver", "127.0.0.1:{port}", "--noreload", "--skip-checks"]


class Site:
    def __init__(self, database_url: str, redis_url: str, redis_prefix: str) -> None:
        self.env = {
            "DJANGO_SETTINGS_MODULE": "tests.django.project.settings",
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_REDIS_URL": redis_url,
            "OUTBOX_TEST_CACHE_PREFIX": redis_prefix,
        }
        self.server: WebServer | None = None

    def start(self) -> None:
        self.server = WebServer("wsgi", self.env, argv=RUNSERVER)
        try:
            self.server.start()
        except ServiceUnavailable as exc:
            self.server.close()
            unavailable("Django runserver", str(exc), HOW_HTTP)

    def post(
        self, key: str | None, amount: int = 1, path: str = "/orders", **headers: str
    ) -> httpx.Response:
        assert self.server is not None
        sent = {name.replace("_", "-"): value for name, value in headers.items()}
        if key is not None:
            sent["Idempotency-Key"] = key
        with httpx.Client(base_url=self.server.url, timeout=30) as client:
            return client.post(path, json={"amount": amount}, headers=sent)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server.close()


@pytest.fixture
def site(django_database: str, redis_url: str, redis_prefix: str) -> Iterator[Site]:
    running = Site(django_database, redis_url, redis_prefix)
    running.start()
    try:
        yield running
    finally:
        running.close()


def effects(engine: sa.Engine) -> tuple[int, int, int]:
    return count(engine, "shop_order"), count(engine, "outbox"), count(engine, "idempotency_keys")


def problem(response: httpx.Response, status: int, slug: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["type"].endswith("/" + slug)


class Hold:
    """An advisory lock the test holds; a view told ``X-Hold`` waits for it after its insert."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.id = 4242
        self.conn = engine.connect()
        self.conn.execute(sa.text("SELECT pg_advisory_lock(:i)"), {"i": self.id})

    def wait_for_waiter(self) -> int:
        """The server process of the view that waits for the lock, once it waits."""
        waiters: list[int] = []

        def waiting() -> bool:
            with self.engine.connect() as conn:
                waiters[:] = conn.execute(sa.text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
                    "AND objid = :i AND NOT granted"), {"i": self.id}).scalars()  # fmt: skip
            return bool(waiters)

        wait_for(waiting, 30, "the view never waited for the held lock")
        return waiters[0]

    def release(self) -> None:
        self.conn.execute(sa.text("SELECT pg_advisory_unlock(:i)"), {"i": self.id})
        self.conn.close()


def test_a_duplicate_post_gets_the_stored_response_back(site: Site, engine: sa.Engine) -> None:
    key = str(uuid.uuid4())
    first = site.post(key, 7)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = site.post(key, 7)
    assert again.status_code == 201 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    assert effects(engine) == (1, 1, 1)


def test_key_reuse_is_422_a_bad_key_400_and_no_key_passes_through(
    site: Site, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    assert site.post(key, 1).status_code == 201
    problem(site.post(key, 2), 422, "idempotency-key-reused")
    assert site.post("x" * 1000).status_code == 400
    assert site.post(None).status_code == 201  # not covered: the view runs, nothing stored
    assert effects(engine) == (2, 1, 1)


def test_another_caller_with_the_same_key_is_not_given_the_response(
    site: Site, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    assert site.post(key, 1, Authorization="Bearer alice").status_code == 201
    problem(site.post(key, 1, Authorization="Bearer mallory"), 422, "idempotency-key-reused")
    assert effects(engine) == (1, 1, 1)


def test_a_duplicate_of_a_running_request_gets_409_at_once(site: Site, engine: sa.Engine) -> None:
    key = str(uuid.uuid4())
    hold = Hold(engine)
    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(site.post(key, 3, X_Hold="4242")))
    first.start()
    try:
        hold.wait_for_waiter()
        duplicate = site.post(key, 3)
        problem(duplicate, 409, "idempotency-key-in-progress")
        assert int(duplicate.headers["retry-after"]) >= 1
    finally:
        hold.release()
        first.join(30)
    assert answers[0].status_code == 201
    assert effects(engine) == (1, 1, 1)


def test_a_500_is_not_stored_and_the_retry_runs(site: Site, engine: sa.Engine) -> None:
    key = str(uuid.uuid4())
    assert site.post(key, 1, X_Fail="1").status_code == 500
    assert effects(engine) == (0, 0, 0)
    assert site.post(key, 1).status_code == 201
    assert effects(engine) == (1, 1, 1)


def test_a_server_killed_mid_request_leaves_one_effect_per_key(
    site: Site, engine: sa.Engine
) -> None:
    key = str(uuid.uuid4())
    hold = Hold(engine)
    lost: list[BaseException] = []

    def doomed() -> None:
        try:
            site.post(key, 9, X_Hold="4242")
        except httpx.HTTPError as exc:
            lost.append(exc)

    first = threading.Thread(target=doomed)
    first.start()
    backend = hold.wait_for_waiter()
    assert site.server is not None
    site.server.kill()  # SIGKILL while the view's transaction holds the key
    first.join(30)
    assert lost, "the killed server still answered"
    hold.release()  # the orphaned backend proceeds, finds its client gone, rolls back

    def backend_gone() -> bool:
        with engine.connect() as conn:
            return not conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": backend}
            ).scalar()

    wait_for(backend_gone, 30, "the killed server's backend did not go away")
    assert effects(engine) == (0, 0, 0)
    site.start()
    retry = site.post(key, 9)
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert site.post(key, 9).headers["idempotent-replayed"] == "true"
    assert effects(engine) == (1, 1, 1)
