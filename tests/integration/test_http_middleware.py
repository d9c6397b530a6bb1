"""The idempotency middlewares in process, around bare ASGI and WSGI callables, on the real
PostgreSQL: the corners a framework rarely shows (bodies in pieces, lazy ``start_response``,
``write()``, applications that misbehave, limits, extensions) and the settings.

The frameworks under real servers are tested in ``tests/e2e/test_http_door.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox import AsyncOutbox, AsyncUnitOfWork, Outbox, OutboxConfig, PermanentError
from outbox.errors import ConfigurationError, NoUnitOfWork
from outbox.http import current_unit_of_work
from outbox.http.asgi import IdempotencyMiddleware as AsgiMiddleware
from outbox.http.wsgi import IdempotencyMiddleware as WsgiMiddleware
from tests.fixtures.uow import count

Message = dict[str, Any]
AsgiApp = Callable[[Any, Any, Any], Awaitable[None]]


# -- ASGI -----------------------------------------------------------------------------------


async def call(
    middleware: Any,
    *,
    method: str = "POST",
    key: str | None = "k1",
    body: list[bytes] | None = None,
    headers: Iterable[tuple[str, str]] = (),
    extensions: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One request through ``middleware``; returns status, headers and body as sent."""
    pieces = [b'{"a":1}'] if body is None else body
    incoming: list[Message] = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]
    fields = [(n.lower().encode(), v.encode()) for n, v in headers]
    if key is not None:
        fields.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http", "method": method, "path": "/things", "query_string": b"",
        "headers": fields, "extensions": extensions or {},
    }  # fmt: skip

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    assert sent[0]["type"] == "http.response.start"
    out = {n.decode(): v.decode() for n, v in sent[0]["headers"]}
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], out, data


def respond(
    status: int = 201, pieces: Iterable[bytes] = (b'{"ok":true}',), length: bool = True
) -> AsgiApp:
    """An ASGI app that publishes an event and answers with ``pieces``."""
    chunks = list(pieces)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        uow = current_unit_of_work()
        assert isinstance(uow, AsyncUnitOfWork)
        uow.publish("things.created", {"n": 1})
        headers = [(b"content-type", b"application/json")]
        if length:
            headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, chunk in enumerate(chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1}
            )

    return app


def stored(engine: sa.Engine) -> tuple[int, int]:
    return count(engine, "idempotency_keys"), count(engine, "outbox")


def run_async(
    database_url: str, test: Callable[[AsyncOutbox], Awaitable[None]], **config: Any
) -> None:
    async def main() -> None:
        async with AsyncOutbox(database_url, config=OutboxConfig(**config)) as aob:
            await test(aob)

    asyncio.run(main())


def test_asgi_body_in_pieces_with_a_length_is_stored_and_replayed(
    database_url: str, engine: sa.Engine
) -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        assert message["more_body"] is False
        await respond(pieces=[b"ab", b"", b"cd"])(scope, receive, send)

    async def test(aob: AsyncOutbox) -> None:
        middleware = AsgiMiddleware(app, aob)
        first = await call(middleware, body=[b'{"a":', b"1}"])
        assert first[0] == 201 and first[2] == b"abcd"
        assert seen == [b'{"a":1}'], "the application reads the whole body at once"
        again = await call(middleware, body=[b'{"a":1}'])
        assert again[2] == b"abcd" and again[1]["idempotent-replayed"] == "true"
        assert again[1]["content-type"] == "application/json"
        assert again[1]["content-length"] == "4"

    run_async(database_url, test)
    assert stored(engine) == (1, 1)


def test_asgi_response_over_the_limit_is_a_500_problem_and_nothing_is_stored(
    database_url: str, engine: sa.Engine
) -> None:
    async def test(aob: AsyncOutbox) -> None:
        middleware = AsgiMiddleware(
            respond(pieces=[b"x" * 60, b"x" * 60]), aob, max_response_bytes=100
        )
        status, headers, body = await call(middleware)
        assert status == 500 and headers["content-type"] == "application/problem+json"
        assert json.loads(body)["type"].endswith("/response-too-large")

    run_async(database_url, test)
    assert stored(engine) == (0, 0)


