"""A relay fleet's console: one page of every database, each database's own console beside it.

Given the databases as ``outbox status`` and ``outbox-relay`` take them (URLs, a databases file
re-read on every visit, a discovery query), ``/`` lists each database's state, backlog, parked
rows, oldest pending event and serving session, the unhealthy first (the rows and their order
are :func:`outbox.admin.read_fleet_status`'s, the same as ``outbox status`` prints). Each name
links to that database's console under ``/db/<key>/`` (``key``: a digest of the database's
``host:port/name``, stable while the sources change), every page of it as when the console
serves that database alone; it is built on its first visit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import Receive, Scope, Send

from outbox import admin
from outbox._core.durations import format_duration
from outbox._core.redact import redact_text
from outbox.admin import DatabaseStatus
from outbox.console.access import carries_token
from outbox.console.app import create_app
from outbox.console.pages import HERE, REFRESH_SECONDS, protect
from outbox.console.settings import ConsoleConfig
from outbox.errors import ConfigurationError, OutboxError


@dataclass(frozen=True)
class FleetSources:
    """Where a fleet's databases come from (``outbox status``'s and the relay's sources)."""

    database_urls: Sequence[str] = ()
    databases_file: str | None = None
    discover_url: str | None = None
    discover_pattern: str | None = None

    def validate(self) -> FleetSources:
        if (self.discover_url is None) != (self.discover_pattern is None):
            raise ConfigurationError("--discover-url and --discover-pattern go together")
        if not (self.database_urls or self.databases_file or self.discover_url):
            raise ConfigurationError(
                "a fleet's console needs databases: --databases-file or --discover-url with "
                "--discover-pattern"
            )
        return self

    def urls(self) -> list[str]:
        """The databases now (the file and the discovery query read again)."""
        return admin.fleet_urls(
            self.database_urls, self.databases_file, self.discover_url, self.discover_pattern
        )


def database_key(identity: str) -> str:
    """The path segment of a database (``host:port/name``) in the fleet's console."""
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


class Fleet:
    """The fleet's page, and each database's console (built on its first visit)."""

    def __init__(self, sources: FleetSources, settings: ConsoleConfig) -> None:
        self.sources = sources.validate()
        self.settings = settings
        environment = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True
        )
        self.templates = Jinja2Templates(env=environment)
        self._lock = threading.Lock()
        self._urls: dict[str, str] = {}  # key -> URL, as the sources gave them last
        self._consoles: dict[str, Starlette] = {}

    def _read_urls(self) -> list[str]:
        urls = self.sources.urls()
        with self._lock:
            self._urls = {database_key(admin.identity_of(u)): u for u in urls}
        return urls

    def statuses(self) -> list[tuple[str, DatabaseStatus]]:
        """Every database's status with its key, the unhealthy first."""
        urls = self._read_urls()
        statuses = admin.read_fleet_status(urls, self.settings.schema)
        return [(database_key(s.database), s) for s in statuses]

    def page(self, request: Request) -> Response:
        try:
            rows = self.statuses()
        except OutboxError as exc:
            response = self._render(request, "error.html", {"status": 503,
                                    "message": redact_text(str(exc))}, 503)  # fmt: skip
            return response
        unhealthy = [s for _, s in rows if not s.healthy]
        return self._render(
            request,
            "fleet.html",
            {"rows": rows, "unhealthy": unhealthy, "refresh": REFRESH_SECONDS},
        )

    def _render(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        response: Response = self.templates.TemplateResponse(
            request,
            name,
            {
                # Changes are made on a database's own pages; this one only reads.
                "admin": carries_token(
                    request.headers.get("authorization"), self.settings.admin_token
                ),
                "admin_possible": False,
                "base": "",
                "fleet_page": True,
                "database": f"a fleet of {len(self._urls)} database(s)",
                "refresh": None,
                "age": lambda s: "-" if s is None else format_duration(s),
                **context,
            },
            status_code=status,
        )
        protect(response)
        return response

    async def console_of(self, key: str) -> Starlette | None:
        """The console of the database ``key`` (None: no such database in the sources)."""
        with self._lock:
            app = self._consoles.get(key)
            url = self._urls.get(key)
        if app is not None:
            return app
        if url is None:
            await run_in_threadpool(self._read_urls)
            with self._lock:
                url = self._urls.get(key)
            if url is None:
                return None
        settings = dataclasses.replace(self.settings, database_url=url).validate()
        app = create_app(settings)
        with self._lock:
            if key in self._consoles:  # built meanwhile by another request
                return self._consoles[key]
            self._consoles[key] = app
        await run_in_threadpool(app.state.console.start_sampling)
        return app

    async def database(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI: a page of one database's console (``/db/<key>/...``)."""
        app = await self.console_of(scope["path_params"]["key"])
        if app is None:
            response = PlainTextResponse("no such database in this fleet\n", status_code=404)
            await response(scope, receive, send)
            return
        await app(scope, receive, send)

    def close(self) -> None:
        with self._lock:
            consoles, self._consoles = list(self._consoles.values()), {}
        for app in consoles:
            app.state.console.stop_sampling()
            app.state.console.engine.dispose()


def create_fleet_app(sources: FleetSources, settings: ConsoleConfig) -> Starlette:
    """The fleet's console as an ASGI app: each database's console has ``settings`` with that
    database's URL (``settings.database_url`` itself is not read)."""
    fleet = Fleet(sources, settings)

    async def page(request: Request) -> Response:
        response: Response = await run_in_threadpool(fleet.page, request)
        return response

    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok\n")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await run_in_threadpool(fleet.close)

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/healthz", healthz),
            Mount("/db/{key}", app=fleet.database),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ],
        lifespan=lifespan,
    )
    app.state.fleet = fleet
    return app
