"""FastAPI integration: a unit of work per request, committed before the response is sent.

Invariant: :func:`unit_of_work` (a ``Depends(..., scope="function")`` dependency) commits the
request's session once the handler has returned and **before FastAPI sends the response**, so a
commit that fails (a deferred constraint, a lost connection) reaches the client as a 500, never
as a 2xx for work that did not commit; a plain ``yield`` dependency would finish after the
response. :func:`add_exception_handlers` answers the toolkit's refusals as the middlewares do.
As the middlewares do, the dependency covers the caller in the fingerprint (a stored response
is only for its own caller) and marks replays with ``Idempotent-Replayed: true``.
Needs the ``fastapi`` extra; ``docs/http.md`` shows it in use.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

try:
    from fastapi import Depends, FastAPI, Header, Request as FastAPIRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import Response as FastAPIResponse
except ModuleNotFoundError as exc:  # pragma: no cover - shown by a test in a subprocess
    raise ModuleNotFoundError(
        f"outbox.http.fastapi needs FastAPI ({exc.name} is not installed): "
        "pip install 'outbox-kit[fastapi]'",
        name=exc.name,
    ) from exc
from sqlalchemy.ext.asyncio import AsyncSession

from outbox._core.http import (
    DEFAULT_CALLER_HEADERS,
    DEFAULT_METHODS,
    DEFAULT_RETRY_AFTER,
    IDEMPOTENCY_KEY_HEADER,
    REPLAYED_HEADER,
    Headers,
    Request,
    fingerprint,
)
from outbox._core.http_admission import (
    HttpConfig,
    PrincipalOf,
    ScopeOf,
)
from outbox._core.http_answers import (
    Problem,
    Refused,
    missing_key,
    problem_for,
)
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    NoUnitOfWork,
    OutboxError,
    PreviouslyFailed,
)
from outbox.uow import AsyncOutbox, AsyncUnitOfWork

__all__ = [
    "IDEMPOTENCY_KEY_DESCRIPTION",
    "add_exception_handlers",
    "document_idempotency_key",
    "unit_of_work",
]

IDEMPOTENCY_KEY_DESCRIPTION = (
    "A unique value per operation (e.g. a UUID). A repeated request with the same key gets the "
    "first request's outcome instead of running again; a request while the first one runs gets "
    "409 with Retry-After."
)
# Every method: the dependency is attached to a route on purpose.
_ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _check_scope_support() -> None:
    if "scope" not in inspect.signature(Depends).parameters:
        raise ConfigurationError(
            "outbox.http.fastapi needs a FastAPI whose Depends() takes scope= (0.121 or later), "
            "to commit before the response is sent; upgrade FastAPI: pip install -U fastapi"
        )


def unit_of_work(
    outbox: AsyncOutbox,
    *,
    session: Callable[..., Any] | None = None,
    scope: str | ScopeOf | None = None,
    require_key: bool = True,
    principal: PrincipalOf | None = None,
    caller_headers: Iterable[str] = DEFAULT_CALLER_HEADERS,
    caller_cookies: Iterable[str] = (),
    per_caller: bool = True,
) -> Any:
    """A FastAPI dependency giving the handler the request's :class:`~outbox.AsyncUnitOfWork`.

    * ``session`` -- your dependency that yields the request's ``AsyncSession``; the unit of
      work joins it (a savepoint), and this dependency commits it after the handler returned,
      before the response. Without one, a session on ``outbox.engine`` is opened per request.
    * ``scope`` -- the key space: a string, or a callable of the :class:`~outbox.http.Request`
      (e.g. the tenant); default ``"http"``.
    * ``require_key`` -- refuse a request without ``Idempotency-Key`` (400). With ``False``,
      such a request gets ``None`` instead of a unit of work (its session is committed the same
      way).
    * ``principal``, ``caller_headers``, ``caller_cookies``, ``per_caller`` -- who the caller
      is, as for the middlewares: the fingerprint covers a digest of the caller's credentials
      (by default the ``Authorization`` header), so another caller presenting the same key
      gets a 422, never this caller's response.

    The fingerprint a reused key must match covers the method, path, query, body and caller, as
    the middlewares' does. A replay's response carries ``Idempotent-Replayed: true`` (when the
    handler returns a value; a ``Response`` it builds itself is sent as it is). The handler's
    exception rolls everything back and stores nothing, so the client's retry runs again. The
    ``Idempotency-Key`` header appears in the route's OpenAPI schema, ``required`` when
    ``require_key`` is on (:func:`add_exception_handlers` answers its absence with the
    middlewares' 400).
    """
    _check_scope_support()
    if not isinstance(outbox, AsyncOutbox):
        raise ConfigurationError(
            f"unit_of_work() needs an AsyncOutbox, got {type(outbox).__name__}"
        )
    admission = HttpConfig(
        scope, require_key, _ALL_METHODS, principal=principal, caller_headers=caller_headers,
        caller_cookies=caller_cookies, per_caller=per_caller,
    ).admission()  # fmt: skip
    # Required in the signature when the server requires it, so that OpenAPI says so; FastAPI
    # then refuses a request without it (RequestValidationError), which add_exception_handlers
    # answers with the middlewares' 400.
    key_header: Any = Header(
        ... if admission.require_key else None,
        alias="Idempotency-Key",
        description=IDEMPOTENCY_KEY_DESCRIPTION,
    )

    async def own_session() -> AsyncIterator[AsyncSession]:
        async with AsyncSession(outbox.engine, expire_on_commit=False) as own:
            yield own

    session_dependency = session if session is not None else own_session

    async def request_unit_of_work(
        request: FastAPIRequest,
        response: FastAPIResponse,
        idempotency_key: str | None = key_header,
        db: AsyncSession = Depends(session_dependency),  # noqa: B008 (FastAPI's idiom)
    ) -> AsyncIterator[AsyncUnitOfWork | None]:
        headers = Headers(request.headers.items())
        raw_path = request.scope.get("raw_path")
        target = Request(  # as the ASGI middleware sees a request: the same fingerprint
            request.method.upper(),
            request.scope["path"],
            headers,
            request.scope.get("query_string", b"").decode("latin-1"),
            raw_path.partition(b"?")[0].decode("latin-1") if isinstance(raw_path, bytes) else None,
        )
        covered = admission.admit(target)  # Refused: a 400 problem (add_exception_handlers)
        if covered is None:
            yield None
            await db.commit()
            return
        body = await request.body()  # already read and kept by FastAPI: no second read
        caller = admission.caller_of(target)  # a stored response is only for its own caller
        request_fingerprint = fingerprint(target.method, target.target, body, caller)
        async with outbox.unit_of_work(
            covered.key, covered.scope, request_fingerprint, session=db
        ) as uow:
            if uow.replayed:  # FastAPI merges these headers into the response it builds
                response.headers[REPLAYED_HEADER] = "true"
            yield uow
        await db.commit()  # before the response: a failed commit is a 500, never a 2xx

    return Depends(request_unit_of_work, scope="function")


def _problem_response(problem: Problem) -> FastAPIResponse:
    response = problem.response()
    return FastAPIResponse(
        content=response.body,
        status_code=response.status,
        headers={name: value for name, value in response.headers if name != "content-length"},
    )


def add_exception_handlers(app: FastAPI, *, retry_after: int = DEFAULT_RETRY_AFTER) -> None:
    """Answer the toolkit's refusals with the middlewares' ``application/problem+json``:
    :class:`~outbox.KeyInProgress` 409 with ``Retry-After: retry_after``,
    :class:`~outbox.KeyReuseError` and :class:`~outbox.PreviouslyFailed` 422, a malformed key
    400, a request without the key a route requires 400 "Idempotency-Key missing" (FastAPI's
    own validation error otherwise goes to the handler registered before), and
    :class:`~outbox.errors.NoUnitOfWork` (``current_unit_of_work()`` on a request that came
    without a key) 400 "Idempotency-Key missing"."""
    if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 1:
        raise ConfigurationError(f"retry_after must be a positive int, got {retry_after!r}")

    async def refused(_: FastAPIRequest, exc: Exception) -> FastAPIResponse:
        assert isinstance(exc, Refused)
        return _problem_response(exc.problem)

    async def outbox_refusal(_: FastAPIRequest, exc: Exception) -> FastAPIResponse:
        assert isinstance(exc, OutboxError)
        problem = problem_for(exc, retry_after)
        assert problem is not None
        return _problem_response(problem)

    async def no_unit_of_work(_: FastAPIRequest, exc: Exception) -> FastAPIResponse:
        return _problem_response(missing_key())

    invalid = app.exception_handlers.get(RequestValidationError)

    async def invalid_request(request: FastAPIRequest, exc: Exception) -> Any:
        assert isinstance(exc, RequestValidationError)
        for error in exc.errors():
            location = error.get("loc", ())
            if (
                error.get("type") == "missing"
                and len(location) == 2
                and location[0] == "header"
                and str(location[1]).lower() == IDEMPOTENCY_KEY_HEADER
            ):
                return _problem_response(missing_key())
        if invalid is None:  # pragma: no cover - FastAPI always registers its own
            raise exc
        answer = invalid(request, exc)
        return await answer if inspect.isawaitable(answer) else answer

    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(Refused, refused)
    for error in (KeyInProgress, KeyReuseError, PreviouslyFailed):
        app.add_exception_handler(error, outbox_refusal)
    app.add_exception_handler(NoUnitOfWork, no_unit_of_work)


def document_idempotency_key(
    app: FastAPI, *, methods: Iterable[str] = DEFAULT_METHODS, required: bool = False
) -> None:
    """Show the ``Idempotency-Key`` header in the OpenAPI schema of every operation of
    ``methods``: for apps behind :class:`outbox.http.asgi.IdempotencyMiddleware`, whose routes
    do not declare it (routes using :func:`unit_of_work` declare it themselves)."""
    covered = {m.lower() for m in methods}
    parameter = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": bool(required),
        "description": IDEMPOTENCY_KEY_DESCRIPTION,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, openapi_version=app.openapi_version,
                description=app.description, routes=app.routes,
            )  # fmt: skip
            for path in schema.get("paths", {}).values():
                for method, operation in path.items():
                    if method not in covered:
                        continue
                    parameters = operation.setdefault("parameters", [])
                    names = {(p.get("in"), p.get("name", "").lower()) for p in parameters}
                    if ("header", "idempotency-key") not in names:
                        parameters.append(dict(parameter))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
