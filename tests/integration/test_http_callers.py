"""Which caller a stored response is for, through the WSGI and ASGI middlewares in process on the
real PostgreSQL and Redis (two callers over TCP: ``tests/e2e/test_http_door.py``)."""

from __future__ import annotations

import asyncio
import io
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from outbox import AsyncOutbox, Outbox, OutboxConfig
from outbox.http import Request
from outbox.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from outbox.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.fixtures.uow import count


def _app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """Answers with a secret of the run: whoever gets it back got this run's response."""
    start_response("201 Created", [("Content-Type", "text/plain")])
    return [f"secret {uuid.uuid4().hex}".encode()]


def call(middleware: Any, key: str, **headers: str) -> tuple[int, bytes]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/pay", "SCRIPT_NAME": "", "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(b"{}"), "CONTENT_LENGTH": "2", "HTTP_IDEMPOTENCY_KEY": key,
    }  # fmt: skip
    for name, value in headers.items():
        environ["HTTP_" + name.upper()] = value
    answer: list[Any] = []

    def start_response(status: str, pairs: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer[:] = [int(status.split()[0])]
        return lambda data: None

    data = b"".join(middleware(environ, start_response))
    return answer[0], data


@pytest.fixture
def ob(engine: sa.Engine, redis_url: str, redis_prefix: str) -> Iterator[Outbox]:
    client = redis.Redis.from_url(redis_url)
    with Outbox(engine, redis=client, config=OutboxConfig(cache_prefix=redis_prefix)) as o:
        yield o
    client.close()


def test_a_principal_keeps_one_callers_response_across_refreshed_tokens(ob: Outbox) -> None:
    def account(request: Request) -> str | None:
        token = request.headers.get("authorization")
        return None if token is None else token.split(":")[0]

    middleware = WsgiMiddleware(_app, ob, principal=account)
    status, first = call(middleware, "k1", authorization="alice:token-1")
    assert status == 201
    assert call(middleware, "k1", authorization="alice:token-2") == (201, first)  # refreshed
    assert call(middleware, "k1", authorization="mallory:token-1")[0] == 422
    assert call(middleware, "k1")[0] == 422
    assert count(ob.engine, "idempotency_keys") == 1


def test_named_session_cookies_tell_browser_callers_apart(ob: Outbox) -> None:
    middleware = WsgiMiddleware(_app, ob, caller_cookies=("session",))
    status, first = call(middleware, "k2", cookie="session=alice; theme=dark")
    assert status == 201
    assert call(middleware, "k2", cookie="theme=light; session=alice") == (201, first)
    assert call(middleware, "k2", cookie="session=mallory; theme=dark")[0] == 422


def test_per_caller_off_shares_the_response_among_callers(ob: Outbox) -> None:
    middleware = WsgiMiddleware(_app, ob, per_caller=False)
    status, first = call(middleware, "k3", authorization="Bearer alice")
    assert status == 201
    assert call(middleware, "k3", authorization="Bearer mallory") == (201, first)
    assert call(middleware, "k3") == (201, first)


def test_the_asgi_middleware_covers_the_caller_too(database_url: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = f"secret {uuid.uuid4().hex}".encode()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def one(middleware: Any, authorization: str) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http", "method": "POST", "path": "/pay", "query_string": b"",
            "headers": [(b"idempotency-key", b"k4"), (b"authorization", authorization.encode())],
        }  # fmt: skip
        incoming = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return incoming.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await middleware(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def scenario() -> list[tuple[int, bytes]]:
        async with AsyncOutbox(database_url) as aob:
            middleware = AsgiMiddleware(app, aob)
            return [
                await one(middleware, "Bearer alice"),
                await one(middleware, "Bearer mallory"),
                await one(middleware, "Bearer alice"),
            ]

    alice, mallory, again = asyncio.run(scenario())
    assert alice[0] == 201 and again == alice
    assert mallory[0] == 422 and alice[1] not in mallory[1]
