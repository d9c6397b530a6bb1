"""``Idempotency-Key`` middleware for WSGI applications (Flask, ...).

::

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, ob, scope=tenant_of, require_key=True)

Invariant: the same decisions as the ASGI middleware, taken from the same core (``docs/http.md``).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

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
    status_line,
)
from outbox._core.http_admission import (
    HttpConfig,
    PrincipalOf,
    ScopeOf,
)
from outbox._core.http_answers import (
    Refused,
    Response,
    problem_for,
    request_too_large,
    response_too_large,
    streaming_refused,
)
from outbox._core.http_context import Abort, bound
from outbox._otel import spans
from outbox.errors import ConfigurationError, KeyInProgress, KeyReuseError, PreviouslyFailed
from outbox.uow import Outbox, UnitOfWork

_ExcInfo = tuple[type[BaseException], BaseException, TracebackType] | tuple[None, None, None] | None


class _Captured:
    """The ``start_response`` and ``write`` the application gets: they keep the response."""

    __slots__ = ("chunks", "headers", "limit", "size", "status", "status_line")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status_line: str | None = None
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0

    def start_response(
        self,
        status: str,
        headers: list[tuple[str, str]],
        exc_info: _ExcInfo = None,
    ) -> Callable[[bytes], object]:
        # Nothing has reached the client yet, so a later call (with exc_info) replaces the
        # response rather than re-raising, as PEP 3333 allows before the headers are sent.
        self.status_line = status
        self.status = int(status.split(" ", 1)[0])
        self.headers = list(headers)
        return self.write

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if data:
            self.chunks.append(data)

    def response(self) -> Response:
        return Response(self.status, self.headers, b"".join(self.chunks))


class IdempotencyMiddleware:
    """Runs covered requests in a unit of work of ``outbox`` and replays their responses.

    Same options and behaviour as :class:`outbox.http.asgi.IdempotencyMiddleware`, for a WSGI
    application and a (sync) :class:`~outbox.Outbox`.
    """

    def __init__(
        self,
        wsgi_app: WSGIApplication,
        outbox: Outbox,
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
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(
                "the WSGI middleware needs an Outbox (for an ASGI app, use outbox.http.asgi."
                f"IdempotencyMiddleware with an AsyncOutbox); got {type(outbox).__name__}"
            )
        self.app = wsgi_app
        self.outbox = outbox
        self.settings = HttpConfig(
            scope, require_key, methods, max_request_bytes, max_response_bytes,
            stored_headers, retry_after, principal, caller_headers, caller_cookies, per_caller,
        ).admission()  # fmt: skip

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        settings = self.settings
        # Methods are matched whatever their case: Werkzeug routes "post" as POST.
        method = environ["REQUEST_METHOD"].upper()
        if method not in settings.methods:
            return self.app(environ, start_response)
        headers = Headers(_header_pairs(environ))
        path = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
        raw_path, query = _raw_target(environ, path)
        request = Request(method, path, headers, query, raw_path)
        if spans is not None and TRACEPARENT_HEADER in headers:
            # Continue the caller's trace: the events published below join it. (A response
            # the middleware passes through untouched may be read after the span ended.)
            with spans.request(method, path, headers) as span:
                status = _Status(start_response)
                body = self._serve(environ, status.start_response, request)
                spans.responded(span, status.code)
                return body
        return self._serve(environ, start_response, request)

    def _serve(
        self, environ: WSGIEnvironment, start_response: StartResponse, request: Request
    ) -> Iterable[bytes]:
        settings = self.settings
        method = request.method
        try:
            covered = settings.admit(request)
            if covered is not None:
                settings.check_declared_length(environ.get("CONTENT_LENGTH") or None)
                body = _read_body(environ, settings.max_request_bytes)
        except Refused as refused:
            return _respond(start_response, refused.problem.response())
        if covered is None:
            return self.app(environ, start_response)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        caller = settings.caller_of(request)
        request_fingerprint = fingerprint(method, request.target, body, caller)
        response: Response | None = None
        line: str | None = None
        failure: BaseException | None = None
        try:
            with self.outbox.unit_of_work(covered.key, covered.scope, request_fingerprint) as uow:
                if uow.replayed:
                    stored = decode_response(uow.result)
                    response = Response(stored.status, replay_headers(stored), stored.body)
                else:
                    response, line = self._run(uow, environ)
        except Abort as abort:
            failure, response, line = abort.error, abort.response, None
        except (KeyInProgress, KeyReuseError, PreviouslyFailed) as exc:
            problem = problem_for(exc, settings.retry_after)
            assert problem is not None
            response = problem.response()
        except Refused as refused:
            response = refused.problem.response()
        if failure is not None:
            raise failure  # outside the handler above: the error keeps its own context
        assert response is not None
        return _respond(start_response, response, line)

    def _run(self, uow: UnitOfWork, environ: WSGIEnvironment) -> tuple[Response, str]:
        """Run the application inside ``uow`` with the response buffered; store it, or raise
        :class:`Abort` to roll the unit of work back."""
        limit = self.settings.max_response_bytes
        captured = _Captured(limit)
        refusal: Refused | None = None
        with bound(uow):
            try:
                chunks = self.app(environ, captured.start_response)
                try:
                    whole = isinstance(chunks, list | tuple)
                    for pieces, chunk in enumerate(chunks, 1):
                        captured.write(chunk)
                        if captured.size > limit:
                            refusal = Refused(response_too_large(limit))
                        elif not whole and is_streaming(pieces + 1, captured.headers):
                            refusal = Refused(streaming_refused())
                        if refusal is not None:
                            break
                finally:
                    close: Any = getattr(chunks, "close", None)
                    if close is not None:
                        close()
            except BaseException as exc:
                raise Abort(error=exc) from None
        if refusal is None and captured.size > limit:
            refusal = Refused(response_too_large(limit))  # all of it came through write()
        if refusal is not None:
            raise Abort(response=refusal.problem.response())
        if captured.status_line is None:
            raise Abort(error=RuntimeError("the application returned without a response"))
        response = captured.response()
        if not is_stored(response.status):
            raise Abort(response=response)
        uow.result = encode_response(
            response.status, response.headers, response.body, self.settings.stored_headers
        )
        return response, captured.status_line


class _Status:
    """The server's ``start_response``, noting the status for the request's span."""

    __slots__ = ("code", "start")

    def __init__(self, start: StartResponse) -> None:
        self.start = start
        self.code = 0

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: _ExcInfo = None
    ) -> Callable[[bytes], object]:
        self.code = int(status.split(" ", 1)[0])
        return self.start(status, headers, exc_info)


def _header_pairs(environ: WSGIEnvironment) -> Iterable[tuple[str, str]]:
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            yield name[5:].replace("_", "-").lower(), value
    for name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        value = environ.get(name)
        if value:
            yield name.replace("_", "-").lower(), value


def _read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The whole request body; 413 over ``limit``."""
    stream = environ["wsgi.input"]
    declared = environ.get("CONTENT_LENGTH")
    if declared and declared.isdigit():
        remaining = int(declared)  # at most the limit: checked before
        chunks = []
        while remaining > 0:
            chunk = stream.read(remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    if not environ.get("wsgi.input_terminated"):
        return b""  # no length and no end marker: PEP 3333 says there is no body to read
    chunks = []
    size = 0
    while chunk := stream.read(min(65536, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise Refused(request_too_large(limit))
    return b"".join(chunks)


def _respond(
    start_response: StartResponse, response: Response, line: str | None = None
) -> list[bytes]:
    start_response(line or status_line(response.status), response.headers)
    return [response.body]


def _raw_target(environ: WSGIEnvironment, path: str) -> tuple[str, str]:
    """The path as the client sent it and the query string: from ``REQUEST_URI`` or
    ``RAW_URI`` (gunicorn, Werkzeug, uWSGI), else the decoded path encoded again (wsgiref,
    where ``%2F`` and ``/`` cannot be told apart)."""
    uri = environ.get("REQUEST_URI") or environ.get("RAW_URI")
    if isinstance(uri, str) and uri:
        raw_path, _, query = uri.partition("?")
        return raw_path, query
    try:
        data = path.encode("latin-1")  # PEP 3333: the decoded bytes as ISO-8859-1 text
    except UnicodeEncodeError:
        data = path.encode("utf-8", "surrogateescape")
    return quoted_path(data), environ.get("QUERY_STRING", "")
