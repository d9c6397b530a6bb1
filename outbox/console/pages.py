"""The console's pages and actions (:class:`Console`): each request read, refused with a message
when it may not do what it asks, answered from the templates."""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from outbox import admin
from outbox._core.deadletter_reading import choose_letters, describe_stop, format_cursor
from outbox._core.redact import redact_url
from outbox.console import chart, data
from outbox.console.access import (
    CSRF_COOKIE,
    CSRF_FIELD,
    MAX_FORM_BYTES,
    Form,
    carries_token,
    csrf_key,
    csrf_signature,
    from_own_origin,
    is_nonce,
    own_origin,
    read_form,
)
from outbox.console.readings import Readings
from outbox.console.settings import ConsoleConfig
from outbox.errors import ValidationError

log = logging.getLogger("outbox.console")

HERE = Path(__file__).resolve().parent
REFRESH_SECONDS = 10


class Console(Readings):
    """The app's state (:class:`~outbox.console.readings.Readings`), the templates, and a
    method per page and action."""

    def __init__(self, settings: ConsoleConfig) -> None:
        super().__init__(settings)
        # Every value is escaped: an event value holding <script> shows as text.
        environment = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True
        )
        environment.filters["warning"] = data.warning_html
        self.templates = Jinja2Templates(env=environment)
        self._csrf_key = csrf_key(settings.admin_token)

    def is_admin(self, request: Request) -> bool:
        return carries_token(request.headers.get("authorization"), self.settings.admin_token)

    def csrf_token(self, request: Request) -> str:
        """The form token of this browser's cookie (a new cookie when it has none)."""
        nonce = request.cookies.get(CSRF_COOKIE)
        if not is_nonce(nonce):
            nonce = getattr(request.state, "new_csrf", None) or secrets.token_urlsafe(32)
            request.state.new_csrf = nonce
        assert nonce is not None
        return csrf_signature(self._csrf_key, nonce)

    def csrf_verified(self, request: Request, offered: object) -> bool:
        nonce = request.cookies.get(CSRF_COOKIE)
        if not isinstance(offered, str) or not offered.isascii() or not is_nonce(nonce):
            return False
        assert nonce is not None
        expected = csrf_signature(self._csrf_key, nonce)
        return hmac.compare_digest(offered.encode("ascii"), expected.encode("ascii"))

    def page(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        admin_now = self.is_admin(request)
        response: Response = self.templates.TemplateResponse(
            request,
            name,
            {
                "admin": admin_now,
                "admin_possible": self.settings.admin_token is not None,
                "done": data.done_message(request.query_params.get("done")),
                "csrf": self.csrf_token(request) if admin_now else "",
                "database": redact_url(self.settings.database_url),
                "base": base_of(request),
                "refresh": None,
                **context,
            },
            status_code=status,
        )
        protect(response)
        new = getattr(request.state, "new_csrf", None)
        if new:
            response.set_cookie(CSRF_COOKIE, new, httponly=True, samesite="strict", path="/")
        return response

    def error(self, request: Request, status: int, message: str) -> Response:
        return self.page(request, "error.html", {"status": status, "message": message}, status)

    async def admin_form(self, request: Request) -> Form | Response:
        """The form of a state change, or the refusal (403) when it may not be made."""
        if not self.is_admin(request):
            why = (
                "this console is read-only: it was started without --admin-token"
                if self.settings.admin_token is None
                else "changes need the admin token (HTTP basic or bearer): sign in as admin"
            )
            return self.error(request, 403, why)
        same, said = from_own_origin(request)
        if not same:
            return self.error(
                request,
                403,
                f"the request came from another site ({said}): changes are accepted only from "
                f"the console's own pages at {own_origin(request)}",
            )
        form = await read_form(request)
        if form is None:
            raise ValidationError(
                "expected a form (application/x-www-form-urlencoded) of at most "
                f"{MAX_FORM_BYTES} bytes"
            )
        if not self.csrf_verified(request, form.get(CSRF_FIELD)):
            return self.error(
                request, 403, "the form's CSRF token is missing or stale: reload the page"
            )
        return form

    # -- pages ---------------------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        with self.engine.connect().execution_options(
            isolation_level="REPEATABLE READ", postgresql_readonly=True
        ) as conn:
            status = admin.read_status(conn, self.schema, pending=self.pending_count)
            conn.rollback()
        self.sample()
        relayed = chart.per_minute(self.samples.snapshot(), time.time())
        parked = sum(t.parked for t in status.topics)
        pending = sum(t.pending for t in status.topics)
        counted_at = status.pending_counted_at or status.taken_at
        return self.page(
            request,
            "overview.html",
            {
                "status": status,
                "parked": parked,
                "pending": pending,
                # Counted in this page's snapshot, or (a big backlog) earlier, in the background.
                "counted_now": counted_at == status.taken_at,
                "counted_at": counted_at,
                "counted_ago": _age((status.taken_at - counted_at).total_seconds()),
                "age": _age,
                "refresh": REFRESH_SECONDS,
                # Numbers only, drawn by chart.svg_bars: safe to put in the page as markup.
                "chart": Markup(chart.svg_bars(relayed)),
                "relayed_last_hour": sum(v for v in relayed if v is not None),
                "broker": self.settings.bootstrap_servers,
                "group_lags": self.group_lags(),
                "redis": None
                if self.settings.redis_url is None
                else redact_url(self.settings.redis_url),
            },
        )

    def parked(self, request: Request) -> Response:
        params = dict(request.query_params)
        where = data.parse_filter(params)
        offset = data.parse_offset(params.get("offset"))
        with self.engine.connect() as conn:
            rows, total = data.search_parked(conn, self.schema, where, offset)
            conn.rollback()
        query = data.filter_params(where)
        pages = {}
        if offset > 0:
            pages["newer"] = urlencode({**query, "offset": max(0, offset - data.PAGE_SIZE)})
        if offset + data.PAGE_SIZE < total:
            pages["older"] = urlencode({**query, "offset": offset + data.PAGE_SIZE})
        return self.page(
            request,
            "parked.html",
            {
                "rows": rows,
                "total": total,
                "offset": offset,
                "where": query,
                "described": data.describe_filter(where),
                "pages": pages,
            },
        )

    async def parked_action(self, request: Request) -> Response:
        form = await self.admin_form(request)
        if isinstance(form, Response):
            return form
        fields = dict(form)
        action = fields.get("action", "")
        if action not in ("retry", "discard"):
            raise ValidationError(f"unknown action {action[:40]!r}: retry or discard")
        where = data.parse_filter(fields)
        scope = fields.get("scope", "")
        if scope == "selected":
            event_ids: list[Any] | None = data.parse_event_ids(form.getlist("event_id"))
            if not event_ids:
                raise ValidationError("no rows selected: tick the rows to change first")
        elif scope == "matching":
            event_ids = None
        else:
            raise ValidationError(f"unknown scope {scope[:40]!r}: selected or matching")
        confirmed = fields.get("confirmed")
        return await in_thread(self._change, request, action, scope, where, event_ids, confirmed)

    def _change(
        self,
        request: Request,
        action: str,
        scope: str,
        where: data.ParkedFilter,
        event_ids: list[Any] | None,
        confirmed: str | None,
    ) -> Response:
        described = data.describe_filter(where)
        if event_ids is not None:
            described = f"{len(event_ids)} selected, {described}"
        with self.engine.begin() as conn:
            count = data.count_parked(conn, self.schema, where, event_ids)
            if confirmed != str(count):
                # First step, or the rows changed since the confirmation: (re)state the count.
                conn.rollback()
                return self.page(
                    request,
                    "confirm.html",
                    {
                        "action": action,
                        "scope": scope,
                        "count": count,
                        "described": described,
                        "where": data.filter_params(where),
                        "event_ids": [str(e) for e in event_ids or ()],
                        "changed": confirmed is not None,
                    },
                )
            changed = data.change_parked(conn, self.schema, action, where, event_ids)
        client = request.client.host if request.client else "unknown"
        log.warning("admin %s: %d parked row(s) (%s) from %s", action, changed, described, client)
        done = "put back in line" if action == "retry" else "discarded"
        query = urlencode({**data.filter_params(where), "done": f"{changed} row(s) {done}"})
        return RedirectResponse(f"{base_of(request)}/parked?{query}", status_code=303)

    def keys(self, request: Request) -> Response:
        lookup = data.parse_key_lookup(dict(request.query_params))
        found = None
        events = data.KeyEvents([], 0)
        if lookup is not None:
            with self.engine.connect() as conn:
                found, events = data.lookup_key(conn, self.schema, *lookup)
                conn.rollback()
        return self.page(
            request,
            "keys.html",
            {
                "lookup": lookup,
                "found": found,
                "events": events,
                "scope": lookup[0] if lookup else "",
                "key": lookup[1] if lookup else "",
            },
        )

    def dead_letters(self, request: Request) -> Response:
        topic = request.query_params.get("topic") or ""
        start = data.parse_dlq_cursor(request.query_params.get("from"))
        dead = admin.DeadLetters(topic, [], 0)
        if topic and self.settings.bootstrap_servers is None:
            raise ValidationError(
                "the dead-letters page reads Kafka: start the console with --bootstrap-servers"
            )
        if topic:
            dead = self._read_dead_letters(self.settings.bootstrap_servers or "", topic, start)
        return self.page(
            request,
            "dlq.html",
            {
                "topic": topic,
                "groups": [data.group_view(g) for g in dead.groups],
                "handled": dead.handled,
                "kafka": self.settings.bootstrap_servers is not None,
                "start": "" if start is None else format_cursor(start),
                "stopped": describe_stop(dead.stopped, dead.limit) if dead.stopped else "",
                "next": format_cursor(dead.stopped) if dead.stopped else "",
            },
        )

    def _read_dead_letters(
        self, bootstrap: str, topic: str, start: dict[int, int] | None
    ) -> admin.DeadLetters:
        """The groups of a page of ``topic`` still to handle (from ``start``)."""
        with self.engine.connect() as conn:
            dead = admin.read_dead_letters(
                conn,
                bootstrap,
                data.check_dlq_topic(topic),
                schema=self.schema,
                kafka_config=self.settings.kafka_config,
                limit=self.settings.dead_letters_limit,
                start=start,
            )
            conn.rollback()
        return dead

    async def redrive_groups(self, request: Request) -> Response:
        return await self._dead_letters_action(request, "redrive")

    async def mark_groups_handled(self, request: Request) -> Response:
        return await self._dead_letters_action(request, "handled")

    async def _dead_letters_action(self, request: Request, action: str) -> Response:
        form = await self.admin_form(request)
        if isinstance(form, Response):
            return form
        topic = data.check_dlq_topic(form.get("topic") or "")
        wanted = data.parse_group_ids(form.getlist("group"))
        start = data.parse_dlq_cursor(form.get("from"))
        if self.settings.bootstrap_servers is None:
            raise ValidationError(
                "start the console with --bootstrap-servers to handle dead letters"
            )
        return await in_thread(
            self._handle,
            request,
            action,
            topic,
            wanted,
            start,
            form.get("confirmed"),
            self.settings.bootstrap_servers,
        )

    def _handle(
        self,
        request: Request,
        action: str,
        topic: str,
        wanted: list[str],
        start: dict[int, int] | None,
        confirmed: str | None,
        bootstrap: str,
    ) -> Response:
        dead = self._read_dead_letters(bootstrap, topic, start)
        shown = {g.id for g in dead.groups}
        unknown = [g for g in wanted if g not in shown]
        if unknown:
            # Well-formed, but not a group this page holds (handled meanwhile, or never one).
            raise ValidationError(
                f"group {unknown[0]} is not among the dead letters of {topic} still to handle "
                "on this page: it was handled meanwhile or never existed; reload the "
                "dead-letters page"
            )
        letters, _ = choose_letters(dead.groups, wanted, ())
        if confirmed != str(len(letters)):
            # First step, or the dead letters changed since the confirmation: (re)state the count.
            return self.page(
                request,
                "dlq_confirm.html",
                {
                    "action": action,
                    "topic": topic,
                    "wanted": wanted,
                    "start": "" if start is None else format_cursor(start),
                    "count": len(letters),
                    "changed": confirmed is not None,
                },
            )
        client = request.client.host if request.client else "unknown"
        by = f"outbox console from {client}"
        with self.engine.connect() as conn:
            if action == "redrive":
                count = admin.redrive(
                    bootstrap,
                    letters,
                    kafka_config=self.settings.kafka_config,
                    connection=conn,
                    dlq_topic=topic,
                    schema=self.schema,
                    by=by,
                )
                done = f"{count} dead letter(s) redriven"
            else:
                count = admin.discard(conn, topic, letters, self.schema, by=by)
                done = f"{count} dead letter(s) marked handled"
            conn.commit()
        log.warning(
            "admin %s: %d dead letter(s) of %s (groups %s) from %s",
            "redrive" if action == "redrive" else "mark handled",
            count, topic, ", ".join(wanted), client,
        )  # fmt: skip
        params = {"topic": topic, "done": done}
        if start is not None:
            params["from"] = format_cursor(start)
        return RedirectResponse(f"{base_of(request)}/dlq?{urlencode(params)}", status_code=303)

    def login(self, request: Request) -> Response:
        if self.settings.admin_token is None:
            return self.error(request, 403, "this console is read-only: no admin token was set")
        if not self.is_admin(request):
            return PlainTextResponse(
                "sign in with any user name and the admin token as password\n",
                status_code=401,
                headers={"WWW-Authenticate": 'Basic realm="outbox console", charset="UTF-8"'},
            )
        return RedirectResponse(f"{base_of(request)}/", status_code=303)


def protect(response: Response) -> None:
    """The headers every page of the console carries."""
    # Nothing runs on these pages but their own stylesheet; none may be framed.
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'none'; frame-ancestors 'none'; form-action 'self'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    # No address leaves for another site; the console's own forms keep their Origin
    # (under no-referrer a browser sends "Origin: null" with them).
    response.headers["Referrer-Policy"] = "same-origin"


def base_of(request: Request) -> str:
    """Where this console's pages are: "" alone, ``/db/<key>`` as one database of a fleet's
    console (outbox.console.fleet), the path its links and redirects start with."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


async def in_thread(func: Callable[..., Response], *args: Any) -> Response:
    return await run_in_threadpool(func, *args)
