"""The console's ASGI app (Starlette + Jinja2 templates): :func:`create_app`.

Safe by default:

* Read-only unless the app has an admin token and the request carries it (``Authorization:
  Bearer TOKEN``, or HTTP basic with the token as password and any user name). Pages show
  no action buttons to anyone else, and every state change refuses them with 403.
* Every state change is a POST from the console's own origin (``Origin``, or
  ``Sec-Fetch-Site`` where a browser sends no ``Origin``) whose form carries the CSRF token:
  an HMAC, under a key only the server holds, of the random value in the browser's
  ``SameSite=Strict`` cookie. A cookie planted from a sibling host, with a form token of its
  own choosing, does not verify; a form posted from another origin is refused; both with 403.
* Every value goes through Jinja's autoescape; URLs are shown redacted, header values whose
  names say secret are hidden.
* A filter or an id that does not parse is a 400 with a message; a database that does not
  answer is a 503; neither shows a traceback.
* Each admin action is logged on ``outbox.console``: what, how many rows, from which address.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from outbox._core.redact import redact_text
from outbox.console.access import (
    carries_token,
    csrf_signature,
    from_own_origin,
    own_origin,
    read_form,
)
from outbox.console.pages import HERE, Console, in_thread
from outbox.console.settings import ConsoleConfig, ConsoleSettings
from outbox.errors import OutboxError, ValidationError

# The console's names keep their import path from this module, where they were first defined.
__all__ = [
    "Console",
    "ConsoleConfig",
    "ConsoleSettings",
    "carries_token",
    "create_app",
    "csrf_signature",
    "from_own_origin",
    "own_origin",
    "read_form",
]


def create_app(settings: ConsoleConfig) -> Starlette:
    """The console as an ASGI app (serve it with uvicorn, or mount it in your own app)."""
    console = Console(settings)

    def guarded(
        handler: Callable[[Request], Response | Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                result = handler(request)
                if isinstance(result, Response):
                    return result
                return await result
            except ValidationError as exc:
                return console.error(request, 400, str(exc))
            except OutboxError as exc:
                return console.error(request, 503, redact_text(str(exc)))
            except sa.exc.DBAPIError as exc:
                console.database_failed(exc)
                return console.error(
                    request, 503, "the database refused or did not answer; see the console's log"
                )

        return endpoint

    def sync(method: Callable[[Request], Response]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            return await in_thread(method, request)

        return run

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok\n")

    routes = [
        Route("/", guarded(sync(console.overview))),
        Route("/parked", guarded(sync(console.parked))),
        Route("/parked/action", guarded(console.parked_action), methods=["POST"]),
        Route("/keys", guarded(sync(console.keys))),
        Route("/dlq", guarded(sync(console.dead_letters))),
        Route("/dlq/redrive", guarded(console.redrive_groups), methods=["POST"]),
        Route("/dlq/handled", guarded(console.mark_groups_handled), methods=["POST"]),
        Route("/login", guarded(console.login)),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]

    async def server_error(request: Request, _exc: Exception) -> Response:
        return HTMLResponse(
            "<h1>500</h1><p>internal error; see the console's log</p>", status_code=500
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await run_in_threadpool(console.start_sampling)
        try:
            yield
        finally:
            console.stop_sampling()
            console.engine.dispose()

    app = Starlette(routes=routes, exception_handlers={500: server_error}, lifespan=lifespan)
    app.state.console = console
    return app