def test_asgi_application_that_swallows_the_refusal_still_stores_nothing(
    database_url: str, engine: sa.Engine
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        current_unit_of_work().publish("things.created", {"n": 1})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            # an application that ignores the middleware's refusal
            with contextlib.suppress(BaseException):
                await send({"type": "http.response.body", "body": b"tick", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def test(aob: AsyncOutbox) -> None:
        status, _, body = await call(AsgiMiddleware(app, aob))
        assert status == 500 and json.loads(body)["type"].endswith("/streaming-response")

    run_async(database_url, test)
    assert stored(engine) == (0, 0)


@pytest.mark.parametrize("error", [RuntimeError("boom"), PermanentError("no"), ValueError("v")])
def test_asgi_exceptions_are_reraised_and_store_nothing_even_if_permanent(
    database_url: str, engine: sa.Engine, error: Exception
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        current_unit_of_work().publish("things.created", {"n": 1})
        raise error

    async def test(aob: AsyncOutbox) -> None:
        middleware = AsgiMiddleware(app, aob)
        with pytest.raises(type(error)) as caught:
            await call(middleware)
        assert caught.value is error
        # the key is free at once: the retry runs
        assert (await call(AsgiMiddleware(respond(), aob)))[0] == 201

    # permanent_errors would record any Exception as a failed key: the door stores nothing still
    run_async(database_url, test, permanent_errors=(Exception,))
    assert stored(engine) == (1, 1)


def test_asgi_application_without_a_response_is_an_error(
    database_url: str, engine: sa.Engine
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        current_unit_of_work().publish("things.created", {"n": 1})

    async def test(aob: AsyncOutbox) -> None:
        with pytest.raises(RuntimeError, match="without a response"):
            await call(AsgiMiddleware(app, aob))

    run_async(database_url, test)
    assert stored(engine) == (0, 0)


def test_asgi_request_body_over_the_limit_without_a_length_is_413(
    database_url: str, engine: sa.Engine
) -> None:
    async def test(aob: AsyncOutbox) -> None:
        middleware = AsgiMiddleware(respond(), aob, max_request_bytes=10)
        status, _, body = await call(middleware, body=[b"x" * 6, b"x" * 6])
        assert status == 413 and json.loads(body)["status"] == 413
        status, _, _ = await call(middleware, body=[b"x" * 4], headers=[("content-length", "11")])
        assert status == 413

    run_async(database_url, test)
    assert stored(engine) == (0, 0)


def test_asgi_body_extensions_are_hidden_and_other_scopes_pass(database_url: str) -> None:
    scopes: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope)
        if scope["type"] == "http":
            await respond()(scope, receive, send)

    async def test(aob: AsyncOutbox) -> None:
        middleware = AsgiMiddleware(app, aob)
        ext = {"http.response.pathsend": {}, "tls": {"v": 1}}
        await call(middleware, extensions=ext)
        assert scopes[-1]["extensions"] == {"tls": {"v": 1}}
        await middleware({"type": "lifespan"}, None, None)
        assert scopes[-1] == {"type": "lifespan"}

    run_async(database_url, test)


def test_current_unit_of_work_reaches_threads_that_copy_the_context(database_url: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        uow = current_unit_of_work()
        # Starlette runs `def` endpoints this way: the context is copied to the thread.
        assert await asyncio.to_thread(current_unit_of_work) is uow
        await respond()(scope, receive, send)

    async def test(aob: AsyncOutbox) -> None:
        assert (await call(AsgiMiddleware(app, aob)))[0] == 201
        with pytest.raises(NoUnitOfWork, match="IdempotencyMiddleware"):
            current_unit_of_work()

    run_async(database_url, test)


def test_each_middleware_takes_its_own_flavour(database_url: str) -> None:
    async def test(aob: AsyncOutbox) -> None:
        with pytest.raises(ConfigurationError, match="needs an Outbox"):
            WsgiMiddleware(lambda environ, start: [], aob)  # type: ignore[arg-type]

    run_async(database_url, test)
    with Outbox(database_url) as ob:
        with pytest.raises(ConfigurationError, match="needs an AsyncOutbox"):
            AsgiMiddleware(respond(), ob)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="methods"):
            WsgiMiddleware(lambda environ, start: [], ob, methods="POST")


# -- WSGI -----------------------------------------------------------------------------------


def wsgi_call(
    middleware: Any, *, key: str | None = "k1", body: bytes = b'{"a":1}', chunked: bool = False
) -> tuple[str, dict[str, str], bytes]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST", "PATH_INFO": "/things", "SCRIPT_NAME": "", "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(body), "CONTENT_TYPE": "application/json",
    }  # fmt: skip
    if chunked:
        environ["wsgi.input_terminated"] = True
    else:
        environ["CONTENT_LENGTH"] = str(len(body))
    if key is not None:
        environ["HTTP_IDEMPOTENCY_KEY"] = key
    answer: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer[:] = [status, dict(headers)]
        return lambda data: None

    chunks = middleware(environ, start_response)
    try:
        data = b"".join(chunks)
    finally:
        getattr(chunks, "close", lambda: None)()
    return answer[0], answer[1], data


class Chunks:
    """A WSGI body iterable that records whether it was closed."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.pieces)

    def close(self) -> None:
        self.closed = True


def test_wsgi_bodies_of_every_shape(database_url: str, engine: sa.Engine) -> None:
    bodies: list[bytes] = []

    def listed(environ: Any, start_response: Any) -> list[bytes]:
        bodies.append(environ["wsgi.input"].read())
        current_unit_of_work().publish("things.created", {"n": 1})
        start_response("201 Made", [("Content-Type", "text/plain")])
        return [b"a", b"b"]

    def lazy(environ: Any, start_response: Any) -> Iterator[bytes]:
        current_unit_of_work().publish("things.created", {"n": 1})
        start_response("200 OK", [("Content-Length", "4")])  # called on the first next()
        yield b"ab"
        yield b"cd"

    def written(environ: Any, start_response: Any) -> list[bytes]:
        current_unit_of_work().publish("things.created", {"n": 1})
        write = start_response("200 OK", [])
        write(b"old-")
        return [b"style"]

    with Outbox(database_url) as ob:
        first = wsgi_call(WsgiMiddleware(listed, ob), body=b"x" * 100, chunked=True)
        assert first == ("201 Made", {"Content-Type": "text/plain"}, b"ab")
        assert bodies == [b"x" * 100]
        replay = wsgi_call(WsgiMiddleware(listed, ob), body=b"x" * 100)
        assert replay[0] == "201 Created" and replay[2] == b"ab"
        assert replay[1] == {
            "content-type": "text/plain", "content-length": "2", "idempotent-replayed": "true"
        }  # fmt: skip
        assert wsgi_call(WsgiMiddleware(lazy, ob), key="k2")[2] == b"abcd"
        assert wsgi_call(WsgiMiddleware(written, ob), key="k3")[2] == b"old-style"
    assert stored(engine) == (3, 3)


def test_wsgi_streaming_is_refused_and_the_body_closed(
    database_url: str, engine: sa.Engine
) -> None:
    body = Chunks([b"tick", b"tock"])

    def streaming(environ: Any, start_response: Any) -> Chunks:
        current_unit_of_work().publish("things.created", {"n": 1})
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        return body

    with Outbox(database_url) as ob:
        status, headers, data = wsgi_call(WsgiMiddleware(streaming, ob))
    assert status.startswith("500") and json.loads(data)["type"].endswith("/streaming-response")
    assert headers["content-type"] == "application/problem+json"
    assert body.closed
    assert stored(engine) == (0, 0)


def test_wsgi_limits(database_url: str, engine: sa.Engine) -> None:
    def big(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"x" * 50, b"x" * 60]

    with Outbox(database_url) as ob:
        middleware = WsgiMiddleware(big, ob, max_request_bytes=10, max_response_bytes=100)
        assert wsgi_call(middleware, body=b"x" * 11)[0].startswith("413")
        assert wsgi_call(middleware, body=b"x" * 11, chunked=True)[0].startswith("413")
        status, _, data = wsgi_call(middleware, body=b"{}")
        assert status.startswith("500") and json.loads(data)["type"].endswith("/response-too-large")
    assert stored(engine) == (0, 0)


def test_wsgi_exceptions_are_reraised_and_store_nothing(
    database_url: str, engine: sa.Engine
) -> None:
    def failing(environ: Any, start_response: Any) -> list[bytes]:
        current_unit_of_work().publish("things.created", {"n": 1})
        raise PermanentError("not for HTTP")

    config = OutboxConfig(permanent_errors=(Exception,))
    with Outbox(database_url, config=config) as ob, pytest.raises(PermanentError):
        wsgi_call(WsgiMiddleware(failing, ob))
    assert stored(engine) == (0, 0)
    with pytest.raises(NoUnitOfWork):
        current_unit_of_work()
