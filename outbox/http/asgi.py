"""``Idempotency-Key`` middleware for ASGI applications (FastAPI, Starlette, ...).

::

    app.add_middleware(IdempotencyMiddleware, outbox=aob, scope=tenant_of, require_key=True)

A pure ASGI middleware: it needs no web framework. See :mod:`outbox.http` and ``docs/http.md``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from outbox._core.codec import TRACEPARENT_HEADER
from outbox._core.http import (
    DEFAULT_CALLER_HEADERS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_METHODS,
    DEFAULT_RETRY_AFTER,
    DEFAULT_STORED_HEADERS,
    Headers,
    Request,
    decode_response,
    encode_response,
    fingerprint,
    is_stored,
    is_streaming,
    quoted_path,
    replay_headers,
)
from outbox._core.http_admission import (
    HttpConfig,
    PrincipalOf,
    ScopeOf,
)
from outbox._core.http_answers import (
    Refused,
    Response,
    missing_key,
    problem_for,
    request_too_large,
    response_too_large,
    streaming_refused,
)
from outbox._core.http_context import Abort, bound
from outbox._otel import spans
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    NoUnitOfWork,
    PreviouslyFailed,
)
from outbox.uow import AsyncOutbox, AsyncUnitOfWork

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Server extensions that let an application send a body other than as body messages; a
# covered request's application must send its body in messages, to be stored.
_BODY_EXTENSIONS = frozenset({
    "http.response.pathsend", "http.response.zerocopysend", "http.response.trailers",
    "http.response.early_hint",
})  # fmt: skip


class _Refusal(BaseException):
    """Raised from ``send`` into the application to stop a response that cannot be stored."""


class _Buffer:
    """The ``send`` the application gets: keeps the response instead of sending it."""

    __slots__ = ("chunks", "headers", "limit", "pieces", "refusal", "size", "start", "status")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.start: Message | None = None
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.pieces = 0
        self.refusal: Refused | None = None

    async def send(self, message: Message) -> None:
        if self.refusal is not None:
            raise _Refusal
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
            self.status = int(message["status"])
            self.headers = [
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in message.get("headers", ())
            ]
        elif kind == "http.response.body":
            body = message.get("body", b"")
            self.size += len(body)
            self.pieces += 1
            if body:
                self.chunks.append(body)
            if self.size > self.limit:
                self.refusal = Refused(response_too_large(self.limit))
            elif message.get("more_body", False) and is_streaming(self.pieces + 1, self.headers):
                self.refusal = Refused(streaming_refused())
            if self.refusal is not None:
                raise _Refusal

    def response(self) -> Response:
        return Response(self.status, self.headers, b"".join(self.chunks))


class IdempotencyMiddleware:
    """Runs covered requests in a unit of work of ``outbox`` and replays their responses.

    * ``scope`` -- the key space: a string, or a callable receiving the
      :class:`~outbox.http.Request` (``.method``, ``.path``, ``.headers``) and returning one
      (e.g. the tenant); default ``"http"``.
    * ``require_key`` -- answer 400 to a covered request without ``Idempotency-Key``
      (default: let it through without a unit of work).
    * ``methods`` -- the covered methods; any other passes through untouched.
    * ``max_request_bytes`` / ``max_response_bytes`` -- bounds on the bodies of covered
      requests (over them: 413 before the handler runs / a 500 problem, nothing stored).
    * ``stored_headers`` -- the response headers stored and replayed with the body.
    * ``retry_after`` -- seconds in the ``Retry-After`` of a 409 (key in progress).
    * ``caller_headers`` / ``caller_cookies`` -- the request headers (default
      ``("authorization",)``) and cookies that carry the caller's credentials. The fingerprint
      covers their digest: another caller presenting the same key gets a 422, never this
      caller's response.
    * ``principal`` -- instead, a callable of the :class:`~outbox.http.Request` returning the
      caller's stable identity (an account id; ``None`` for an anonymous caller), for
      credentials that change between retries (refreshed tokens, rotated session cookies).
    * ``per_caller=False`` -- share stored responses among every caller who presents the key
      (only where the key alone identifies the caller).
    """

    def __init__(
        self,
        app: ASGIApp,
        outbox: AsyncOutbox,
        *,
        scope: str | ScopeOf | None = None,
        require_key: bool = False,
        methods: Iterable[str] = DEFAULT_METHODS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
        retry_after: int = DEFAULT_RETRY_AFTER,
        principal: PrincipalOf | None = None,
        caller_headers: Iterable[str] = DEFAULT_CALLER_HEADERS,
        caller_cookies: Iterable[str] = (),
        per_caller: bool = True,
    ) -> None:
        if not isinstance(outbox, AsyncOutbox):
            raise ConfigurationError(
                "the ASGI middleware needs an AsyncOutbox (for a WSGI app, use outbox.http.wsgi."
                f"IdempotencyMiddleware with an Outbox); got {type(outbox).__name__}"
            )
        self.app = app
        self.outbox = outbox
        self.settings = HttpConfig(
            scope, require_key, methods, max_request_bytes, max_response_bytes,
            stored_headers, retry_after, principal, caller_headers, caller_cookies, per_caller,
        ).admission()  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.settings
        # Methods are matched whatever their case: routers match "post" as POST.
        if scope["type"] != "http" or scope["method"].upper() not in settings.methods:
            await self.app(scope, receive, send)
            return
        headers = Headers(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]
        )
        raw_path = scope.get("raw_path")
        request = Request(
            scope["method"].upper(),
            scope["path"],
            headers,
            scope.get("query_string", b"").decode("latin-1"),
            # Some servers keep the query string in raw_path: the path ends at the first "?".
            raw_path.partition(b"?")[0].decode("latin-1")
            if isinstance(raw_path, bytes)
            else quoted_path(scope["path"].encode("utf-8", "surrogateescape")),
        )
        if spans is not None and TRACEPARENT_HEADER in headers:
            # Continue the caller's trace: the events published below join it.
            with spans.request(request.method, request.path, headers) as span:
                status = await self._serve(scope, receive, send, request)
                if status is not None:
                    spans.responded(span, status)
            return
        await self._serve(scope, receive, send, request)

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, request: Request
    ) -> int | None:
        """Serve a request of a covered method; returns the status sent, if this did send."""
        settings = self.settings
        headers = request.headers
        try:
            covered = settings.admit(request)
            if covered is not None:
                settings.check_declared_length(headers.get("content-length"))
                body = await _read_body(receive, settings.max_request_bytes)
        except Refused as refused:
            await _send(send, refused.problem.response())
            return refused.problem.status
        if covered is None:
            return await _without_key(self.app, scope, receive, send)
        if body is None:
            return None  # the client went away before sending its body: nothing to answer
        caller = settings.caller_of(request)
        request_fingerprint = fingerprint(request.method, request.target, body, caller)
        response: Response | None = None
        start: Message | None = None
        failure: BaseException | None = None
        try:
            async with self.outbox.unit_of_work(
                covered.key, covered.scope, request_fingerprint
            ) as uow:
                if uow.replayed:
                    stored = decode_response(uow.result)
                    response = Response(stored.status, replay_headers(stored), stored.body)
                else:
                    response, start = await self._run(uow, scope, body, receive)
        except Abort as abort:
            failure, response, start = abort.error, abort.response, None
        except (KeyInProgress, KeyReuseError, PreviouslyFailed) as exc:
            problem = problem_for(exc, settings.retry_after)
            assert problem is not None
            response = problem.response()
        except Refused as refused:
            response = refused.problem.response()
        if failure is not None:
            raise failure  # outside the handler above: the error keeps its own context
        assert response is not None
        await _send(send, response, start)
        return response.status

    async def _run(
        self, uow: AsyncUnitOfWork, scope: Scope, body: bytes, receive: Receive
    ) -> tuple[Response, Message]:
        """Run the application inside ``uow`` with the response buffered; store it, or raise
        :class:`Abort` to roll the unit of work back."""
        extensions = scope.get("extensions")
        if extensions and not _BODY_EXTENSIONS.isdisjoint(extensions):
            scope = {
                **scope,
                "extensions": {k: v for k, v in extensions.items() if k not in _BODY_EXTENSIONS},
            }
        buffer = _Buffer(self.settings.max_response_bytes)
        delivered = False

        async def receive_body() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        with bound(uow):
            try:
                await self.app(scope, receive_body, buffer.send)
            except BaseException as exc:
                if buffer.refusal is None:
                    raise Abort(error=exc) from None
        if buffer.refusal is not None:
            raise Abort(response=buffer.refusal.problem.response())
        if buffer.start is None:
            raise Abort(error=RuntimeError("the application returned without a response"))
        response = buffer.response()
        if not is_stored(response.status):
            raise Abort(response=response)
        uow.result = encode_response(
            response.status, response.headers, response.body, self.settings.stored_headers
        )
        return response, buffer.start


async def _without_key(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> int | None:
    """Pass a request without a key (none required) to the application; a handler that asks
    for the unit of work anyway (``current_unit_of_work()``) gets the 400 a missing key gets
    where one is required, not a 500: the client can fix it by sending a key."""
    started = False

    async def watched(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, watched)
    except NoUnitOfWork:
        if started:
            raise
        problem = missing_key()
        await _send(send, problem.response())
        return problem.status
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, ``None`` if the client disconnected; 413 over ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(request_too_large(limit))
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send(send: Send, response: Response, start: Message | None = None) -> None:
    """Send a complete response: the application's own start message when there is one (its
    headers exactly as it sent them), else one built from ``response``."""
    if start is None:
        start = {
            "type": "http.response.start",
            "status": response.status,
            "headers": [
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in response.headers
            ],
        }
    await send(start)
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
